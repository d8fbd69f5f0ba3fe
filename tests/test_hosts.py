"""Two (and three) hosts on one machine, joined by a real network: network namespaces with
their own addresses and host names on a veth bridge (tests/hosts.py). The install page's
multi-node torchrun line runs across them; a link limited by `tc ... tbf` is really slow, and
`exatrain preflight` names its host."""

from __future__ import annotations

import contextlib
import json
import sys
import time

import pytest

from hosts import Hosts, HostsError, quote, slurm_on
from launched import (REPO, STEPS, assert_same_weights, doc_launch_line, final_weights, job_args,
                      job_env, local_run, slurm)  # noqa: F401 (local_run, slurm: fixtures)


@contextlib.contextmanager
def make_hosts(n: int):
    """n hosts for the test's duration; a failure that says why where they cannot be made."""
    hosts = Hosts(n)
    try:
        hosts.start()
    except HostsError as exc:
        pytest.fail(f"these tests make {n} hosts of network namespaces and could not: {exc}")
    try:
        yield hosts
    finally:
        hosts.stop()


def run_on_hosts(hosts: Hosts, command_of, tmp_path, timeout_s: float = 240,
                 exit_code: int = 0, written=None, then=None) -> list[str]:
    """Start command_of(i) on every host at once; wait for all; their logs (each must exit with
    `exit_code`). When the file `written` appears, call `then()` (e.g. lift a link's limit, so
    that the launchers part at full speed)."""
    procs = [hosts.popen(i, command_of(i), job_env(), tmp_path, tmp_path / f"host{i}.log")
             for i in range(1, hosts.n + 1)]
    deadline = time.monotonic() + timeout_s
    try:
        if written is not None:
            while not written.exists() and time.monotonic() < deadline and \
                    any(p.poll() is None for p in procs):
                time.sleep(0.05)
            then()
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"host{i}.log").read_text() for i in range(1, hosts.n + 1)]
    for i, (p, log) in enumerate(zip(procs, logs), 1):
        assert p.returncode == exit_code, f"host {i} exited {p.returncode}:\n{log[-3000:]}"
    return logs


def test_torchrun_multi_node_line_across_two_hosts_equals_one_host(cosmo_data, tmp_path,
                                                                   local_run):
    """The install page's torchrun line on two hosts, one rank each: one job (c10d rendezvous
    gives the nodes ranks 0 and 1), its traffic over the link, the same weights as the two ranks
    that `exatrain run --nproc 2` spawns on one host."""
    options, command = doc_launch_line("torchrun")
    assert options == {"--nnodes": "4", "--nproc-per-node": "4", "--rdzv-backend": "c10d",
                       "--rdzv-id": "$JOB_ID", "--rdzv-endpoint": "$HEAD:29500"}
    assert command == ["-m", "exatrain.cli", "run", "examples/cosmoflow.toml"]
    with make_hosts(2) as hosts:
        values = {"--nnodes": "2", "--nproc-per-node": "1", "--rdzv-id": "twohosts",
                  "--rdzv-endpoint": f"{hosts.names[0]}:29500"}
        line = [sys.executable, "-m", "torch.distributed.run"]
        for key, value in options.items():
            line += [key, values.get(key, value)]
        line += [*command[:-1], str(REPO / command[-1]), *job_args(cosmo_data, tmp_path / "runs")]
        before = hosts.rx_bytes(2)
        run_on_hosts(hosts, lambda i: quote(line), tmp_path)
        received = hosts.rx_bytes(2) - before
    run_dir = tmp_path / "runs" / "cosmoflow-twohosts"  # named by the rendezvous id
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["launcher"] == "torchrun" and summary["world_size"] == 2
    assert summary["steps"] == STEPS
    # every step all-reduces the gradients over the link: at least that much arrived on host 2
    assert received > STEPS * summary["bytes_per_step"]["data"] / 2
    assert_same_weights(final_weights(run_dir), local_run[1])


def test_srun_across_two_hosts_equals_one_host(slurm, cosmo_data, tmp_path, local_run):
    """A Slurm of the two hosts (slurmctld on one, a slurmd on each): `srun -N 2` puts one rank
    on each host, they rendezvous over the link (MASTER_ADDR: the first host of the step's node
    list), and the weights equal those of `exatrain run --nproc 2` on one host. (`slurm`: the
    machine's Slurm installed and munge running, whose socket the hosts' daemons share.)"""
    with make_hosts(2) as hosts, slurm_on(hosts, tmp_path / "slurm", job_env()) as env:
        line = ["srun", "-N", "2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", sys.executable,
                "-m", "exatrain.cli", "run", *job_args(cosmo_data, tmp_path / "runs")]
        before = hosts.rx_bytes(2)
        job = hosts.popen(1, quote(line), env, tmp_path, tmp_path / "srun.log")
        assert job.wait(240) == 0, (tmp_path / "srun.log").read_text()[-3000:]
        received = hosts.rx_bytes(2) - before
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["launcher"] == "Slurm" and summary["world_size"] == 2
    assert received > STEPS * summary["bytes_per_step"]["data"] / 2  # rank 1 is on host 2
    assert_same_weights(final_weights(run_dir), local_run[1])


