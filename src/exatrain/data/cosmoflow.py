"""CosmoFlow data: the targets, the HDF5 reader and the on-device decoder.

CosmoFlow (MLPerf HPC) regresses cosmological parameters from 3D dark-matter density
cubes with 4 channels (the same volume at four redshifts).  The targets here are
``(Omega_m, sigma_8, n_s, H0)`` -- matter density, rms fluctuation in 8 Mpc/h spheres,
primordial spectral index, Hubble constant in km/s/Mpc -- each drawn uniformly from
``PARAM_LOW..PARAM_HIGH`` and stored normalised to [-1, 1] as ``2 (p - low) / (high - low) - 1``.

The synthetic generator, with real cosmological signal, is `data.cosmoflow_synth`
(`write_cosmoflow`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from .batches import BufferRing, Collated, batch_buffer
from ..errors import DataError, MissingFileError

PARAM_NAMES = ("Omega_m", "sigma_8", "n_s", "H0")
# The Quijote latin hypercube's ranges (Villaescusa-Navarro et al. 2020, ApJS 250, 2), a simulation
# suite made for machine-learning inference of these parameters. Narrower ranges (the v1 generator's
# Omega_m 0.2-0.4, n_s 0.90-1.02, H0 60-80) leave n_s and H0 beyond what a 32³ box can tell apart:
# ridge regression on the binned power spectra of 7,168 samples reached 0.76 and 0.73 of the
# predict-the-mean MAE for them, and the CNN learned neither within 3 minutes in some seeds
# (measured: docs/get-started/first-run.md, "The default job's figures"). With these ranges ridge
# reaches 0.52 and 0.76.
PARAM_LOW = (0.10, 0.60, 0.80, 50.0)
PARAM_HIGH = (0.50, 1.00, 1.20, 90.0)
REDSHIFTS = (0.0, 0.5, 1.5, 3.0)
_HINT = "create a synthetic data set with `exatrain data cosmoflow --out DIR`"
CHUNK_EDGE = 16  # HDF5 chunk edge of the written cubes (32 KiB chunks of int16 × 4 channels)


def normalise_params(params: np.ndarray) -> np.ndarray:
    """Physical parameters (..., 4) -> targets in [-1, 1] over ``PARAM_LOW..PARAM_HIGH``."""
    lo, hi = np.asarray(PARAM_LOW), np.asarray(PARAM_HIGH)
    return (2 * (np.asarray(params) - lo) / (hi - lo) - 1).astype(np.float32)


def parameter_ranges(path: Path, default) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) of the physical parameters that a data set's targets are normalised over:
    the attributes its writer stored (`path` a directory with train.h5, or the file), else
    `default` (MLPerf files hold normalised targets only)."""
    path = Path(path)
    file = path / "train.h5" if path.is_dir() else path
    if file.is_file():
        with h5py.File(file, "r") as f:
            if "param_low" in f.attrs and "param_high" in f.attrs:
                return (np.asarray(f.attrs["param_low"], dtype=np.float64),
                        np.asarray(f.attrs["param_high"], dtype=np.float64))
    return np.asarray(default[0], dtype=np.float64), np.asarray(default[1], dtype=np.float64)


def sample_files(path: Path) -> list[tuple[Path, ...]]:
    """The files of each sample of a split, in the data set's index order: one tuple per sample
    (an MLPerf .h5/.hdf5 file; an MLPerf numpy pair NAME_data.npy, NAME_label.npy); [] when
    `path` is a file holding every sample (exatrain's layout). What `CosmoFlowDataset` reads and
    staging copies (data.stage)."""
    path = Path(path)
    if not path.is_dir():
        return []
    if any(path.glob("*_data.npy")):
        pairs = [(data, _label_file(data)) for data in sorted(path.glob("*_data.npy"))]
        for data, label in pairs:
            if not label.exists():
                raise MissingFileError(f"{data} has no targets file {label.name}")
        return pairs
    return [(p,) for p in sorted(p for p in path.iterdir() if p.suffix in (".h5", ".hdf5"))]


