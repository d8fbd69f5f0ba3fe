"""Stop signals that come while a launched rank is still starting.

A batch system's wall-time warning (SIGUSR1) or a cancel (SIGTERM) may reach a rank before the
Trainer's handler (train.resilience.stop.StopOnSignal) is installed -- while it imports,
rendezvouses or stages data. SIGUSR1's default action ends the process with no checkpoint and no
summary, so a batch script cannot tell that it should requeue. `hold_early_signals()`, called by
`exatrain run` under a launcher before anything heavy is imported, keeps such a signal instead;
StopOnSignal takes it over (`take_held_signal`) and the run stops after its first step.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_held: list[int] = []  # process-wide by nature: signal dispositions are the process's


def _hold(signum, _frame) -> None:
    _held.append(signum)


def hold_early_signals() -> None:
    """Until a StopOnSignal is installed, keep SIGTERM / SIGUSR1 instead of dying of them."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _hold)


def take_held_signal() -> int | None:
    """The last stop signal held since `hold_early_signals`, forgotten once taken."""
    signum = _held[-1] if _held else None
    _held.clear()
    return signum