def torchrun(hosts: Hosts, run_id: str, *args: str) -> list[str]:
    """The install page's torchrun line for one rank per host, running `exatrain ARGS`."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts.n),
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", run_id,
            "--rdzv-endpoint", f"{hosts.names[0]}:29500", "-m", "exatrain.cli", *args]


# 10 Mbit/s: a 256 KiB exchange takes ~210 ms through the bucket, so the unlimited veth links
# pass the 10x check below with up to 21 ms per exchange (at 50 Mbit/s they had ~4 ms, within
# the scheduling jitter of a loaded 2-core machine)
RATE = "10mbit"
RATE_BYTES_S = 10e6 / 8


def test_preflight_names_the_host_whose_link_tc_slowed(cosmo_data, tmp_path):
    """Three hosts, the third's link limited to 10 Mbit/s by a token bucket: preflight across
    them names that host, with its measured bandwidth far below the others', and writes it
    (alone) to the exclude file. torchrun exits 1 where preflight exits 3 (slow)."""
    exclude, report = tmp_path / "exclude.txt", tmp_path / "preflight.json"
    with make_hosts(3) as hosts:
        hosts.limit(3, RATE)
        line = torchrun(hosts, "preflight", "preflight", "--set", f"data.path={cosmo_data}",
                        "--set", "data.generate=false", "--set", f"run.out_dir={tmp_path}/runs",
                        "--sizes", "1K,64K", "--link-bytes", "256K", "--iters", "3",
                        "--exclude-file", str(exclude), "--json", str(report))
        logs = run_on_hosts(hosts, lambda i: quote(line), tmp_path, exit_code=1,
                            written=report, then=lambda: hosts.unlimit(3))
        slow = hosts.names[2]
    assert exclude.read_text().strip() == slow
    r = json.loads(report.read_text())
    assert [n["host"] for n in r["slow_nodes"]] == [slow] and not r["ok"]
    links = {n["host"]: n["link_GBps"] * 1e9 for n in r["nodes"]}
    # a pairwise exchange sends link_bytes each way at once: no faster than the bucket's rate,
    # and the other hosts' links (veth, no limit) more than 10x faster
    assert links[slow] < 2 * RATE_BYTES_S
    assert all(v > 10 * links[slow] for h, v in links.items() if h != slow)
    assert f"SLOW node {slow}" in logs[0] and f"exclude: srun --exclude={slow}" in logs[0]


def test_a_link_limited_mid_run_is_a_bandwidth_drop_and_stop_checkpoints(cosmo_data, tmp_path):
    """Two hosts train (data=2 over the link); after step 8 the test limits host 2's link to
    2 Mbit/s. The watch reports a drop of axis 'data' within its patience + check interval,
    naming the hosts of the ranks that waited; on_bandwidth_drop = "stop" checkpoints the step
    and ends the run cleanly, long before its last step."""
    from exatrain.train.checkpoints import checkpoint

    steps, limit_after = 100, 8
    run_dir = tmp_path / "runs" / "cosmoflow-midrun"
    metrics = run_dir / "metrics.jsonl"
    with make_hosts(2) as hosts:
        line = torchrun(hosts, "midrun", "run", *job_args(cosmo_data, tmp_path / "runs"),
                        "--set", f"train.steps={steps}", "--set", "observe.on_bandwidth_drop='stop'")
        procs = [hosts.popen(i, quote(line), job_env(), tmp_path, tmp_path / f"host{i}.log")
                 for i in (1, 2)]
        try:
            deadline = time.monotonic() + 120
            last = 0
            while last < limit_after and time.monotonic() < deadline:
                assert all(p.poll() is None for p in procs), "the run ended before the limit"
                if metrics.is_file():
                    lines = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
                    last = max((l.get("step", 0) for l in lines), default=0)
                time.sleep(0.02)
            hosts.limit(2, "2mbit")
            limited_at = max(json.loads(l).get("step", 0) for l in metrics.read_text().splitlines()
                             if l.strip())
            deadline = time.monotonic() + 120
            while not (run_dir / "summary.json").exists() and time.monotonic() < deadline and \
                    any(p.poll() is None for p in procs):
                time.sleep(0.05)
            hosts.unlimit(2)  # the run has stopped: its launchers part at full speed
            codes = [p.wait(60) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        names = hosts.names
    log = (tmp_path / "host1.log").read_text()
    assert codes == [0, 0], log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    (drop,) = summary["bandwidth_drops"]
    assert drop["axis"] == "data" and drop["busbw_GBps"] < 0.1 * drop["reference_GBps"]
    # patience 3 low steps, agreed every 5 steps (+1: a step may finish as tc is applied)
    assert limited_at < drop["step"] <= limited_at + 3 + 5 + 1, (limited_at, drop)
    assert {w["host"] for w in drop["longest_waits"]} == set(names)
    assert f"bus bandwidth of axis 'data'" in log and names[1] in log
    assert summary["stopped_by_signal"] and summary["steps"] == drop["step"] < steps
    assert checkpoint.verify(checkpoint.latest(run_dir))["step"] == drop["step"]
