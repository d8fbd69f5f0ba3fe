"""What the tests of real launchers share (test_slurm, test_hosts): the machine's Slurm, the
default job, tiny, its ranks importing this tree's exatrain, and its final weights spawned by
`exatrain run --nproc 2`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY
from exatrain.train.checkpoints.export import export_run, read_state_dict

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
START = REPO / "tests" / "slurm" / "start-slurm.sh"


@pytest.fixture(scope="session")
def slurm():
    """Slurm running on this machine, as `.ci/run` makes it: as root with apt-get, installed
    (where missing) and started by start-slurm.sh --install, once per session; elsewhere a
    one-line failure naming the command that installs it (a skip would hide the launcher tests)."""
    can_install = os.geteuid() == 0 and shutil.which("apt-get") is not None
    command = ["bash", str(START), *(["--install"] if can_install else [])]
    try:  # apt-get on a fresh machine: a minute or two; starting the daemons: seconds
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=900 if can_install else 180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(command[1:])} did not start Slurm within the time; see "
                    f"/var/log/slurm/*.log", pytrace=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit code {done.returncode}"]
        why = next((l for l in lines if l.startswith("start-slurm:")), lines[-1])
        fix = "" if can_install or "--install" in why else \
            f"; as root: `{START} --install` (Debian/Ubuntu), then rerun"
        pytest.fail(f"the launcher tests need a real Slurm here: {why}{fix}", pytrace=False)


def job_env(**extra) -> dict:
    """The ranks import this tree's exatrain (as an editable install would), one thread each."""
    src = str(REPO / "src")
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{src}:{path}" if path else src, "OMP_NUM_THREADS": "1",
            **extra}


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports below the kernel's ephemeral range: a job
    script that binds MASTER_PORT + g for replica group g needs them all free, and a port in
    the ephemeral range (where `free_port` draws) may be taken by any outgoing connection
    before the job binds it (seen: a restarted group's store failed with EADDRINUSE)."""
    import random
    import socket

    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        base = random.randrange(20000, min(ephemeral, 32768) - count)
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports in 20000..{ephemeral}")


def job_args(cosmo_data, out_dir) -> list[str]:
    """The default job (`exatrain run` without a config: CosmoFlow), tiny, on the session's data."""
    sets = [*TINY, f"data.path={cosmo_data}", f"run.out_dir={out_dir}", f"train.steps={STEPS}",
            "train.eval_every=0"]
    return [a for s in sets for a in ("--set", s)]


def final_weights(run_dir: Path) -> dict:
    out = run_dir.parent / f"{run_dir.name}.safetensors"
    export_run(run_dir, out)
    return read_state_dict(out)


def assert_same_weights(weights: dict, reference: dict) -> None:
    assert weights.keys() == reference.keys()
    for key, ref in reference.items():
        assert torch.equal(weights[key], ref), key  # same ranks, same threads, gloo: bitwise


_LOCAL_RUNS: dict = {}  # a fixture imported by two modules is two fixtures: run it once


@pytest.fixture(scope="session")
def local_run(cosmo_data, tmp_path_factory):
    """The same job spawned by `exatrain run --nproc 2`: (summary, final weights)."""
    if str(cosmo_data) not in _LOCAL_RUNS:
        _LOCAL_RUNS[str(cosmo_data)] = _spawned_run(cosmo_data, tmp_path_factory.mktemp("local"))
    return _LOCAL_RUNS[str(cosmo_data)]


def _spawned_run(cosmo_data, out: Path) -> tuple[dict, dict]:
    done = subprocess.run([sys.executable, "-m", "exatrain.cli", "run", "--nproc", "2",
                           *job_args(cosmo_data, out / "runs")], cwd=out, env=job_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (run_dir,) = (out / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["launcher"] == "local" and "requeues" not in summary
    return summary, final_weights(run_dir)


def doc_launch_line(launcher: str) -> tuple[dict, list[str]]:
    """The install page's launch line for `launcher` (srun, torchrun): its options as a dict
    (in order) and the command it starts, so that a test runs what the page prints."""
    import shlex

    text = (REPO / "docs" / "get-started" / "install.md").read_text()
    (line,) = [l for l in text.splitlines() if l.startswith(launcher + " ")]
    words = shlex.split(line.split("#")[0].replace("$", "DOLLAR_"))
    options, i = {}, 1
    while i < len(words) and words[i].startswith("-") and words[i] != "-m":
        key, eq, value = words[i].partition("=")
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("-"):
            value, i = words[i + 1], i + 1
        options[key] = value.replace("DOLLAR_", "$")
        i += 1
    return options, words[i:]
