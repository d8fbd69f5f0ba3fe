"""What a run records about itself: report figures, TensorBoard, profiles, exposed communication,
the MLPerf HPC log and train-to-target.

Three tiny CosmoFlow runs (1, 2 and 4 ranks, two steps each) serve every test; the 2-rank run has
everything switched on (TensorBoard, a one-step profile, MLPerf logging, a target it reaches at its
first evaluation).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib.image
import pytest

from exatrain.observe.report import build_report
from exatrain.train.run import run_job
from harness import run_ranks

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cosmo_data):
    from exatrain.train.config import load_config
    from conftest import TINY

    out = tmp_path_factory.mktemp("observe")

    def config(*extra):
        return load_config(None, [*TINY, f"data.path={cosmo_data}", f"run.out_dir={out}/runs",
                                  "train.steps=2", "train.eval_every=2", *extra])
    everything = config("train.steps=4", "train.target=val_mae <= 10", "mlperf.enabled=true",
                        "observe.profile_steps=1", "observe.profile_skip=0")
    summaries = {2: run_ranks(2, run_job, everything)[0],
                 1: run_job(config()),
                 4: run_ranks(4, run_job, config())[0]}
    return summaries


def _records(summary) -> list[dict]:
    path = f"{summary['run_dir']}/metrics.jsonl"
    return [json.loads(line) for line in open(path)]


def test_target_stops_the_run_and_reports_time_to_train(runs):
    s = runs[2]
    assert s["steps"] == 2 and s["target_reached"] and s["target_reached_step"] == 2
    assert s["time_to_train_s"] > 0 and s["target"] == "val_mae <= 10"


def test_exposed_comm_is_measured(runs):
    alone = [r for r in _records(runs[1]) if "loss" in r]
    assert alone and all(r["exposed_comm_s"] == 0 for r in alone)  # nothing to communicate
    pair = [r for r in _records(runs[2]) if "loss" in r]
    assert all(r["exposed_comm_s"] > 0 and 0 < r["exposed_comm_fraction"] < 1 for r in pair)


def test_tensorboard_holds_what_metrics_jsonl_holds(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = runs[2]["run_dir"]
    events = EventAccumulator(f"{run_dir}/tensorboard").Reload()
    checked = 0
    for record in _records(runs[2]):
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                logged = {e.step: e.value for e in events.Scalars(key)}
                assert logged[record["step"]] == pytest.approx(value, rel=1e-6), key
                checked += 1
            elif key == "bytes_per_step":
                for axis, b in value.items():
                    logged = {e.step: e.value for e in events.Scalars(f"bytes_per_step/{axis}")}
                    assert logged[record["step"]] == pytest.approx(b, rel=1e-6)
    assert checked >= 10
    assert len(events.Scalars("step_loss")) == 2


def test_profile_trace_has_the_named_ranges(runs):
    run_dir = runs[2]["run_dir"]
    for rank in (0, 1):
        trace = json.load(open(f"{run_dir}/profile/rank{rank}.json"))
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"phase.forward", "phase.backward", "phase.optimizer",
                "comm.all_reduce.data.grad"} <= names, sorted(n for n in names if n)[:20]


def _check_mlperf_log(log, cwd) -> None:
    """MLPerf's own checker (HPC ruleset 3.0.0) passes `log` but for the quality target."""
    from mlperf_checker import checker_failures

    failed, text = checker_failures(log, cwd)
    # generated data cannot reach MLPerf's quality target (MAE <= 0.124 on the real CosmoFlow
    # universes): that single quality check is the only one allowed to fail
    assert failed == ["WARNING -  Failed checks for eval_error : v['value'] <= 0.124 and "
                      "v['value'] > 0."], text


def _keys(log) -> list[str]:
    return [json.loads(line.split(":::MLLOG ", 1)[1])["key"] for line in open(log)]


def test_mlperf_log_passes_the_format_rules(runs, tmp_path):
    log = f"{runs[2]['run_dir']}/mlperf.log"
    _check_mlperf_log(log, tmp_path)
    assert "run_stop" in open(log).read() and '"status": "success"' in open(log).read()


