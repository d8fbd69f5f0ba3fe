"""Stop signals that come while a launched rank is still starting.

A batch system's wall-time warning (SIGUSR1) or a cancel (SIGTERM) may reach a rank before the
Trainer's handler (train.resilience.stop.StopOnSignal) is installed -- while it imports,
rendezvouses or stages data. SIGUSR1's default action ends the process with no checkpoint and no
summary, so a batch script cannot tell that it should requeue. `hold_early_signals()`, called by
`exatrain run` under a launcher before anything heavy is imported, keeps such a signal instead;
StopOnSignal takes it over (`take_held_signal`) and the run stops after its first step.

A signal can also miss a rank altogether: a batch script passes the warning on to the job's steps
as it comes (`scancel --signal=USR1 JOB`), and a step still being made then is not among them.
So the script first writes a file, named to the ranks by EXATRAIN_STOP_FILE, and signals after:
a rank whose step was made too late for the signal finds the file when StopOnSignal is installed,
and takes it as the warning (SIGUSR1).
"""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOP_FILE = "EXATRAIN_STOP_FILE"   # the batch script's wall-time warning, written before it signals
_held: list[int] = []  # process-wide by nature: signal dispositions are the process's


def _hold(signum, _frame) -> None:
    _held.append(signum)


def hold_early_signals() -> None:
    """Until a StopOnSignal is installed, keep SIGTERM / SIGUSR1 instead of dying of them."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _hold)


def take_held_signal() -> int | None:
    """The last stop signal held since `hold_early_signals`, forgotten once taken; else SIGUSR1
    where the file EXATRAIN_STOP_FILE names exists (a warning that came before this rank's
    step could be signalled)."""
    signum = _held[-1] if _held else None
    _held.clear()
    stop_file = os.environ.get(STOP_FILE)
    if signum is None and stop_file and os.path.exists(stop_file):
        signum = signal.SIGUSR1
    return signum
