"""Bus bandwidth watched during a run: a link slowed mid-run is reported once, naming its axis."""

from __future__ import annotations

import json
import os

from exatrain.comm.inject import ENV
from exatrain.train.run import run_job
from harness import run_ranks

STEPS = 16
SLOW_FROM = 8
# every shard-axis collective 0.1 s longer from step 8: measured 44 times below the axis's
# median bus bandwidth (a drop is under 0.1 of it)
SLOW = f"*:0.1:shard:{SLOW_FROM}"


def slowed_run(config, slow: str):
    """One rank of the job, with EXATRAIN_INJECT_SLOW as the launcher would pass it."""
    if slow:
        os.environ[ENV] = slow
    try:
        return run_job(config)
    finally:
        os.environ.pop(ENV, None)


def _config(tiny_config, *extra, data: int = 2):
    # shard=2 (ZeRO: all-gather / reduce-scatter) and data=2 (DDP all-reduce): two axes to tell apart
    return tiny_config(f"train.steps={STEPS}", "train.eval_every=0", "train.checkpoint_every=0",
                       "train.log_every=4", f"plan.data={data}", "plan.shard=2",
                       "observe.bandwidth_min_bytes=1024", *extra)


def test_a_slowed_axis_is_reported_once_within_ten_steps(tiny_config):
    summary = run_ranks(4, slowed_run, _config(tiny_config), SLOW)[0]
    drops = summary["bandwidth_drops"]
    assert len(drops) == 1, drops
    drop = drops[0]
    assert drop["axis"] == "shard" and SLOW_FROM <= drop["step"] < SLOW_FROM + 10
    assert drop["op"] in ("all_gather", "reduce_scatter")
    assert drop["busbw_GBps"] < 0.1 * drop["reference_GBps"]
    assert len(drop["longest_waits"]) == 3 and all(w["host"] for w in drop["longest_waits"])
    saved = json.loads(open(f"{summary['run_dir']}/summary.json").read())
    assert saved["bandwidth_drops"] == drops
    records = [json.loads(l) for l in open(f"{summary['run_dir']}/metrics.jsonl")]
    assert {"data", "shard"} <= set(records[0]["busbw_GBps"])


def test_one_rank_slow_on_shard_is_not_echoed_on_data(tiny_config):
    """Rank 1's shard link slowed: its data peer (rank 3) then waits for it in every data
    all-reduce, yet only shard is reported: rank 1, arriving last, sees data's transfer normal."""
    summary = run_ranks(4, slowed_run, _config(tiny_config), f"1:0.15:shard:{SLOW_FROM}")[0]
    assert [d["axis"] for d in summary["bandwidth_drops"]] == ["shard"], summary["bandwidth_drops"]
    assert SLOW_FROM <= summary["bandwidth_drops"][0]["step"] < SLOW_FROM + 10


def test_no_drop_in_an_unslowed_run(tiny_config):
    summary = run_ranks(4, slowed_run, _config(tiny_config), "")[0]
    assert summary["bandwidth_drops"] == []
    # and not because nothing was judged: both axes' bus bandwidth measured, and measured anew
    # after the warm-up steps (each logged record holds the newest step's figure per axis)
    records = [json.loads(l) for l in open(f"{summary['run_dir']}/metrics.jsonl")]
    logged = [r["busbw_GBps"] for r in records if "busbw_GBps" in r]
    assert len(logged) == STEPS // 4, records
    for axis in ("data", "shard"):
        assert all(0 < r[axis] < float("inf") for r in logged), (axis, logged)
        assert logged[-1][axis] != logged[0][axis], (axis, logged)  # step 16's, not step 4's


def test_stop_policy_checkpoints_and_stops(tiny_config):
    config = _config(tiny_config, "observe.on_bandwidth_drop=stop", data=1)
    summary = run_ranks(2, slowed_run, config, SLOW)[0]
    assert len(summary["bandwidth_drops"]) == 1 and summary["stopped_by_signal"]
    assert summary["steps"] == summary["bandwidth_drops"][0]["step"] < STEPS


