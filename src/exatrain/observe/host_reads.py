"""Reads of tensor values into Python on the training thread, counted step by step.

A read of a device tensor's value (`item`, `tolist`, `__bool__`, `__float__`, `__int__`, `cpu`,
`numpy`, `.to("cpu")`) makes the host wait until the device has computed it, and the device then
idles until the host has queued the next work. A training step reads nothing between log steps
(ARCHITECTURE.md, "The step"): its loss, gradient norm and non-finite verdict stay device tensors
until a log step reads them together.

`HostReads` is a `TorchFunctionMode` that counts such reads by step number (`step_of()`, e.g. the
ledger's step, which is what metrics.jsonl calls the step), on the thread that enters it (the
loader's prefetch thread is not counted: it waits for its own copies, off the training thread).
It counts every read, of CPU tensors too, so on a CPU it shows what would wait on a GPU. The test
suite uses it to prove the step reads nothing, and `exatrain bench device --profile` to report
`exatrain_host_reads_per_step`.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu",
                   "numpy"})


def _to_host(args, kwargs) -> bool:
    """`Tensor.to(...)` that moves a non-CPU tensor to the CPU."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu":
        return False
    targets = list(args[1:]) + list((kwargs or {}).values())
    return any(str(t).startswith("cpu") for t in targets if isinstance(t, (str, torch.device)))


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values per step; `where[step]` keeps the first few call sites."""

    def __init__(self, step_of: Callable[[], int], keep_sites: int = 5):
        super().__init__()
        self.step_of = step_of
        self.by_step: Counter = Counter()
        self.where: dict[int, list[str]] = {}
        self.keep_sites = keep_sites

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS or (name == "to" and _to_host(args, kwargs)):
            step = self.step_of()
            self.by_step[step] += 1
            sites = self.where.setdefault(step, [])
            if len(sites) < self.keep_sites:
                frame = traceback.extract_stack(limit=3)[0]
                sites.append(f"{frame.filename}:{frame.lineno} {name}")
        return func(*args, **(kwargs or {}))

    def on_steps(self, steps) -> int:
        """Reads made during the given steps."""
        return sum(self.by_step.get(s, 0) for s in steps)


__all__ = ["HostReads", "READS"]
