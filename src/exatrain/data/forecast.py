"""Forecasting data: `ForecastDataset`, (x_t, x_{t+lead}) pairs from trajectories of the rotating
shallow-water equations stored as ``fields`` (N_traj, T, 3, H, W) float32 in ``train.h5`` /
``val.h5``. The simulation that writes them is `data.forecast_synth` (`write_forecast`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError, MissingFileError

CHANNELS = ("h", "u", "v")
EQUATION = (
    "rotating shallow water (f-plane, doubly periodic): "
    "h_t + div(h u) = -nu4 lap^2 h; "
    "u_t - q h v + (g h + K)_x = -nu4 lap^2 u; "
    "v_t + q h u + (g h + K)_y = -nu4 lap^2 v; "
    "q = (f + v_x - u_y)/h, K = (u^2+v^2)/2"
)
_HINT = "exatrain data forecast --out DIR"


class ForecastDataset(Dataset):
    """(x_t, x_{t+lead}) pairs over every trajectory and time of one HDF5 file.

    Item i -> (x, y), each float32 (C, H, W); if ``normalize``, both are
    (field - mean_c) / std_c with the train-split statistics stored in the file.
    The HDF5 file is opened lazily, once per process, on first access, and the
    handle is dropped when pickled, so the dataset works with DataLoader workers
    (h5py handles must not cross a fork/pickle).
    """

    def __init__(self, path: str | os.PathLike[str], lead: int = 1, normalize: bool = True) -> None:
        self.path = Path(path)
        if lead < 1:
            raise DataError(f"lead must be >= 1, got {lead}")
        if not self.path.is_file():
            raise MissingFileError(
                f"forecast data file not found: {self.path}; generate it with `{_HINT}`"
            )
        self.lead = int(lead)
        self.normalize = bool(normalize)
        with h5py.File(self.path, "r") as fh:
            if "fields" not in fh:
                raise DataError(f"{self.path}: no 'fields' dataset (expected (N, T, C, H, W))")
            shape = tuple(fh["fields"].shape)
            if len(shape) != 5 or min(shape) < 1:
                raise DataError(
                    f"{self.path}: 'fields' has shape {shape}, expected (N, T, C, H, W)"
                )
            if shape[1] <= self.lead:
                raise DataError(
                    f"{self.path}: {shape[1]} time steps per trajectory, need more than lead={lead}"
                )
            C = shape[2]
            mean = np.asarray(fh.attrs.get("mean", np.zeros(C)), dtype=np.float32)
            std = np.asarray(fh.attrs.get("std", np.ones(C)), dtype=np.float32)
            if mean.shape != (C,) or std.shape != (C,):
                raise DataError(
                    f"{self.path}: mean/std attrs have shapes {mean.shape}/{std.shape}, "
                    f"expected ({C},)"
                )
            names = fh.attrs.get("channels", None)
            self.channels = (
                [n.decode() if isinstance(n, bytes) else str(n) for n in names]
                if names is not None
                else [f"c{i}" for i in range(C)]
            )
            self.attrs = {
                k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in fh.attrs.items()
            }
        self.shape = shape
        self.mean = torch.from_numpy(mean).view(C, 1, 1)
        self.std = torch.from_numpy(std).view(C, 1, 1)
        self._pairs_per_traj = shape[1] - self.lead
        self._file: h5py.File | None = None

    def __len__(self) -> int:
        return self.shape[0] * self._pairs_per_traj

    def _fields(self) -> h5py.Dataset:
        if self._file is None:
            self._file = h5py.File(self.path, "r")
        return self._file["fields"]

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        n_items = len(self)
        if idx < 0:
            idx += n_items
        if not 0 <= idx < n_items:
            raise IndexError(f"index {idx} out of range for {n_items} pairs")
        n, t = divmod(int(idx), self._pairs_per_traj)
        ds = self._fields()
        x = torch.from_numpy(np.asarray(ds[n, t], dtype=np.float32))
        y = torch.from_numpy(np.asarray(ds[n, t + self.lead], dtype=np.float32))
        if self.normalize:
            x = (x - self.mean) / self.std
            y = (y - self.mean) / self.std
        return x, y

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"] = None  # an open h5py handle cannot (and must not) be pickled
        return state

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: h5py may already be gone
            pass
