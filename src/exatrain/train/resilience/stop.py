"""Wall-time stops: SIGTERM or SIGUSR1 -> every rank finishes its step, checkpoints, exits.

A batch system warns before the wall-time limit (Slurm `--signal=USR1@120`, or SIGTERM at the
limit). The signal may reach some ranks and not others, or reach them in different steps, so the
handler only sets a flag; the ranks agree with one all-reduce (MAX of one int32 over the whole
mesh: 4 bytes per rank) at every read point of the Trainer (log, evaluation and checkpoint steps,
and every `trainer.STOP_CHECK_EVERY` steps: a step between them reads nothing from the device) and
all stop after the same step. A single rank checks its own flag after every step.
A signal that came while the rank started (launch.signals) is taken over at install.
"""

from __future__ import annotations

import signal
import threading

import torch

from ...comm import all_reduce
from ...launch.signals import SIGNALS, take_held_signal


class StopOnSignal:
    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def install(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
            self.signum = take_held_signal() or self.signum  # one that came while starting
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def announce(self, step: int, total_steps: int, run_dir, bandwidth_drop: bool) -> None:
        """Say where the run stopped and how to go on (rank 0 calls it)."""
        name = signal.Signals(self.signum).name if self.signum else \
            "a bandwidth drop" if bandwidth_drop else "a signal on another rank"
        print(f"exatrain: stopped by {name} after step {step} of {total_steps}; checkpoint "
              f"written. Resume with: exatrain run --resume {run_dir}", flush=True)

    def _handle(self, signum, _frame) -> None:
        self.signum = signum

    def agreed(self, mesh) -> bool:
        """Collective: True on every rank when any rank has received a stop signal (one rank:
        its own flag, no collective and no tensor)."""
        if mesh.world_size == 1:
            return self.signum is not None
        flag = torch.tensor([1 if self.signum else 0], dtype=torch.int32, device=mesh.device)
        all_reduce(flag, mesh.world, op=torch.distributed.ReduceOp.MAX, tag="control")
        return bool(flag.item())