class CosmoFlowDataset(Dataset):
    """CosmoFlow samples as ``(x, y)``: x float32 (4, S, S, S) channels first, y float32 (4,).

    ``path`` is one of the layouts:

    * a file in the exatrain layout: ``x`` (N, S, S, S, 4) integer counts, ``y`` (N, 4) float32;
    * a directory of MLPerf HPC per-sample ``.h5``/``.hdf5`` files, each with ``full``
      (S, S, S, 4) integer counts and ``unitPar`` (4,) float targets;
    * a directory of MLPerf's preprocessed numpy pairs: ``NAME_data.npy`` (S, S, S, 4) int16 and
      ``NAME_label.npy`` (4,) float32 (memory-mapped: a block reads only its voxels).

    (The MLPerf ``train/`` and ``validation/`` subdirectories are found by the workload.)  ``transform`` is ``"log1p"`` (as the
    MLPerf reference does), ``None`` (raw counts as float32) or a callable on the float32 array.
    ``bytes_read`` counts the bytes of data read from files by this process (selected voxels
    and targets; equal to the file bytes because the data are stored uncompressed).
    HDF5 handles are opened lazily, per process, and never pickled.

    ``raw = True`` delivers the stored counts instead: x as read, (S, S, S, 4) in the file's
    integer dtype (channels last, no transform, no copy into float32: half the bytes of float32
    for int16, and no loader time spent on arithmetic); `CountsDecoder` then decodes whole
    batches on the device. ``transform`` is ignored while ``raw`` is set.

    Each sample is checked as it is read: negative counts (which log1p makes non-finite) and
    targets that are not 4 finite values are a ``DataError`` naming the file and the sample.
    """

    def __init__(self, path, transform: str | Callable | None = "log1p"):
        self.path = Path(path)
        self.raw = False
        if transform not in ("log1p", None) and not callable(transform):
            raise ValueError(f"transform must be 'log1p', None or a callable, got {transform!r}")
        self.transform = transform
        self.bytes_read = 0
        self._handle, self._pid = None, None
        self._ring, self._ring_pid = None, None  # a loader worker's batch buffers (BufferRing)
        if not self.path.exists():
            raise MissingFileError(f"CosmoFlow data not found: {self.path}; {_HINT}")
        if self.path.is_dir() and any(self.path.glob("*_data.npy")):
            # MLPerf's preprocessed numpy: NAME_data.npy (S, S, S, 4) int16, NAME_label.npy (4,) f32
            self.layout = "numpy"
            self.files = [data for data, _ in sample_files(self.path)]
            first = np.load(self.files[0], mmap_mode="r")
            self.sample_shape, self.dtype = self._check_x(first, self.files[0], 0), first.dtype
            self._len = len(self.files)
        elif self.path.is_dir():
            self.layout = "mlperf"
            self.files = [file for file, in sample_files(self.path)]
            if not self.files:
                raise MissingFileError(f"no .h5/.hdf5 sample files in {self.path}; {_HINT}")
            with self._open_sample_file(0) as f:
                self.sample_shape = self._check_x(f["full"], self.files[0], 0)
                self.dtype = f["full"].dtype
            self._len = len(self.files)
        else:
            self.layout, self.files = "exatrain", [self.path]
            try:
                with h5py.File(self.path, "r") as f:
                    self.sample_shape = self._check_x(f["x"], self.path, 0, batched=True)
                    self.dtype = f["x"].dtype
                    self._len = f["x"].shape[0]
                    if f["y"].shape != (self._len, 4):
                        raise DataError(f"{self.path}: y has shape {f['y'].shape}, "
                                        f"expected ({self._len}, 4)")
            except (OSError, KeyError) as e:
                raise DataError(
                    f"{self.path}: not a readable CosmoFlow file (sample 0): {e}") from e

    def __len__(self) -> int:
        return self._len

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handle"], state["_pid"] = None, None  # h5py handles must not cross processes
        state["_ring"], state["_ring_pid"] = None, None  # nor a worker's buffers
        return state

    def close(self) -> None:
        if self._handle is not None and self._pid == os.getpid():
            self._handle.close()
        self._handle, self._pid = None, None

    def _file(self) -> h5py.File:
        # reopen after fork/spawn: a handle inherited from the parent is not safe to use
        if self._handle is None or self._pid != os.getpid():
            self._handle, self._pid = h5py.File(self.path, "r"), os.getpid()
        return self._handle

    def _open_sample_file(self, index: int) -> h5py.File:
        file = self.files[index]
        try:
            f = h5py.File(file, "r")
        except OSError as e:
            raise DataError(f"{file}: corrupt or unreadable HDF5 file (sample {index}): {e}") from e
        if "full" not in f or "unitPar" not in f:
            f.close()
            raise DataError(
                f"{file} (sample {index}): expected MLPerf datasets 'full' and 'unitPar'; "
                f"for a directory written by exatrain pass DIR/train.h5 or DIR/val.h5")
        return f

    @staticmethod
    def _check_x(ds, file, index, batched=False) -> tuple:
        shape = ds.shape[1:] if batched else ds.shape
        cube = len(shape) == 4 and shape[0] == shape[1] == shape[2] and shape[3] == 4
        if not cube or ds.dtype.kind not in "iu":
            raise DataError(
                f"{file} (sample {index}): expected integer counts of shape (S, S, S, 4), "
                f"got {ds.dtype} {tuple(shape)}")
        return tuple(shape)

    def read(self, index: int, region: tuple[slice, slice, slice] | None = None, out=None):
        """Sample ``index``; ``region`` = three slices over (d, h, w) reads only that hyperslab.
        ``out`` (raw only): a numpy array of the block's shape and stored dtype to read into."""
        if not -self._len <= index < self._len:
            raise IndexError(f"sample {index} out of range for {self._len} samples in {self.path}")
        index = int(index) % self._len
        if region is None:
            region = (slice(None),) * 3
        if len(region) != 3 or not all(isinstance(s, slice) for s in region):
            raise TypeError(f"region must be a tuple of three slices, got {region!r}")
        sel = (*region, slice(None))
        file = self.files[0 if self.layout == "exatrain" else index]
        try:
            if self.layout == "numpy":
                cube = np.load(file, mmap_mode="r")
                if self._check_x(cube, file, index) != self.sample_shape:
                    raise DataError(f"{file} (sample {index}): shape {cube.shape} differs "
                                    f"from the data set's {self.sample_shape}")
                raw, y = cube[sel], np.load(_label_file(file))
                # a copy: read now, and writable (torch warns of a tensor on a read-only map)
                raw = np.array(raw) if out is None else np.copyto(out, raw) or out
            elif self.layout == "exatrain":
                f = self._file()
                raw, y = _read_hdf5(f["x"], (index, *sel), out), f["y"][index]
            else:
                with self._open_sample_file(index) as f:
                    if self._check_x(f["full"], file, index) != self.sample_shape:
                        raise DataError(f"{file} (sample {index}): shape {f['full'].shape} differs "
                                        f"from the data set's {self.sample_shape}")
                    raw, y = _read_hdf5(f["full"], sel, out), f["unitPar"][...]
        except (OSError, KeyError) as e:
            raise DataError(f"{file}: cannot read sample {index}: {e}") from e
        self.bytes_read += raw.nbytes + y.nbytes
        y = np.asarray(y, dtype=np.float32).reshape(-1)
        if y.shape != (4,) or not np.all(np.isfinite(y)):
            raise DataError(f"{file} (sample {index}): targets must be 4 finite values, got {y}")
        if raw.dtype.kind == "i" and raw.size and raw.min() < 0:
            raise _negative_counts(raw, file, index, region, self.sample_shape)
        if self.raw:  # torch has no uint16/uint32 arithmetic on every device: widen those
            raw = raw if raw.dtype in _TORCH_INTS else raw.astype(np.int32)
            return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(y)
        x = np.ascontiguousarray(np.moveaxis(raw, -1, 0), dtype=np.float32)
        if self.transform == "log1p":
            x = np.log1p(x)  # compresses the heavy-tailed counts, as the MLPerf reference does
        elif callable(self.transform):
            x = np.asarray(self.transform(x), dtype=np.float32)
        return torch.from_numpy(x), torch.from_numpy(y)

    def __getitem__(self, index: int):
        return self.read(index)

    def __getitems__(self, indices: list[int]):
        """A whole batch (the DataLoader's batched fetch). Raw counts are read straight into one
        batch buffer, inside a loader worker one of its reused shared-memory buffers: no
        per-sample array, no stacking copy, one hand-over to the training process (`Collated`,
        `BufferRing`, see data.batches)."""
        return self.read_batch(indices)

    def read_batch(self, indices: list[int], region: tuple[slice, slice, slice] | None = None):
        if not self.raw or self.dtype not in _TORCH_INTS:
            return [self.read(i, region) for i in indices]
        shape = self.sample_shape if region is None else tuple(
            len(range(*r.indices(n))) for r, n in zip(region, self.sample_shape[:3])) + (4,)
        if self._ring_pid != os.getpid():  # one ring per process (each worker has its own)
            self._ring, self._ring_pid = BufferRing(), os.getpid()
        x, lease = batch_buffer((len(indices), *shape), self.dtype, self._ring)
        ys = [self.read(i, region, out=x[j].numpy())[1] for j, i in enumerate(indices)]
        return Collated.of((x, torch.stack(ys)), lease)

    def sample_ids(self) -> list[str]:
        """Index in a file; file name (without suffix) in a per-sample directory."""
        if self.layout == "exatrain":
            return [str(i) for i in range(self._len)]
        return [f.name.removesuffix("_data.npy").removesuffix(f.suffix) for f in self.files]

    def targets(self) -> np.ndarray:
        """All targets (N, 4) float32, reading only the target datasets."""
        if self.layout == "exatrain":
            y = np.asarray(self._file()["y"][...], dtype=np.float32)
        elif self.layout == "numpy":
            y = np.stack([np.load(_label_file(f)).astype(np.float32).reshape(-1) for f in self.files])
        else:
            ys = []
            for i in range(self._len):
                with self._open_sample_file(i) as f:
                    ys.append(np.asarray(f["unitPar"][...], dtype=np.float32).reshape(-1))
            y = np.stack(ys)
        self.bytes_read += y.nbytes
        if y.shape[1:] != (4,) or not np.all(np.isfinite(y)):
            bad = int(np.argwhere(~np.isfinite(y).all(axis=1))[0, 0]) if y.shape[1:] == (4,) else 0
            raise DataError(
                f"{self.files[0 if self.layout == 'exatrain' else bad]} (sample {bad}): "
                f"targets must be 4 finite values")
        return y


