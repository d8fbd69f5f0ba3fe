"""Rank 0's HDF5 file of `exatrain predict`: the outputs appended in sample order, written under
a temporary name and renamed into place when complete (a cut run leaves no partial file).

One output tensor is the dataset `predictions` (N, *output), beside `targets`, the mean absolute
error against them and, where the workload normalises its targets, `predictions_physical`. A
model of several outputs (a tuple, list or dict of tensors) writes each as
`predictions/NAME` (N, *output): NAME is the dict key, or the position in the tuple (0, 1, ...).
No communication: the ranks' outputs reach rank 0 before `append`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch


@dataclass
class OutputMeaning:
    """Names of a model's output columns and how to turn them into physical values."""
    names: tuple[str, ...] = ()
    units: tuple[str, ...] = ()
    to_physical: Callable[[np.ndarray], np.ndarray] | None = None
    normalisation: str = ""


def named_outputs(outputs) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of each output of a tuple, list or dict (nested names joined by '/')."""
    items = outputs.items() if isinstance(outputs, dict) else enumerate(outputs)
    named = []
    for key, value in items:
        if isinstance(value, torch.Tensor):
            named.append((str(key).replace("/", "_") or "_", value))   # an HDF5 name
        elif isinstance(value, (tuple, list, dict)):
            named += [(f"{key}/{inner}", t) for inner, t in named_outputs(value)]
    return named


class PredictionWriter:
    """Rank 0's HDF5 file: rows appended in sample order, renamed into place when complete."""

    def __init__(self, out: Path, meaning: OutputMeaning):
        import h5py
        out.parent.mkdir(parents=True, exist_ok=True)
        self.out, self.meaning = out, meaning
        self.tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        self.file = h5py.File(self.tmp, "w")
        self.rows = 0
        self.abs_err: np.ndarray | None = None      # sums per output column, normalised units
        self.abs_err_physical: np.ndarray | None = None

    def _dataset(self, name: str, rows: np.ndarray):
        if name not in self.file:
            self.file.create_dataset(name, (0, *rows.shape[1:]), dtype=rows.dtype,
                                     maxshape=(None, *rows.shape[1:]),
                                     chunks=(max(1, min(1024, 2 ** 20 // max(1, rows[:1].nbytes))),
                                             *rows.shape[1:]))
        ds = self.file[name]
        ds.resize(self.rows + len(rows), axis=0)
        ds[self.rows:] = rows
        return ds

    def append(self, first: int, outputs, targets, ids: list[str]) -> None:
        """Rows [first, first + n) of the outputs (a tensor, or a tuple, list or dict of them)."""
        if first != self.rows:  # the gather hands batches over in sample order
            raise RuntimeError(f"predictions arrived for sample {first}, expected {self.rows}")
        if not isinstance(outputs, torch.Tensor):   # several outputs: each a dataset of its own
            for name, tensor in named_outputs(outputs):
                if tensor.dim() and len(tensor) == len(ids):   # per sample (not an aux scalar)
                    self._dataset(f"predictions/{name}", tensor.numpy().astype(np.float32))
            self._rows_and_ids(first, len(ids), ids, targets)
            return
        pred = outputs.numpy().astype(np.float32)
        self._dataset("predictions", pred)
        self._write_index(first, len(pred), ids)
        m = self.meaning
        physical = m.to_physical(pred) if m.to_physical is not None and pred.ndim == 2 else None
        if physical is not None:
            self._dataset("predictions_physical", physical)
        if targets is not None:
            y = targets.numpy()
            self._dataset("targets", y)
            if y.shape == pred.shape and y.dtype.kind == "f":
                err = np.abs(pred.astype(np.float64) - y).reshape(len(y), -1).sum(0)
                self.abs_err = err if self.abs_err is None else self.abs_err + err
                if physical is not None:
                    y_phys = m.to_physical(y)
                    self._dataset("targets_physical", y_phys)
                    err = np.abs(physical - y_phys).sum(0)
                    self.abs_err_physical = err if self.abs_err_physical is None \
                        else self.abs_err_physical + err
        self.rows += len(pred)

    def _write_index(self, first: int, n: int, ids: list[str]) -> None:
        import h5py
        self._dataset("index", np.arange(first, first + n, dtype=np.int64))
        if "sample_id" not in self.file:
            self.file.create_dataset("sample_id", (0,), dtype=h5py.string_dtype(), maxshape=(None,),
                                     chunks=(1024,))
        sid = self.file["sample_id"]
        sid.resize(self.rows + n, axis=0)
        sid[self.rows:] = ids

    def _rows_and_ids(self, first: int, n: int, ids: list[str], targets) -> None:
        """Index, ids and targets of a batch of several outputs (no error figures: which output
        a target belongs to is the user's loss's to say)."""
        self._write_index(first, n, ids)
        if targets is not None:
            self._dataset("targets", targets.numpy())
        self.rows += n

    def close(self, attrs: dict) -> dict:
        import h5py
        m = self.meaning
        self.file.attrs.update({k: v for k, v in attrs.items() if v is not None})
        self.file.attrs["output_names"] = list(m.names)
        if m.names and isinstance(self.file.get("predictions"), h5py.Dataset):
            self.file["predictions"].attrs["names"] = list(m.names)
        if "predictions_physical" in self.file:
            for name in ("predictions_physical", "targets_physical"):
                if name in self.file:
                    self.file[name].attrs.update(names=list(m.names), units=list(m.units),
                                                 normalisation=m.normalisation)
        summary: dict = {"outputs": list(m.names), "units": list(m.units)}
        if self.abs_err is not None:
            per = self.abs_err / self.rows
            summary["mae"] = float(per.mean())
            if m.names and len(per) == len(m.names):
                summary.update({f"mae_{n}": float(v) for n, v in zip(m.names, per)})
            if self.abs_err_physical is not None:
                summary["mae_physical"] = {n: float(v) for n, v in
                                           zip(m.names, self.abs_err_physical / self.rows)}
            self.file.attrs["mae"] = summary["mae"]
        self.file.close()
        with open(self.tmp, "rb+") as fh:  # durable before the rename
            os.fsync(fh.fileno())
        os.replace(self.tmp, self.out)
        return summary

    def abandon(self) -> None:
        if self.file.id.valid:
            self.file.close()
        self.tmp.unlink(missing_ok=True)
