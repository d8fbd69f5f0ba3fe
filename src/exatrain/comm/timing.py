"""Named, timed communication: profiler ranges and the blocking time of every collective.

Every call in `exatrain.comm` runs inside `comm_range(ledger, axis, op, tag)`, which
  - opens a `torch.profiler.record_function` range named `comm.<op>.<axis>[.<tag>]` (and, on CUDA,
    an NVTX range of the same name, so Nsight Systems shows it), so every strategy's halo
    exchange, all-gather, reduce-scatter and pipeline send/recv is labelled in a profile without
    per-strategy code;
  - adds the wall time the calling thread was blocked to the ledger (`Ledger.add_blocked`).

Exposed communication is the time the rank could not compute because it waited for the network:
the whole duration of a blocking call, and, for an asynchronous call, only the time spent in the
work handle's `wait()` (`TimedWork`): transfer time that elapsed while the rank computed is hidden
and is not counted. DDP's gradient all-reduce is waited on inside DDP's reducer, out of sight: for it
the ledger keeps each bucket's (launch, completion) and counts the tail from the last launch (all
gradients ready) to the last completion (`Ledger.drain_async_tail`). On CPU (gloo) the calls block the host, so this is measured exactly. On CUDA
(NCCL) a call only enqueues work on a stream; host blocking then shows only where the host
synchronises, so a GPU profile (the trace's stream lanes) is the finer view there.
"""

from __future__ import annotations

import contextlib
import time

import torch


def nvtx_range(name: str):
    """An NVTX range on CUDA builds with a GPU, nothing otherwise."""
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()


@contextlib.contextmanager
def named_range(name: str):
    """A range that the torch profiler and (on GPUs) Nsight Systems both show. The profiler's
    range only while a torch profiler records (it costs about 6 µs a range on a CPU, a step
    opens several); the NVTX range always, for Nsight Systems, which torch cannot see."""
    recording = torch.autograd.profiler._is_profiler_enabled
    with (torch.profiler.record_function(name) if recording else contextlib.nullcontext()), \
            nvtx_range(name):
        yield


def range_name(op: str, axis: str, tag: str = "") -> str:
    return f"comm.{op}.{axis}" + (f".{tag}" if tag else "")


@contextlib.contextmanager
def comm_range(ledger, axis: str, op: str, tag: str = ""):
    """Label a communication call and add its blocking time to `ledger`."""
    t0 = time.perf_counter()
    try:
        if ledger.slow is not None:  # an injected slow link (comm.inject), tests and drills only
            ledger.slow.delay(axis, ledger.step)
        with named_range(range_name(op, axis, tag)):
            yield
    finally:
        ledger.add_blocked(axis, time.perf_counter() - t0)


class TimedWork:
    """A backend work handle whose `wait()` is labelled and timed as exposed communication."""

    def __init__(self, work, ledger, axis: str, op: str, tag: str = ""):
        self._work, self._ledger = work, ledger
        self._axis, self._op, self._tag = axis, op, tag

    def wait(self, *args, **kwargs):
        with comm_range(self._ledger, self._axis, self._op + ".wait", self._tag):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):  # is_completed, get_future, ... act on the real handle
        return getattr(self._work, name)


def timed(work, ledger, axis: str, op: str, tag: str = ""):
    """Wrap an async handle (None stays None: a size-1 axis or a blocking call)."""
    return None if work is None else TimedWork(work, ledger, axis, op, tag)
