"""A per-rank watchdog thread: no progress for `timeout_s` -> flight record, message, exit.

A collective that a peer never joins raises on gloo after the process group's timeout
(`run.timeout_s`), and the Trainer writes the flight record then. The watchdog covers what the
backend cannot see: a rank stuck outside any collective (an endless data read, a deadlock in user
code), or a backend that never times out. Progress is any operation recorded in the ledger or a
`beat()` from the training loop; after `timeout_s + grace_s` without either, the thread writes
this rank's flight record and ends the process with exit code 124, so every rank of a hung job
exits within timeout + grace. It is paused while the rank evaluates or writes a checkpoint (long,
legitimately, with few collectives; the backend's own timeout still covers those), and not started
for a one-rank job (nothing to wait for).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from ...comm.flight import write_record

HUNG_EXIT_CODE = 124


class Watchdog:
    def __init__(self, ledger, rank: int, run_dir, timeout_s: float, grace_s: float = 5.0):
        self.ledger, self.rank, self.run_dir = ledger, rank, run_dir
        self.limit = timeout_s + grace_s
        self._beat = time.time()
        self._paused = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="exatrain-watchdog", daemon=True)

    def start(self, world_size: int = 2) -> "Watchdog":
        if world_size > 1:
            self._thread.start()
        return self

    @contextlib.contextmanager
    def paused(self):
        self._paused = True
        try:
            yield
        finally:
            self._paused = False
            self.beat()

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> None:
        self._beat = time.time()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit / 4)):
            idle = time.time() - max(self._beat, self.ledger.last_time)
            if idle > self.limit and not self._paused:
                reason = f"watchdog: no progress for {idle:.0f} s (limit {self.limit:.0f} s)"
                path = write_record(self.run_dir, self.rank, self.ledger, reason) \
                    if self.run_dir else None
                print(f"exatrain: rank {self.rank}: {reason} at step {self.ledger.step}; "
                      f"flight record {path}", file=sys.stderr, flush=True)
                os._exit(HUNG_EXIT_CODE)
