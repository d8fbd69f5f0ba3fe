"""`exatrain preflight`: the nccl-tests table per axis, and a slowed rank named (and only it)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from exatrain.comm.busbw import bus_factor
from exatrain.comm.inject import ENV, InjectError, SlowLinks
from exatrain.cli import preflight_job
from exatrain.observe.preflight import PreflightOptions, exclude_line, format_report, judge, \
    pairings
from exatrain.observe.preflight_checks import check_ranks
from harness import run_ranks

TINY = PreflightOptions(sizes=[4096], iters=3, warmup=1, link_bytes=2**14)
# the slow-rank test judges link rounds: 16 KiB exchanges (~0.1 ms) were within the scheduling
# jitter of 4 ranks on 2 busy cores, and once a partner of the slowed rank lost a second round
# to it (CI, 2026-11-27); 1 MiB exchanges are 10x longer than that jitter and still 20x shorter
# than the injected 20 ms. A round is the median of its exchanges: with 5 of them, rank 0 once
# more lost a second round on a loaded CI machine (judged slow beside rank 2); with 11, a round
# is slow only if 6 of its exchanges were: the slowed rank's partners see that once, in the
# round they share with it, and jitter is far less likely to do it twice
LINKS = PreflightOptions(sizes=[4096], iters=11, warmup=2, link_bytes=2**20)


def slowed_preflight(config, options, slow: str):
    """A rank of the job with EXATRAIN_INJECT_SLOW set, as a launcher would pass it."""
    os.environ[ENV] = slow
    try:
        return preflight_job(config, options)
    finally:
        del os.environ[ENV]


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 8) == 7 / 8 and bus_factor("p2p", 2) == 1.0


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8])
def test_pairings_are_perfect_matchings_meeting_each_partner_once(n):
    rounds = pairings(n, rounds=100)
    assert len(rounds) == n - 1 + n % 2
    met = set()
    for partner in rounds:
        for r, p in enumerate(partner):
            assert p is None or (partner[p] == r and p != r)
            if p is not None:
                met.add((r, p))
        assert sum(p is None for p in partner) == n % 2
    assert len(met) == n * (n - 1)  # everyone met everyone, once each way


def test_judge_names_slow_rank_and_node():
    facts = [{"rank": r, "host": f"nid{r // 2:03d}", "link_GBps": 10.0} for r in range(8)]
    facts[5]["link_GBps"] = 1.0
    verdict = judge(facts, 0.5)
    assert [r["rank"] for r in verdict["slow_ranks"]] == [5]
    assert verdict["slow_nodes"] == [] and verdict["exclude_hosts"] == ["nid002"]
    facts[4]["link_GBps"] = 2.0  # both ranks of nid002: the node itself is slow
    verdict = judge(facts, 0.5)
    assert [n["host"] for n in verdict["slow_nodes"]] == ["nid002"]


def _facts(rank: int, **changed) -> dict:
    """One rank's facts (preflight_checks.rank_facts) on a healthy node, with `changed` keys."""
    return {"rank": rank, "host": f"nid{rank:03d}", "exatrain": "0.1.0", "torch": "2.13.0",
            "device": "cpu", "cuda_devices": 0, "local_rank": 0, "free_memory_bytes": 8 * 2**30,
            "min_free_bytes": 2**30, "data_path": "/scratch/data", "sees_data": True,
            "sees_run_dir": True, "run_dir_marker": "/scratch/runs/.preflight-nid000-1"} | changed


def test_check_ranks_names_mismatched_versions_and_missing_data():
    config = SimpleNamespace(data=SimpleNamespace(path="/scratch/data", generate=False),
                             run=SimpleNamespace(out_dir="/scratch/runs"))
    assert check_ranks([_facts(r) for r in range(3)], config) == []
    problems = check_ranks([_facts(0), _facts(1, torch="2.12.0", exatrain="0.0.9"),
                            _facts(2, sees_data=False)], config)
    assert len(problems) == 3, problems
    assert problems[0].startswith("rank 1 (nid001) runs exatrain 0.0.9, rank 0 runs 0.1.0")
    assert problems[1].startswith("rank 1 (nid001) runs torch 2.12.0, rank 0 runs 2.13.0")
    assert problems[2].startswith("rank 2 (nid002) does not see data.path=/scratch/data")
    nowhere = [_facts(r, sees_data=False) for r in range(2)]
    assert len(check_ranks(nowhere, config)) == 2
    config.data.generate = True   # rank 0 writes the data at the start of the run: not missing
    assert check_ranks(nowhere, config) == []


def test_inject_spec_is_checked():
    assert SlowLinks.parse("2:0.01", rank=1) is None
    links = SlowLinks.parse("2:0.01,*:0.5:data:6", rank=2).links
    assert [(l.seconds, l.axis, l.from_step) for l in links] == [(0.01, "*", 0), (0.5, "data", 6)]
    with pytest.raises(InjectError, match="RANK:SECONDS"):
        SlowLinks.parse("slow@2", rank=0)


def test_preflight_names_the_slowed_rank_and_only_it(tiny_config):
    config = tiny_config()
    reports = run_ranks(4, slowed_preflight, config, LINKS, "2:0.02")
    report = reports[0]
    assert all(r == report for r in reports)  # every rank returns the same verdict (exit code)
    assert [r["rank"] for r in report["slow_ranks"]] == [2]
    assert report["exclude_hosts"] == [report["ranks"][2]["host"]] and not report["ok"]
    assert exclude_line(report) == report["ranks"][2]["host"]
    rows = report["collectives"]
    assert {(r["axis"], r["op"]) for r in rows} == {("data", "all_reduce"), ("data", "all_gather"),
                                                   ("data", "reduce_scatter")}
    for r in rows:
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(r["op"], 4))
    assert report["problems"] == []  # same versions, run directory seen, data path seen
    text = format_report(report)
    assert "SLOW rank 2" in text and "srun --exclude=" in text and "FAILED" in text


def test_preflight_per_axis_with_neighbours_and_world(tiny_config):
    config = tiny_config("plan.pipe=2", "plan.data=2")
    report = run_ranks(4, preflight_job, config, TINY)[0]
    axes = {(r["axis"], r["ranks"], r["op"]) for r in report["collectives"]}
    assert ("pipe", 2, "p2p") in axes and ("data", 2, "all_reduce") in axes
    assert ("world", 4, "all_gather") in axes and ("data", 2, "p2p") not in axes


def test_cli_exit_code_and_exclude_file(tmp_path):
    """`exatrain preflight --nproc 3` with rank 1 slowed: exit code 3, its host in the file."""
    import json
    import socket
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "exatrain.cli", "preflight", "--nproc", "3", "--sizes", "4K",
         "--link-bytes", "16K", "--iters", "3", "--set", f"run.out_dir={tmp_path}/runs",
         "--json", "pf.json", "--exclude-file", "slow.txt"], cwd=tmp_path, capture_output=True,
        text=True, timeout=300, env={**os.environ, ENV: "1:0.02"})
    assert out.returncode == 3, out.stderr
    assert (tmp_path / "slow.txt").read_text() == socket.gethostname() + "\n"
    report = json.loads((tmp_path / "pf.json").read_text())
    assert [r["rank"] for r in report["slow_ranks"]] == [1] and "SLOW rank 1" in out.stdout
