"""torchft's lighthouse as exatrain starts it: the program and its flags, for the local launcher
(`train.resilience.replica_launch`) and the Slurm batch script (`launch.batch_groups`) alike.

The lighthouse keeps the quorum of live replica groups; it exchanges heartbeats (a few hundred
bytes every 100 ms per group) and quorum requests (one per group per step, or per
synchronisation under local_sgd / diloco), never tensors.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def lighthouse_program(python: str) -> str | None:
    """`torchft_lighthouse` beside `python` (the ranks' environment), else on PATH; None when
    neither has it."""
    beside = Path(python).parent / "torchft_lighthouse"
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse")


def join_timeout_ms(options) -> int:
    """The lighthouse's join timeout (`options`: `[fault_tolerance]`): how long a group asking
    for a quorum waits for live groups that have not asked yet. Per step they ask within a step.
    Under local_sgd / diloco they ask once per sync_every steps, and a live group that never
    asked in the window would go on alone with the same period for ever (two quorums of one,
    never meeting: measured), so the window is half the quorum timeout and a synchronisation
    period must be shorter."""
    if options.sync == "step":
        return options.heartbeat_timeout_ms
    return int(500 * options.quorum_timeout_s)


def lighthouse_flags(options) -> list[str]:
    """The lighthouse's flags beyond `--bind` for the groups of `[fault_tolerance]` `options`."""
    return ["--min_replicas", str(options.min_replicas),
            "--join_timeout_ms", str(join_timeout_ms(options)),
            "--heartbeat_timeout_ms", str(options.heartbeat_timeout_ms)]
