"""What a data set read from its files, counted over the process and its loader workers.

A data set's reads happen in the training process and, with `train.num_workers` > 0, in loader
worker processes that a plain integer counter never hears back from. `ReadCounter` keeps one
slot of (bytes, samples) per process in a small shared-memory tensor: the training process
writes slot 0, loader worker i slot i + 1 (torch's `get_worker_info`), so no two processes
write the same slot and the totals are the sums over the slots. The tensor travels to the
workers as shared memory (fork, or torch's pickling of shared tensors under spawn).

Memory: 2 × (MAX_WORKERS + 1) int64 = 4 KiB per counter.
"""

from __future__ import annotations

import torch
from torch.utils.data import get_worker_info

MAX_WORKERS = 255  # loader workers per rank that can count (slot 0: the training process)


class ReadCounter:
    """Bytes and samples a data set read, in this process and its loader workers."""

    def __init__(self):
        self._slots = torch.zeros(2, MAX_WORKERS + 1, dtype=torch.int64).share_memory_()

    def add(self, nbytes: int, samples: int = 1) -> None:
        info = get_worker_info()
        slot = 0 if info is None else info.id + 1
        if slot > MAX_WORKERS:
            raise RuntimeError(f"loader worker {info.id}: a ReadCounter counts at most "
                               f"{MAX_WORKERS} workers per rank; lower train.num_workers.")
        self._slots[0, slot] += int(nbytes)
        self._slots[1, slot] += int(samples)

    @property
    def bytes(self) -> int:
        return int(self._slots[0].sum())

    @property
    def samples(self) -> int:
        return int(self._slots[1].sum())

    def figures(self) -> dict:
        """The run summary's input_bytes_read_per_rank and input_bytes_read_per_sample."""
        out = {"input_bytes_read_per_rank": self.bytes}
        if self.samples:
            out["input_bytes_read_per_sample"] = self.bytes / self.samples
        return out
