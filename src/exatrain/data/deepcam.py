"""DeepCAM climate segmentation data: the HDF5 layout, its channels, and its reader.

Storage layout (the one of the real DeepCAM / MLPerf-HPC data set)::

    out_dir/
        train/data-000000.h5  ...     one file per sample
        val/data-000175.h5    ...
        stats.h5                      climate/{mean,std,minval,maxval} per channel,
                                      climate/class_frequencies (from train)
        stats.json                    the same, human readable

Each sample file holds ``climate/data`` ``(H, W, C)`` float32 (channels last)
and ``climate/labels_0`` ``(H, W)`` integer labels
(0 = background, 1 = tropical cyclone, 2 = atmospheric river).

Channels (CAM5 names and units, in the real DeepCAM order)::

     0 TMQ     total precipitable water          kg m^-2
     1 U850    zonal wind at 850 hPa             m s^-1
     2 V850    meridional wind at 850 hPa        m s^-1
     3 UBOT    zonal wind, lowest level          m s^-1
     4 VBOT    meridional wind, lowest level     m s^-1
     5 QREFHT  reference-height humidity         kg kg^-1
     6 PS      surface pressure                  Pa
     7 PSL     sea-level pressure                Pa
     8 T200    temperature at 200 hPa            K
     9 T500    temperature at 500 hPa            K
    10 PRECT   total precipitation rate          m s^-1
    11 TS      surface temperature               K
    12 TREFHT  reference-height temperature      K
    13 Z1000   geopotential height of 1000 hPa   m
    14 Z200    geopotential height of 200 hPa    m
    15 ZBOT    height of the lowest level        m

The synthetic generator is `data.deepcam_synth` (the fields and their labels) and
`data.deepcam_write` (`write_deepcam`: a data set in this layout, with its statistics).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any
from pathlib import Path

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError, MissingFileError

__all__ = [
    "CHANNEL_NAMES",
    "CLASS_NAMES",
    "load_deepcam_stats",
    "DeepCAMDataset",
    "FieldsDecoder",
]

CHANNEL_NAMES: tuple[str, ...] = (
    "TMQ", "U850", "V850", "UBOT", "VBOT", "QREFHT", "PS", "PSL",
    "T200", "T500", "PRECT", "TS", "TREFHT", "Z1000", "Z200", "ZBOT",
)  # fmt: skip
CLASS_NAMES: tuple[str, ...] = ("background", "tropical_cyclone", "atmospheric_river")

_GENERATE_HINT = "generate synthetic DeepCAM data with `exatrain data deepcam --out DIR`"


# ----------------------------------------------------------------------- reading


def load_deepcam_stats(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read normalisation statistics from a DeepCAM ``stats.h5`` or our ``stats.json``.

    Returns a dict of float64 arrays with whichever of ``mean``, ``std``,
    ``minval``, ``maxval``, ``class_frequencies`` the file has.  The real DeepCAM
    ``stats.h5`` carries ``climate/minval`` and ``climate/maxval`` (min-max
    scaling); ours carries all of them.
    """
    p = Path(path)
    if not p.is_file():
        raise MissingFileError(f"DeepCAM stats file {p} does not exist; {_GENERATE_HINT}")
    keys = ("mean", "std", "minval", "maxval", "class_frequencies")
    try:
        if p.suffix == ".json":
            raw = json.loads(p.read_text())
            out = {k: np.asarray(raw[k], dtype=np.float64) for k in keys if k in raw}
        else:
            with h5py.File(p, "r") as fh:
                grp = fh["climate"] if "climate" in fh else fh
                out = {k: np.asarray(grp[k][...], dtype=np.float64) for k in keys if k in grp}
    except (OSError, KeyError, ValueError, TypeError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise DataError(f"cannot read DeepCAM stats file {p}: {err}") from err
    if not ({"mean", "std"} <= out.keys() or {"minval", "maxval"} <= out.keys()):
        raise DataError(f"DeepCAM stats file {p} has neither mean/std nor minval/maxval")
    return out


def sample_files(split_dir: str | os.PathLike) -> list[Path]:
    """The ``data-*.h5`` files of a split directory in the data set's index order (what
    :class:`DeepCAMDataset` reads and staging copies)."""
    split_dir = Path(split_dir)
    return [split_dir / name for name in sorted(p.name for p in split_dir.glob("data-*.h5"))]


def find_stats(split_dir: str | os.PathLike) -> Path | None:
    """The statistics file a split reads: ``stats.h5`` or ``stats.json`` in it or its parent."""
    return _find_stats(Path(split_dir))


def _find_stats(split_dir: Path) -> Path | None:
    for d in (split_dir, split_dir.parent):
        for name in ("stats.h5", "stats.json"):
            if (d / name).is_file():
                return d / name
    return None


_TORCH_LABELS = tuple(np.dtype(t) for t in (np.uint8, np.int8, np.int16, np.int32, np.int64,
                                             np.float32, np.float64))


class FieldsDecoder:
    """Stored DeepCAM fields -> the model's input, on whatever device the batch is: (N, H, W, C)
    as stored -> (N, C, H, W) float32, ``(x - shift) * scale`` per channel (the data set's
    normalisation, the same float32 arithmetic as its CPU path, so the values are equal to the
    last bit), written contiguous in one pass, the memory layout of the CPU path (a
    channels-last result changed the convolutions' rounding enough to move BatchNorm shifts of
    a space × tensor run past their 1e-4 bound against serial, measured).

    A batch whose last dimension is not `channels` is returned unchanged (a decoded batch, as
    `Workload.decode` must allow). A decoded batch whose width equals the channel count cannot
    be told from a raw one whose height does, and is decoded as raw: every caller hands this
    raw batches (the prefetcher, validation, predict), and taking a raw batch for a decoded one
    would train on un-normalised, transposed fields. Spatial blocks decode like whole fields."""

    def __init__(self, shift: np.ndarray | None, scale: np.ndarray | None, channels: int):
        self.channels = channels
        self.shift = None if shift is None else torch.as_tensor(shift).reshape(-1, 1, 1)
        self.scale = None if scale is None else torch.as_tensor(scale).reshape(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[-1] != self.channels:
            return x  # decoded (N, C, H, W), or not a batch of fields
        fields = x.permute(0, 3, 1, 2)
        out = torch.empty(fields.shape, dtype=torch.float32, device=x.device)
        if self.shift is None:
            return out.copy_(fields)
        if self.shift.device != x.device:   # once: not two host-to-device copies a batch
            self.shift, self.scale = self.shift.to(x.device), self.scale.to(x.device)
        torch.sub(fields, self.shift, out=out)
        return out.mul_(self.scale)


class DeepCAMDataset(Dataset):
    """DeepCAM split directory (``data-*.h5`` files) as a map-style torch Dataset.

    Reads both the files made by `deepcam_write.write_deepcam` and the real DeepCAM ones
    (``climate/data`` ``(H, W, C)`` float32, ``climate/labels_0`` ``(H, W)``).

    ``dataset[i]`` returns ``(x, y)``: ``x`` float32 ``(C, H, W)`` normalised per
    channel, ``y`` int64 ``(H, W)``.  With ``raw = True`` it returns what the file
    holds instead: ``x`` ``(H, W, C)`` as stored (channels last, not normalised) and
    ``y`` in its stored dtype (uint8 for ours: 1/8 of the int64 bytes); :class:`FieldsDecoder`
    then normalises whole batches on the device (the loader does no arithmetic and no
    transposing copy: 1.0 instead of 1.4 ms of CPU per 96×144×16 sample, measured).  :meth:`read` can instead fetch just a
    spatial block through an HDF5 hyperslab selection, for spatially partitioned
    training where each rank reads only its own tile.

    Files are opened per read and closed right away: with one file per sample an
    epoch touches each file once, so cached handles would buy nothing, and the
    object holds no handle, so it pickles cleanly into DataLoader workers or
    other processes.  :attr:`bytes_read` counts the raw bytes (data + labels, as
    stored) fetched by this instance; each DataLoader worker has its own copy.

    Args:
        split_dir: directory holding ``data-*.h5`` (e.g. ``out_dir/train``).
        stats: normalisation statistics: ``None`` looks for ``stats.h5`` /
            ``stats.json`` in ``split_dir`` or its parent; a path to such a
            file; a mapping with ``mean``/``std`` (z-score) or ``minval``/``maxval``
            (min-max, as MLPerf DeepCAM); or ``False`` for raw, unnormalised data.
    """

    def __init__(
        self,
        split_dir: str | os.PathLike,
        stats: str | os.PathLike | Mapping[str, Any] | bool | None = None,
    ) -> None:
        self.split_dir = Path(split_dir)
        if not self.split_dir.is_dir():
            raise MissingFileError(
                f"DeepCAM data directory {self.split_dir} does not exist; {_GENERATE_HINT}"
            )
        self.files: list[str] = [p.name for p in sample_files(self.split_dir)]
        if not self.files:
            raise MissingFileError(
                f"DeepCAM data directory {self.split_dir} holds no data-*.h5 files; "
                f"{_GENERATE_HINT}"
            )
        self.bytes_read = 0
        self.raw = False
        self.stats: dict[str, np.ndarray] = {}
        if stats is None:
            found = _find_stats(self.split_dir)
            if found is None:
                raise MissingFileError(
                    f"no stats.h5 or stats.json in {self.split_dir} or its parent; pass "
                    f"stats=... (or stats=False for raw data), or {_GENERATE_HINT}"
                )
            self.stats = load_deepcam_stats(found)
        elif stats is False:
            self.stats = {}
        elif isinstance(stats, Mapping):
            self.stats = {
                k: np.asarray(v, dtype=np.float64)
                for k, v in stats.items()
                if k in ("mean", "std", "minval", "maxval", "class_frequencies")
            }
        elif isinstance(stats, (str, os.PathLike)):
            self.stats = load_deepcam_stats(stats)
        else:
            raise TypeError(f"stats must be None, False, a path or a mapping, got {type(stats)}")
        self._shift, self._scale = self._normalisation(self.stats)

    @staticmethod
    def _normalisation(stats: Mapping[str, np.ndarray]) -> tuple[np.ndarray | None, ...]:
        """(shift, scale) so that ``x_norm = (x - shift) * scale`` per channel."""
        if "mean" in stats and "std" in stats:
            shift, spread = stats["mean"], stats["std"]
        elif "minval" in stats and "maxval" in stats:
            shift, spread = stats["minval"], stats["maxval"] - stats["minval"]
        elif not stats or set(stats) <= {"class_frequencies"}:
            return None, None
        else:
            raise DataError(f"stats need mean/std or minval/maxval, got keys {sorted(stats)}")
        # A constant channel would divide by zero; leave it merely centred.
        spread = np.where(np.asarray(spread) > 0, spread, 1.0)
        return (
            np.asarray(shift, dtype=np.float32).reshape(-1, 1, 1),
            (1.0 / np.asarray(spread, dtype=np.float64)).astype(np.float32).reshape(-1, 1, 1),
        )

    @property
    def normalisation(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(shift, scale) per channel, ``x_norm = (x - shift) * scale``; (None, None) for raw data."""
        return self._shift, self._scale

    @property
    def class_frequencies(self) -> np.ndarray | None:
        """Training class frequencies from the stats file, if it has them."""
        return self.stats.get("class_frequencies")

    def __len__(self) -> int:
        return len(self.files)

    def path(self, index: int) -> Path:
        """Path of sample ``index``."""
        return self.split_dir / self.files[index]

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of the first sample, from metadata only (no data read)."""
        path = self.path(0)
        with self._open(path) as fh:
            data, _ = self._datasets(fh, path)
            h, w, c = data.shape
        return c, h, w

    @staticmethod
    def _open(path: Path) -> h5py.File:
        try:
            return h5py.File(path, "r")
        except FileNotFoundError:
            raise
        except OSError as err:
            raise DataError(f"cannot open DeepCAM sample {path}: {err}") from err

    def _datasets(self, fh: h5py.File, path: Path) -> tuple[h5py.Dataset, h5py.Dataset]:
        """The data/label datasets of an open file, shape-checked."""
        try:
            data, labels = fh["climate/data"], fh["climate/labels_0"]
        except KeyError as err:
            raise DataError(
                f"DeepCAM sample {path} lacks climate/data or climate/labels_0"
            ) from err
        if data.ndim != 3 or labels.ndim != 2 or data.shape[:2] != labels.shape:
            raise DataError(
                f"DeepCAM sample {path} has climate/data {data.shape} and climate/labels_0 "
                f"{labels.shape}; expected (H, W, C) and (H, W)"
            )
        if self._shift is not None and data.shape[2] != self._shift.shape[0]:
            raise DataError(
                f"DeepCAM sample {path} has {data.shape[2]} channels but the stats have "
                f"{self._shift.shape[0]}"
            )
        return data, labels

    def read(
        self, index: int, region: tuple[slice, slice] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read sample ``index``, optionally only the block ``region = (rows, cols)``.

        ``region`` is a pair of slices over ``(H, W)``; only that hyperslab is read
        from the file, so the result equals ``read(index)`` sliced the same way
        while touching a fraction of the bytes.

        Returns:
            ``x`` float32 ``(C, h, w)`` normalised, ``y`` int64 ``(h, w)``.
        """
        if region is not None:
            if (
                not isinstance(region, tuple)
                or len(region) != 2
                or not all(isinstance(s, slice) for s in region)
            ):
                raise TypeError(f"region must be a tuple of two slices, got {region!r}")
            if any(s.step not in (None, 1) for s in region):
                raise ValueError(f"region slices must be contiguous (step 1), got {region!r}")
        path = self.path(index)
        with self._open(path) as fh:
            data_ds, label_ds = self._datasets(fh, path)
            try:
                if region is None:
                    raw, lab = data_ds[...], label_ds[...]
                else:
                    rows, cols = region
                    raw, lab = data_ds[rows, cols, :], label_ds[rows, cols]
            except (OSError, ValueError, TypeError) as err:
                raise DataError(f"cannot read DeepCAM sample {path}: {err}") from err
        self.bytes_read += raw.nbytes + lab.nbytes
        if self.raw:  # as stored; torch lacks uint16/uint32 arithmetic: widen those labels
            lab = lab if lab.dtype in _TORCH_LABELS else lab.astype(np.int64)
            return torch.from_numpy(raw), torch.from_numpy(lab)
        x = np.ascontiguousarray(np.moveaxis(raw, -1, 0), dtype=np.float32)
        if self._shift is not None:
            x -= self._shift
            x *= self._scale
        return torch.from_numpy(x), torch.from_numpy(lab.astype(np.int64))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full sample ``index`` as ``(x, y)``."""
        return self.read(index)