class _OneRank:
    """What the watch needs of a mesh, for one process: its collectives on a size-1 axis return
    at once, so the detection logic runs alone, step by step, on recorded bytes and times."""

    def __init__(self):
        import torch

        from exatrain.comm import Axis, Ledger
        self.ledger, self.rank, self.device = Ledger(), 0, torch.device("cpu")
        self.world = Axis("world", 1, 0, None, self.ledger, (0,))


def _watch_steps(seconds_per_step):
    from exatrain.observe.bandwidth import BandwidthWatch
    from exatrain.observe.options import ObserveOptions

    mesh = _OneRank()
    watch = BandwidthWatch(mesh, ObserveOptions(), is_main=False)
    reported = []
    for step, seconds in enumerate(seconds_per_step, start=1):
        watch.step_begin()
        mesh.ledger.record("data", "all_reduce", 2**20, "grad", peers=(0, 1))
        mesh.ledger.add_blocked("data", seconds)
        mesh.ledger.record("world", "all_reduce", 4, "control", peers=(0, 1))
        mesh.ledger.add_blocked("world", 0.5)  # a slow control flag: latency, never judged
        reported += watch.step_end(step)
    return reported


def test_watch_logic_reports_one_drop_within_the_patience_and_check_interval():
    normal = [0.01 * (1 + 0.5 * (i % 3)) for i in range(12)]  # +-50 % jitter: no alarm
    assert _watch_steps(normal + normal) == []
    drops = _watch_steps(normal + [0.5] * 12)  # 50x slower from step 13 on
    assert [(d["axis"], d["op"], d["step"]) for d in drops] == [("data", "all_reduce", 15)]
    assert drops[0]["busbw_GBps"] < 0.1 * drops[0]["reference_GBps"]


def _facts(global_rank: int, seconds: list[float], dropped: bool, peers=(0, 1)) -> dict:
    """One rank's gathered facts for the `data` axis: 1 MB of bus bytes in each low step,
    `seconds` blocked, a reference of 1 GB/s (a normal step: 1 ms)."""
    return {"global_rank": global_rank, "dropped": ["data"] if dropped else [],
            "recent": {"data": [(s, 1e6) for s in seconds]}, "peers": {"data": list(peers)},
            "last": {"data": {"busbw": 1e6 / seconds[-1], "reference": 1e9}}}


def test_a_late_rank_is_no_drop_of_the_link_but_a_slow_link_on_any_rank_is():
    from exatrain.observe.bandwidth import link_dropped

    waited, arrived_last = [1.2, 1.2, 1.2], [0.001, 0.0012, 0.0009]
    # rank 1 was descheduled (a loaded machine) for three steps: rank 0 waited for it, and rank 1
    # itself, arriving last, saw a normal transfer: the link is fine
    assert not link_dropped("data", [_facts(0, waited, True), _facts(1, arrived_last, False)], 0.1)
    # the transfer itself slow: both ranks blocked long (rank 1 a little less), at every step
    slow = [0.9, 1.0, 0.8]
    assert link_dropped("data", [_facts(0, waited, True), _facts(1, slow, True)], 0.1)
    # the late rank's step differs from step to step: each step's shortest time is the link's
    mixed0, mixed1 = [1.2, 0.001, 1.2], [0.001, 1.2, 0.001]
    assert not link_dropped("data", [_facts(0, mixed0, True), _facts(1, mixed1, True)], 0.1)
    # two groups on the axis: a late rank in one, a slow link in the other: a drop
    groups = [_facts(0, waited, True, (0, 2)), _facts(2, arrived_last, False, (0, 2)),
              _facts(1, slow, True, (1, 3)), _facts(3, slow, True, (1, 3))]
    assert link_dropped("data", groups, 0.1)
    # a peer whose facts are missing: reported (better than missing a slow link)
    assert link_dropped("data", [_facts(0, waited, True)], 0.1)