def _negative_counts(raw: np.ndarray, file, index: int, region, shape) -> DataError:
    """The refusal of a block with negative counts, naming where the first one lies.

    Particle counts are never negative; log1p makes -inf or NaN of -1 and below (numpy warns,
    torch is silent), and the run would stop many steps later at a non-finite loss that names no file.
    A negative count is most often an overflow: counts above 32767 written as int16 wrap round."""
    bad = raw < 0
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    start = [s.indices(n)[0] for s, n in zip(region, shape[:3])] + [0]  # a block's origin
    voxel = tuple(w + o for w, o in zip(where, start))
    return DataError(
        f"{file} (sample {index}): {int(bad.sum())} negative particle counts, the first "
        f"{int(raw[where])} at (d, h, w, channel) = {voxel}; counts must be >= 0 (log1p of a "
        f"negative count is not finite). Regenerate the data set (exatrain data cosmoflow "
        f"--out DIR), or convert it again with a dtype that holds the largest count (int16 "
        f"wraps counts above 32767 round to negative ones).")


_TORCH_INTS = (np.dtype(np.int16), np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint8),
               np.dtype(np.int8))


class CountsDecoder:
    """Raw counts -> the model's input, on whatever device the batch is: (N, S, S, S, 4) integers
    -> (N, 4, S, S, S) float32, log1p, then (v - mean) / std when `mean`/`std` are given (the
    `Standardize` of the data set, see workloads.cosmoflow). The result is a channels-last view of
    the batch (the stored layout), so a channels-last model takes it without a copy. Floating
    inputs (already decoded) are returned unchanged; spatial blocks decode like whole cubes.

    The arithmetic is the CPU transform's, in float32 (equal up to the last bit of log1p)."""

    def __init__(self, log1p: bool = True, mean: float | None = None, std: float | None = None):
        self.log1p, self.mean, self.std = log1p, mean, std

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            return x
        if x.dim() != 5 or x.shape[-1] != 4:
            raise ValueError(f"CountsDecoder: expected raw counts (N, D, H, W, 4), got "
                             f"{x.dtype} {tuple(x.shape)}")
        x = x.permute(0, 4, 1, 2, 3).float()  # keeps the NDHWC memory: channels-last strides
        if self.log1p:
            x.log1p_()
        if self.mean is not None:
            x.sub_(self.mean).div_(self.std)
        return x


def _read_hdf5(dataset, selection, out):
    """dataset[selection], or read into `out` (HDF5 copies the chunks straight there)."""
    if out is None:
        return dataset[selection]
    dataset.read_direct(out, source_sel=selection)
    return out


def _label_file(data_file: Path) -> Path:
    return data_file.with_name(data_file.name.removesuffix("_data.npy") + "_label.npy")


def predict_mean_baseline_mae(train_set, val_set) -> float:
    """MAE on ``val_set`` of always predicting the mean training target (averaged over the 4 targets).

    A model must beat this number to have learnt anything; for uniform targets in [-1, 1] it is ~0.5.
    """
    return float(predict_mean_baseline_per_target(train_set, val_set).mean())


def predict_mean_baseline_per_target(train_set, val_set) -> np.ndarray:
    """The same baseline for each target separately: (4,) MAEs in PARAM_NAMES order."""
    def ys(ds):
        if hasattr(ds, "targets"):
            return np.asarray(ds.targets(), dtype=np.float64)
        return np.stack([np.asarray(ds[i][1], dtype=np.float64) for i in range(len(ds))])

    mean = ys(train_set).mean(axis=0)
    return np.abs(ys(val_set) - mean).mean(axis=0)