def _run_with_faults(faults: str, config):
    """One rank's run with `faults` injected (set in the rank: the ranks' processes outlive a
    test)."""
    from exatrain.train.resilience.faults import ENV

    os.environ[ENV] = faults
    try:
        return run_job(config)
    finally:
        del os.environ[ENV]


def test_a_stopped_and_resumed_run_writes_one_mlperf_log_the_checker_passes(tiny_config,
                                                                             tmp_path):
    config = tiny_config("train.steps=6", "train.eval_every=2", "train.checkpoint_every=0",
                         "mlperf.enabled=true")
    # SIGTERM to rank 1 at step 3: a checkpoint and a clean stop
    stopped = run_ranks(2, _run_with_faults, "term@1:3", config)[0]
    assert stopped["stopped_by_signal"] and stopped["steps"] == 3
    log = Path(stopped["run_dir"]) / "mlperf.log"
    assert _keys(log)[-1] == "run_stop"  # the stopped segment ended its log (status aborted)
    first = _keys(log)
    resumed = run_ranks(2, run_job, config, stopped["run_dir"])[0]
    assert resumed["steps"] == 6 and not resumed["stopped_by_signal"]
    keys = _keys(log)
    assert keys[:len(first) - 1] == first[:-1]  # the first segment's lines stand, but its run_stop
    assert keys.count("run_start") == keys.count("run_stop") == keys.count("init_stop") == 1
    assert keys.count("run_resumed") == 1 and keys[-1] == "run_stop"
    assert keys.count("eval_stop") == 3  # steps 2, 4 and 6
    _check_mlperf_log(log, tmp_path)


def _valid_png(path) -> None:
    data = open(path, "rb").read()
    assert data[:8] == PNG_MAGIC and len(data) > 5_000, path
    height, width = matplotlib.image.imread(path).shape[:2]
    assert 300 <= width <= 3000 and 150 <= height <= 2000, (path, width, height)


def test_report_of_one_run(runs, tmp_path):
    made = build_report([runs[2]["run_dir"]], tmp_path / "one")
    assert {"curves", "throughput", "step_time", "memory", "bytes_per_axis"} <= set(made)
    summary = made.pop("report").read_text()
    for name, path in made.items():
        _valid_png(path)
        assert path.name in summary


def test_report_scaling_from_three_runs_and_a_benchmark(runs, tmp_path):
    bench = tmp_path / "dp.json"
    bench.write_text(json.dumps({"ddp_step_s": 0.2, "exatrain_step_s": 0.19,
                                 "allreduce_bytes_per_step": 19115152}))
    made = build_report([runs[n]["run_dir"] for n in (1, 2, 4)] + [bench], tmp_path / "three")
    assert "scaling" in made and "bench_dp" in made
    summary = made.pop("report").read_text()
    for path in made.values():
        _valid_png(path)
        assert path.name in summary
    assert "Plan(data=4)" in summary and "18.2 MiB" in summary



def _exposed_blocking_vs_overlapped(delay_s: float) -> dict:
    """Rank 1 joins each all-reduce `delay_s` late. Blocking, rank 0 waits all of it; launched
    asynchronously with `delay_s` of work before `wait()` (what the tensor-3D overlap and prefetch
    do), the wait is short. Returns rank 0's seconds blocked in exatrain.comm for each."""
    import time

    import torch

    from exatrain.comm import all_reduce
    from exatrain.mesh import init
    from exatrain.plan import Plan

    mesh = init(Plan(data=2))
    try:
        axis, t = mesh.axis("data"), torch.ones(1000)
        out = {}
        for overlap in (False, True):
            mesh.barrier()
            before = mesh.ledger.blocked_total()
            if mesh.rank == 1:
                time.sleep(delay_s)
                all_reduce(t, axis)
            elif overlap:
                work = all_reduce(t, axis, async_op=True)
                time.sleep(delay_s + 0.05)  # compute that hides the transfer
                work.wait()
            else:
                all_reduce(t, axis)
            out[overlap] = mesh.ledger.blocked_total() - before
        return out
    finally:
        mesh.close()


def test_exposed_comm_counts_blocking_not_overlapped_time():
    exposed = run_ranks(2, _exposed_blocking_vs_overlapped, 0.3)[0]
    assert exposed[False] >= 0.25  # blocked for the late peer
    assert exposed[True] < 0.5 * exposed[False]  # the wait after the work finds it done
