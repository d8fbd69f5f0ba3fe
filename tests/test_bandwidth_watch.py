"""Bus bandwidth watched during a run: a link slowed mid-run is reported once, naming its axis."""

from __future__ import annotations

import json
import os

from exatrain.comm.inject import ENV
from exatrain.train.run import run_job
from harness import run_ranks

STEPS = 16
SLOW_FROM = 8
SLOW = f"*:0.05:shard:{SLOW_FROM}"  # every shard-axis collective 50 ms longer from step 8


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


def test_no_drop_in_an_unslowed_run(tiny_config):
    summary = run_ranks(4, slowed_run, _config(tiny_config), "")[0]
    assert summary["bandwidth_drops"] == []


def test_stop_policy_checkpoints_and_stops(tiny_config):
    config = _config(tiny_config, "observe.on_bandwidth_drop=stop", data=1)
    summary = run_ranks(2, slowed_run, config, SLOW)[0]
    assert len(summary["bandwidth_drops"]) == 1 and summary["stopped_by_signal"]
    assert summary["steps"] == summary["bandwidth_drops"][0]["step"] < STEPS
