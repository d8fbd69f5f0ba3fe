"""What each step measured, kept where it was measured until a log step reads it all at once.

A training step leaves three numbers on the device (its loss, its global gradient norm and its
non-finite verdict) and two marks of time. Reading any of them on the host at the step would make
the host wait for the device every step (see `host_reads`). `PendingSteps` keeps them and hands
them over at a *read point* (a log, evaluation, checkpoint or stop-check step, and the last):

  values   the steps' (loss, gradient norm, found_inf) stacked into one tensor; the losses are
           averaged over the data replicas with one all-reduce (8 bytes per step per rank, tag
           "metric"), then the whole block is copied to the host once
  times    CUDA: a pair of timing events per step, read after the last one completes (one wait
           per read point); CPU: host clock differences (a CPU step is over when it returns)

Communication per read point: one all-reduce of n float64 values over the data axis (n steps
since the last read point).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..comm import all_reduce


class StepClock:
    """The duration of each step: CUDA timing events (no wait at the step) or the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._begin = None
        self._pending: list = []

    def begin(self) -> None:
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()
        else:
            self._begin = time.perf_counter()

    def end(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._begin, end))
        else:
            self._pending.append(time.perf_counter() - self._begin)

    def read(self) -> list[float]:
        """Seconds of each step since the last read (waits for the last step to finish)."""
        pending, self._pending = self._pending, []
        if not self.cuda:
            return pending
        if pending:
            pending[-1][1].synchronize()
        return [begin.elapsed_time(end) / 1e3 for begin, end in pending]


@dataclass
class StepValues:
    """Host values of the steps since the last read point, in step order."""
    losses: list[float]        # mean over the data replicas
    grad_norms: list           # the global norm (the same on every rank); None: not computed
    nonfinite: list[bool]      # the step's gradients were not finite (the same on every rank)
    times: list[float]         # seconds


class PendingSteps:
    """Device values of the steps since the last read point (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.clock = StepClock(self.device)
        self._rows: list[tuple] = []

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor | None,
            found_inf: torch.Tensor) -> None:
        """One step's loss, gradient norm (None: not computed) and verdict (0-d tensors, kept as
        they are: nothing is read, and nothing is launched until the read point stacks them)."""
        self._rows.append((loss, grad_norm, found_inf))

    def read(self, data_axis, replicas: int) -> StepValues:
        """The steps' values on the host: losses averaged over `data_axis` (collective)."""
        times = self.clock.read()
        rows, self._rows = self._rows, []
        if not rows:
            return StepValues([], [], [], times)
        computed = [row[1] is not None for row in rows]
        rows = [(loss, norm if norm is not None else math.nan, found)
                for loss, norm, found in rows]
        # one stack per column (loss, norm, found_inf), each column in one dtype: 6 kernels
        losses, norms, found = (torch.stack([torch.as_tensor(row[k], device=self.device)
                                             .detach().reshape(()) for row in rows])
                                .to(torch.float64) for k in range(3))
        all_reduce(losses, data_axis, tag="metric")     # NCCL reduces only GPU tensors: on device
        block = torch.cat([losses / replicas, norms, found]).cpu().view(3, -1)
        return StepValues(block[0].tolist(),
                          [n if c else None for n, c in zip(block[1].tolist(), computed)],
                          [bool(v) for v in block[2].tolist()], times)


__all__ = ["PendingSteps", "StepClock", "StepValues"]
