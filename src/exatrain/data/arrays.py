"""Generic array data sets: HDF5 and NumPy files as map-style (x, y) Datasets.

Layouts (sample i is `x[i]`, `y[i]`; names are arguments):

  HDF5, one file       datasets `x` (N, ...) and `y` (N, ...) with the sample on the first axis
                       (any dtype; chunked or not). Reads one sample per item (a hyperslab).
  HDF5, a directory    one file per sample (*.h5 / *.hdf5, sorted by name), each with datasets
                       `x` (...) and `y` (...) holding that sample; the sample id is the file
                       stem.
  .npy pair            `x` = path of an (N, ...) array, `y` = path of an (N, ...) array
                       (memory-mapped: only the samples read are loaded).
  .npz                 one archive with arrays named `x` and `y` (N, ...) (an .npz member is
                       loaded whole when first read).

x is returned as float32; y as int64 if it is integer (class labels), float32 otherwise.
`sample_ids()` names every sample (index in a file, stem for a directory), for predictions.

Reading by blocks (HDF5): `HDF5Dataset.read(index, region)` reads only the hyperslab `region`
(one slice per spatial dim) of sample `index`'s input, and its whole target. Under the `space`
axis `et.fit` calls it with each rank's block (`SpatialBlocks`), so a rank reads
V_block / V of each sample's input bytes: B_x · V_block / V + B_y bytes per sample (B_x, B_y the
stored bytes of one sample's input and target, V the sample's voxels). `read_counter` counts them
over the process and its loader workers (data/reads.py): the bytes of the selected elements as
stored, which are the bytes read from the file for uncompressed data (a chunked file reads whole
chunks: chunk the file by the blocks, e.g. (1, C, D/2, H, W/2), to read no more).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError, MissingFileError
from .reads import ReadCounter


def _as_tensors(x, y):
    x = torch.from_numpy(np.array(x, dtype=np.float32))   # a copy: memory maps are read-only
    y = np.asarray(y)
    y = torch.from_numpy(np.array(y, dtype=np.int64 if y.dtype.kind in "iub" else np.float32))
    return x, y


class HDF5Dataset(Dataset):
    """(x, y) samples from one HDF5 file or a directory of per-sample files (see module doc).

    Under `Plan(space=...)`, `et.fit` reads only each rank's block of every input with
    `read(index, region)`; the targets are read whole (the model's output is gathered whole for
    your loss, so it meets whole targets).

    Args:
        path: an HDF5 file holding datasets `x` and `y` (first dim: samples), or a directory
            of one file per sample.
        x: the name of the inputs' dataset.
        y: the name of the targets' dataset.
        transform: applied to each input `x` as it is read (a numpy array); None: none. Under
            `space` it gets the rank's block: it must act voxel by voxel (a log, a scaling).
        channels: where the inputs' channel dim is stored: "first" (C, *spatial), as the
            model takes it, or "last" (*spatial, C), moved first as it is read.
    """

    def __init__(self, path: str | Path, x: str = "x", y: str = "y", transform: Callable | None = None,
                 channels: str = "first"):
        if channels not in ("first", "last"):
            raise ValueError(f"channels must be 'first' or 'last', got {channels!r}")
        self.path, self.x_name, self.y_name, self.transform = Path(path), x, y, transform
        self.channels = channels
        self.read_counter = ReadCounter()
        self._handle, self._pid = None, None
        if not self.path.exists():
            raise MissingFileError(f"HDF5 data not found: {self.path}")
        self.files = sorted(p for p in self.path.iterdir() if p.suffix in (".h5", ".hdf5")) \
            if self.path.is_dir() else [self.path]
        if not self.files:
            raise MissingFileError(f"{self.path}: a directory with no .h5/.hdf5 files")
        with h5py.File(self.files[0], "r") as f:
            for name in (x, y):
                if name not in f:
                    raise DataError(f"{self.files[0]}: no dataset {name!r}; it has "
                                    f"{', '.join(sorted(f.keys()))}")
            if self.path.is_dir():
                self.stored_shape, self._len = tuple(f[x].shape), len(self.files)
            else:
                self.stored_shape, self._len = tuple(f[x].shape[1:]), f[x].shape[0]
                if f[y].shape[0] != self._len:
                    raise DataError(f"{self.path}: {x!r} has {self._len} samples but {y!r} has "
                                    f"{f[y].shape[0]}")
        # one input as the model takes it: (C, *spatial)
        shape = self.stored_shape
        self.sample_shape = (shape[-1], *shape[:-1]) if channels == "last" and shape else shape

    def __len__(self) -> int:
        return self._len

    @property
    def bytes_read(self) -> int:
        """Bytes read so far by this process and its loader workers (inputs and targets)."""
        return self.read_counter.bytes

    def __getstate__(self):
        return {**self.__dict__, "_handle": None, "_pid": None}  # h5py handles stay per process

    def _file(self) -> h5py.File:
        if self._handle is None or self._pid != os.getpid():
            self._handle, self._pid = h5py.File(self.path, "r"), os.getpid()
        return self._handle

    def __getitem__(self, index: int):
        return self.read(index)

    def read(self, index: int, region: tuple[slice, ...] | None = None):
        """Sample `index` as (x, y); `region` (one slice per spatial dim of x, in the model's
        (d, h, w) order) reads only that hyperslab of x, and y whole."""
        if not 0 <= index < self._len:
            raise IndexError(f"sample {index} out of range for {self._len} samples in {self.path}")
        spatial = len(self.sample_shape) - 1
        if region is None:
            region = (slice(None),) * spatial
        elif len(region) != spatial or not all(isinstance(r, slice) for r in region):
            raise DataError(f"{self.path}: a block of {self.x_name!r} (one input {self.sample_shape},"
                            f" channels {self.channels}) needs {spatial} slices, got {region!r}")
        select = (*region, slice(None)) if self.channels == "last" else (slice(None), *region)
        if self.path.is_dir():
            with h5py.File(self.files[index], "r") as f:
                x, y = f[self.x_name][select], f[self.y_name][...]
        else:
            f = self._file()
            x, y = f[self.x_name][(index, *select)], f[self.y_name][index]
        self.read_counter.add(x.nbytes + np.asarray(y).nbytes)
        if self.channels == "last":
            x = np.moveaxis(x, -1, 0)
        if self.transform is not None:
            x = self.transform(x)
        return _as_tensors(x, y)

    def sample_ids(self) -> list[str]:
        if self.path.is_dir():
            return [p.stem for p in self.files]
        return [str(i) for i in range(self._len)]


class NumpyDataset(Dataset):
    """(x, y) samples from an .npy pair (`x`, `y` are paths) or an .npz (`x`, `y` are names).

    Args:
        x: the inputs' .npy path, or an .npz path holding array `x` (inputs).
        y: with an .npy: the targets' .npy path; with an .npz: the targets' array name
            (None: `y`).
        transform: applied to each `(x, y)` pair as it is read; None: none.
    """

    def __init__(self, x: str | Path, y: str | Path | None = None,
                 transform: Callable | None = None):
        self.transform = transform
        source = Path(x)
        if not source.exists():
            raise MissingFileError(f"NumPy data not found: {source}")
        if source.suffix == ".npz":
            archive = np.load(source)
            names = (y or "x", "y") if y is None else ("x", y)
            missing = [n for n in names if n not in archive.files]
            if missing:
                raise DataError(f"{source}: no array(s) {missing}; it has {archive.files}")
            self.x, self.y = archive[names[0]], archive[names[1]]
        else:
            if y is None:
                raise DataError(f"{source}: an .npy x needs the path of its .npy targets (y=...)")
            self.x, self.y = np.load(source, mmap_mode="r"), np.load(y, mmap_mode="r")
        if len(self.x) != len(self.y):
            raise DataError(f"{source}: x has {len(self.x)} samples but y has {len(self.y)}")
        self.sample_shape = tuple(self.x.shape[1:])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        x = self.x[index]
        if self.transform is not None:
            x = self.transform(x)
        return _as_tensors(x, self.y[index])

    def sample_ids(self) -> list[str]:
        return [str(i) for i in range(len(self))]
