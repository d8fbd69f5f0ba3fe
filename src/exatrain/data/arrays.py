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


def _as_tensors(x, y):
    x = torch.from_numpy(np.array(x, dtype=np.float32))   # a copy: memory maps are read-only
    y = np.asarray(y)
    y = torch.from_numpy(np.array(y, dtype=np.int64 if y.dtype.kind in "iub" else np.float32))
    return x, y


class HDF5Dataset(Dataset):
    """(x, y) samples from one HDF5 file or a directory of per-sample files (see module doc).

    Args:
        path: an HDF5 file holding datasets `x` and `y` (first dim: samples), or a directory
            of one file per sample.
        x: the name of the inputs' dataset.
        y: the name of the targets' dataset.
        transform: applied to each `(x, y)` pair as it is read; None: none.
    """

    def __init__(self, path: str | Path, x: str = "x", y: str = "y", transform: Callable | None = None):
        self.path, self.x_name, self.y_name, self.transform = Path(path), x, y, transform
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
                self.sample_shape, self._len = tuple(f[x].shape), len(self.files)
            else:
                self.sample_shape, self._len = tuple(f[x].shape[1:]), f[x].shape[0]
                if f[y].shape[0] != self._len:
                    raise DataError(f"{self.path}: {x!r} has {self._len} samples but {y!r} has "
                                    f"{f[y].shape[0]}")

    def __len__(self) -> int:
        return self._len

    def __getstate__(self):
        return {**self.__dict__, "_handle": None, "_pid": None}  # h5py handles stay per process

    def _file(self) -> h5py.File:
        if self._handle is None or self._pid != os.getpid():
            self._handle, self._pid = h5py.File(self.path, "r"), os.getpid()
        return self._handle

    def __getitem__(self, index: int):
        if not 0 <= index < self._len:
            raise IndexError(f"sample {index} out of range for {self._len} samples in {self.path}")
        if self.path.is_dir():
            with h5py.File(self.files[index], "r") as f:
                x, y = f[self.x_name][...], f[self.y_name][...]
        else:
            f = self._file()
            x, y = f[self.x_name][index], f[self.y_name][index]
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
