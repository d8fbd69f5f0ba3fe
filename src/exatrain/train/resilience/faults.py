"""Injected faults for tests and `exatrain bench faults`: kill or hang a rank at a chosen step.

EXATRAIN_INJECT_FAULTS="kill@1:5,hang@0:3,kill_in_save@1:4" -- kind@rank:step, comma-separated,
with steps numbered as metrics.jsonl numbers them (the first step is 1) and ranks as the job's
(under [fault_tolerance], replica group k's ranks after group k-1's):

  kill          the rank SIGKILLs itself as step `step` starts (a node dying)
  hang          the rank stops taking part (sleeps) as step `step` starts (a rank that never joins)
  term          the rank sends itself SIGTERM as step `step` starts (the wall-time warning)
  wait_signal   the rank waits as step `step` starts until a stop signal (SIGTERM or SIGUSR1)
                comes from outside, at most 10 minutes: a step still running when a real batch
                system's wall-time warning arrives, whenever the scheduler sends it
  kill_in_save  the rank SIGKILLs itself inside the checkpoint save of step `step`, after the
                shard files are written and before the checkpoint is complete

Each fault fires once per run directory (a marker under RUN_DIR/faults/), so a run restarted
from its last checkpoint passes the same step again without dying again. Without the variable
nothing is injected and nothing is checked beyond one dictionary lookup per step.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ...comm.inject import InjectError

ENV = "EXATRAIN_INJECT_FAULTS"
KINDS = ("kill", "hang", "kill_in_save", "term", "wait_signal")
WAIT_SIGNAL_LIMIT_S = 600.0


def parse(text: str) -> list[tuple[str, int, int]]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, where = item.partition("@")
        rank, _, step = where.partition(":")
        if kind not in KINDS or not rank.isdigit() or not step.isdigit():
            raise InjectError(f"{ENV}: {item!r} is not kind@rank:step with kind one of {KINDS}")
        faults.append((kind, int(rank), int(step)))
    return faults


class FaultInjector:
    def __init__(self, rank: int, run_dir: Path | None, text: str | None = None):
        text = os.environ.get(ENV, "") if text is None else text
        self.rank, self.run_dir = rank, run_dir
        self.faults = {(kind, step) for kind, r, step in parse(text) if r == rank} if run_dir else set()

    def _fire(self, kind: str, step: int) -> bool:
        if (kind, step) not in self.faults:
            return False
        marker = self.run_dir / "faults" / f"{kind}@{self.rank}:{step}"
        if marker.exists():
            return False
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        return True

    def at_step(self, step: int) -> None:
        if self._fire("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fire("term", step):
            os.kill(os.getpid(), signal.SIGTERM)
        if self._fire("wait_signal", step):
            _wait_for_signal(WAIT_SIGNAL_LIMIT_S)
        if self._fire("hang", step):
            while True:
                time.sleep(3600)

    def in_save(self, step: int) -> None:
        if self._fire("kill_in_save", step):
            os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_signal(limit_s: float) -> None:
    """Sleep until SIGTERM or SIGUSR1 arrives (the handlers already installed still run), or
    `limit_s` passes."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    got: list[int] = []
    previous: dict = {}

    def note(signum, frame):
        got.append(signum)
        handler = previous.get(signum)
        if callable(handler):
            handler(signum, frame)

    previous = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        deadline = time.monotonic() + limit_s
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
