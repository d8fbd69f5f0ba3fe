"""Trackers: the default job with and without W&B (offline) and MLflow (SQLite), side by side.

One launch runs the job (the default example, or `--config`) `--repeats` times each way,
alternating, on `--nproc` local ranks: baseline `observe.trackers = ["tensorboard"]`, exatrain
`["tensorboard", "wandb", "mlflow"]`. The step time is each run's median (summary
`step_s_median`); the figure is the median over repeats.

Figures:
  step_s_off, step_s_on      median step time without and with the trackers
  step_time_ratio            on / off (target: within 2 %)
  samples_per_s_off, _on, _ratio  mean throughput of the logging intervals after the first (every
                             step counts, those the trackers' thread may slow included)
  val_mae_off, val_mae_on    the final validation metric of the last run each way (the same job:
                             equal up to rounding)
  metrics_numbers            numbers of the last tracked run's metrics.jsonl (step, key)
  wandb_missing, mlflow_missing  of those, how many the W&B offline files / the MLflow store do
                             not hold at their step (target: 0)
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--config", default=None,
                        help="the job's TOML (default: the default example)")
    parser.add_argument("--nproc", type=int, default=0, help="ranks (0: run.nproc)")
    parser.add_argument("--repeats", type=int, default=2, help="runs each way, alternating")
    parser.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override")


def _held(run_dir: Path, summary: dict) -> dict[str, set]:
    """(step, key) pairs the W&B offline logs and the MLflow store of a run hold."""
    from mlflow.tracking import MlflowClient

    from ..observe.tracker_wandb import read_wandb_log
    out: dict[str, set] = {"wandb": set(), "mlflow": set()}
    for log in run_dir.glob("wandb/*/run-*.wandb"):
        for record in read_wandb_log(log):
            if record.WhichOneof("record_type") == "history":
                out["wandb"] |= {(record.history.step.num, i.key or "/".join(i.nested_key))
                                 for i in record.history.item}
    info = summary["trackers"]["mlflow"]
    if "failed" in info:
        return out
    client = MlflowClient(tracking_uri=info["tracking_uri"])
    for key in client.get_run(info["run_id"]).data.metrics:
        out["mlflow"] |= {(m.step, key) for m in client.get_metric_history(info["run_id"], key)}
    return out


def run(args) -> dict:
    from ..train.config import load_config
    from ..observe.tracker_mlflow import MLflowRun
    from ..observe.tracker_records import rows
    from ..train.resilience.restart import supervise
    from ..train.run import run_job
    from ..workloads import get_workload

    ways = {"off": '["tensorboard"]', "on": '["tensorboard", "wandb", "mlflow"]'}
    times: dict[str, list] = {"off": [], "on": []}
    speed: dict[str, list] = {"off": [], "on": []}  # mean over each logging interval but the first
    last: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="exatrain-trackers-") as tmp:
        for _ in range(args.repeats):
            for way, trackers in ways.items():
                steps = [f"train.steps={args.steps}"] if args.steps else []
                config = load_config(args.config, [
                    f"run.out_dir={tmp}/runs", *steps, *(args.set or []),
                    f"observe.trackers={trackers}"])
                get_workload(config.run.workload).prepare(config)
                nproc = args.nproc or config.run.nproc
                last[way] = supervise(run_job, config, nproc, None, 0, report=print)
                times[way].append(last[way]["step_s_median"])
                records = [json.loads(line) for line in
                           (Path(last[way]["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
                rates = [r["samples_per_s"] for r in records if "samples_per_s" in r][1:]
                speed[way].append(statistics.mean(rates) if rates else math.nan)
        run_dir = Path(last["on"]["run_dir"])
        want = {(step, key) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                for step, values in rows(json.loads(line)).items() for key in values}
        held = _held(run_dir, last["on"])
        speeds = {way: statistics.mean(speed[way]) for way in ways}
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    metric = next((k for k in ("val_mae", "val_loss", "val_acc") if k in last["on"]), None)
    return {"step_s_off": off, "step_s_on": on, "step_time_ratio": on / off,
            "step_s_off_runs": times["off"], "step_s_on_runs": times["on"],
            f"{metric}_off": last["off"].get(metric), f"{metric}_on": last["on"].get(metric),
            "metrics_numbers": len(want), "wandb_missing": len(want - held["wandb"]),
            "mlflow_missing": len({(s, MLflowRun.key(k)) for s, k in want} - held["mlflow"]),
            "samples_per_s_off": speeds["off"], "samples_per_s_on": speeds["on"],
            "samples_per_s_ratio": speeds["on"] / speeds["off"],
            "trackers": last["on"].get("trackers"), "repeats": args.repeats}
