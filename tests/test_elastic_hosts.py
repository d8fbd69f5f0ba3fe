"""An elastic job across two network-namespace hosts (tests/hosts.py) under
`torchrun --nnodes 1:2`: one host dies mid-run, the other finishes a stretch alone, the dead one
comes back and the job grows to two hosts again. Nothing is mocked: real hosts, real agents, a
real SIGKILL of every process of a host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness import run_ranks
from hosts import Hosts, HostsError, quote
from launched import job_args, job_env

from exatrain.train.config import load_config
from exatrain.train.run import run_job

STEPS = 30
# the seed-to-seed spread of this job's final val_mae, uninterrupted (exatrain run --nproc 2,
# seeds 0, 1, 2: 0.579, 0.568, 0.501): see the test's docstring
SEED_SPREAD = 0.078


def _elastic_line(hosts: Hosts, *args: str) -> str:
    """The long-run tutorial's elastic torchrun line for one rank per host. The rendezvous
    settings shorten the waits for a test (a dead host is noticed after 3 missed heartbeats 2 s
    apart, not 15 s; the round closes 1 s after the first host, not 30 s)."""
    return quote([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
                  "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d",
                  "--rdzv-id", "elastic", "--rdzv-endpoint", f"{hosts.names[0]}:29500",
                  "--rdzv-conf",
                  "last_call_timeout=1,keep_alive_interval=2,keep_alive_max_attempt=3",
                  "--monitor-interval", "0.2", "-m", "exatrain.cli", "run", *args])


def _kill_host(hosts: Hosts, i: int) -> None:
    """Host i dies: every process in its network namespace gets SIGKILL."""
    pids = subprocess.run(["ip", "netns", "pids", hosts.names[i - 1]], capture_output=True,
                          text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for(path, procs, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f} s"
        assert procs[0].poll() is None, f"host 1's torchrun ended before {what}"
        time.sleep(0.05)


def test_nnodes_1_2_loses_a_host_goes_on_alone_and_grows_back(cosmo_data, tmp_path):
    """The default job, tiny, 30 steps of global batch 8, a checkpoint every 5 steps, on two
    hosts of one rank each (data=2). Host 2's rank stalls as step 12 starts and the test kills
    every process of host 2 (its agent too): host 1's rank loses its peer, its agent re-forms
    the job on host 1 alone (data=1, 2 micro-batches of 4 a step: the micro-batch of two
    hosts), which resumes from step 10 and redoes step 11 once. At step 20 host 1's rank waits
    until torchrun's agent signals it, and the test starts host 2's agent again: the agent sees
    a node waiting, stops its rank (the rank finishes step 20 and checkpoints it) and the job
    re-forms on both hosts, resuming from step 20 with nothing redone, to step 30.

    What the uninterrupted run would have reached: its val_mae, measured beside (exatrain run
    --nproc 2, the same numbers as two hosts): val_mae 0.579 (seed 0). Its seed-to-seed spread
    (seeds 0, 1, 2, measured on this machine): 0.579, 0.568, 0.501 -> 0.078, the bar for the
    elastic run's distance from it; measured 0.031 (val_mae 0.548: steps 11-20 ran on one host
    with 2 micro-batches of 4, where BatchNorm normalised over 4 samples, not 8). What was lost:
    the summary's `reformations`: 1 step redone and ~10-40 s for the loss of host 2, nothing
    redone for its return. The whole test takes 1-5 minutes (each formation starts its ranks
    again; measured 280 s with the machine's 2 cores shared by many jobs)."""
    hosts = Hosts(2)
    try:
        hosts.start()
    except HostsError as exc:
        pytest.fail(f"this test makes 2 hosts of network namespaces and could not: {exc}")
    runs = tmp_path / "runs"
    args = job_args(cosmo_data, runs) + [
        a for s in (f"train.steps={STEPS}", "train.checkpoint_every=5", "run.timeout_s=30")
        for a in ("--set", s)]
    env = job_env(EXATRAIN_INJECT_FAULTS="hang@1:12,wait_signal@0:20",
                  # torch 2.13's agents share one TCPStore across rounds, and a node that was
                  # rank 0 before does not publish the new round's address: the joining node
                  # would wait for it for ever (see the long-run tutorial)
                  TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    run_dir = runs / "cosmoflow-elastic"
    line = _elastic_line(hosts, *args)
    procs = []
    try:
        procs = [hosts.popen(i, line, env, tmp_path, tmp_path / f"host{i}.log") for i in (1, 2)]
        _wait_for(run_dir / "faults" / "hang@1:12", procs, "stall at step 12")
        _kill_host(hosts, 2)
        procs[1].wait(30)
        _wait_for(run_dir / "faults" / "wait_signal@0:20", procs, "step 20 on host 1 alone")
        procs[1] = hosts.popen(2, line, env, tmp_path, tmp_path / "host2-back.log")
        codes = [p.wait(180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        hosts.stop()
    logs = {name: (tmp_path / name).read_text()[-3000:] for name in ("host1.log",
                                                                      "host2-back.log")}
    assert codes == [0, 0], logs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["world_size"] == 2
    shrink, grow = summary["reformations"]
    assert shrink["world_sizes"] == [2, 1] and grow["world_sizes"] == [1, 2]
    assert (shrink["resumed_from_step"], shrink["steps_redone"]) == (10, 1)
    assert (grow["resumed_from_step"], grow["steps_redone"]) == (20, 0)
    assert 0 < shrink["seconds_lost"] < 120 and 0 < grow["seconds_lost"] < 120
    # the global batch of every formation: ranks x micro-batch x accumulation = 8
    formations = [json.loads(l) for l in (run_dir / "formations.jsonl").read_text().splitlines()]
    assert [(f["world_size"], f["micro_batch"], f["grad_accum"]) for f in formations] == \
        [(2, 4, 1), (1, 4, 2), (2, 4, 1)]
    # every step once in metrics.jsonl, the step redone included
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    # the uninterrupted run, beside: the same job on 2 ranks of the test pool
    plain = run_ranks(2, run_job, load_config(None, [*args[1::2],
                                                      f"run.out_dir={tmp_path / 'plain'}"]))[0]
    assert abs(summary["val_mae"] - plain["val_mae"]) <= SEED_SPREAD, \
        (summary["val_mae"], plain["val_mae"])
