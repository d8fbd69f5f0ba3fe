"""`exatrain run --nproc N` with `[fault_tolerance]`: a lighthouse and one restart loop per group.

The supervisor starts torchft's lighthouse (`torchft_lighthouse`, its log in
`RUN/lighthouse.log`; not when `fault_tolerance.lighthouse` or TORCHFT_LIGHTHOUSE names a
site's), then starts each replica group as an `exatrain run
--nproc N/groups` process of its own (its own local launcher, rendezvous and run directory,
`RUN/group_KK/`), with REPLICA_GROUP_ID and TORCHFT_LIGHTHOUSE in its environment. One loop
polls every group; a group that fails is started again at once (up to `--max-restarts` times
per group) and heals from a live group: no checkpoint is read. The others train on meanwhile.

Returns when every group has ended: the lowest group's summary (with the restarts), or the first
failure that used up its restarts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import tomli_w

from ...launch.lighthouse import lighthouse_flags, lighthouse_program
from ...launch.local import free_port
from ..job import fresh_run_dir, latest_group_checkpoint
from .replicas import GROUP_ENV, LIGHTHOUSE_ENV, ReplicaGroupError, group_count

POLL_S = 0.2
LIGHTHOUSE_START_S = 30.0


def _start_lighthouse(config, log: Path):
    """torchft's lighthouse as a process of its own (`torchft_lighthouse`, beside this Python),
    logging to `log`: (its address, the process), once it accepts connections."""
    f = config.fault_tolerance
    program = lighthouse_program(sys.executable)
    if program is None:
        raise ReplicaGroupError("[fault_tolerance]: torchft_lighthouse is not installed beside "
                                f"{sys.executable}; `pip install 'exatrain[ft]'`.")
    port = free_port()
    proc = subprocess.Popen(
        [program, "--bind", f"[::]:{port}", *lighthouse_flags(f)],
        stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + LIGHTHOUSE_START_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return f"http://{socket.gethostname()}:{port}", proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise ReplicaGroupError(f"the torchft lighthouse did not start on port {port} within "
                            f"{LIGHTHOUSE_START_S:.0f} s; its log: {log}.")


def supervise_groups(config, argv: list[str], nproc: int, max_restarts: int, report,
                     resume: str | None = None) -> dict:
    """Run the groups of `config` from the command line `argv` (`exatrain run ...` arguments,
    without the program); `nproc`: the job's local ranks, split evenly over the groups.
    `resume`: the run directory of an earlier run of these groups (`exatrain run --resume`):
    each group's first start resumes from its own newest checkpoint (a group that has none
    starts fresh and heals from the others; one whose checkpoint is older than the others'
    heals too)."""
    groups = group_count(config)
    if nproc % groups:
        raise ReplicaGroupError(f"--nproc {nproc} does not split into fault_tolerance.groups = "
                                f"{groups}; use a multiple of {groups}.")
    named = config.fault_tolerance.lighthouse
    address = named if named != "auto" else os.environ.get(LIGHTHOUSE_ENV)
    if resume:
        root = Path(resume)
    else:
        root = fresh_run_dir(config)
        root.mkdir(parents=True)
        (root / "config.toml").write_text(tomli_w.dumps(config.to_dict()))  # for --resume
    lighthouse = None
    if not address:  # the local launcher's own lighthouse: a process, its log in the run
        address, lighthouse = _start_lighthouse(config, root / "lighthouse.log")
    report(f"fault tolerance: {groups} replica groups of {nproc // groups} rank(s), lighthouse "
           f"{address}, run directories under {root}")
    starts = {k: 0 for k in range(groups)}
    history: list[dict] = []

    def start(k: int):
        out = root / f"group_{k:02d}"
        out.mkdir(exist_ok=True)
        env = {**os.environ, GROUP_ENV: str(k), LIGHTHOUSE_ENV: address}
        args = [sys.executable, "-m", "exatrain.cli", *argv, "--nproc", str(nproc // groups),
                "--max-restarts", "0", "--set", f"run.out_dir={out}"]
        resumed = latest_group_checkpoint(out) if resume and not starts[k] else None
        if resumed is not None:  # (a restart after a failure heals from a live group instead)
            args += ["--resume", str(resumed.parent.parent)]
        log = open(out / f"start_{starts[k]}.log", "w")
        starts[k] += 1
        return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)

    running = {k: start(k) for k in range(groups)}
    failed_at: dict[int, float] = {}
    try:
        while running:
            time.sleep(POLL_S)
            for k, proc in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del running[k]
                if rc == 0:
                    continue
                if starts[k] > max_restarts:
                    raise ReplicaGroupError(
                        f"replica group {k} failed (exit {rc}) after {starts[k] - 1} restart(s); "
                        f"its log: {root / f'group_{k:02d}' / f'start_{starts[k] - 1}.log'}. "
                        "Raise --max-restarts, or read the log for the cause.")
                failed_at[k] = time.time()
                history.append({"group": k, "exit": rc, "at": failed_at[k]})
                report(f"replica group {k} failed (exit {rc}); starting it again "
                       f"({starts[k]}/{max_restarts}); it heals from a live group")
                running[k] = start(k)
    finally:
        for proc in running.values():
            proc.kill()
        if lighthouse is not None:
            lighthouse.terminate()
            lighthouse.wait(timeout=30)
    summaries = sorted(root.glob("group_*/*/summary.json"))
    if not summaries:
        raise ReplicaGroupError(f"no replica group left a summary under {root}.")
    summary = json.loads(summaries[0].read_text())
    summary.update(ft_restarts=len(history), ft_restart_history=history, ft_run_root=str(root))
    return summary
