"""MLPerf HPC weak scaling: K model instances trained at once, each to the target; models per minute.

`Plan(trainer=K)` with `population.strategy = "none"` trains K independent instances (no
tournaments), each on its own ranks with its own seed. With `[mlperf] enabled = true` and a
`population.target`, this module makes that run MLPerf HPC's weak-scaling measurement:

- each instance stops at the target: `population.target` on `population.metric[0]` becomes the
  instance's `train.target` (`instance_target`), so its MLPerf log ends in `run_stop` with status
  "success" at the evaluation that reached it;
- each instance's log (RUN_DIR/trainer_KK/mlperf.log, written by the instance's first rank) names
  the instance's own size, `number_of_nodes` x `accelerators_per_node` (MLPerf's instance scale);
- rank 0 copies the logs into MLPerf's result layout, RUN_DIR/weak/<benchmark>/result_K.txt (a
  submission's results/<system>/weak/<benchmark>/ folder), and scores them (`score`) as the
  MLPerf results summarizer scores a weak-scaling folder:

      number_of_models   M  = instances whose log ends in run_stop status "success"
      instance_scale     S  = number_of_nodes x max(accelerators_per_node, 1), the same in every log
      time_to_train_all  TTTa = last run_stop - first run_start over those M logs
      models_per_minute     = M / TTTa (in minutes): the system's training capacity

  (MLPerf counts a log that passes its compliance checks, which include reaching the quality
  target; here a log counts when its instance reached `population.target`.)

Only the standard library: the logs are read back as the `:::MLLOG` JSON lines they are.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..errors import ConfigError

RESULTS = "weak"  # RUN_DIR/weak/<benchmark>/result_K.txt: MLPerf's results/<system>/weak/ layout


def instance_target(metric: str, direction: str, target: float, train_target: str) -> str:
    """The `train.target` each instance stops at: `population.target` on `population.metric[0]`
    ("lower": `metric <= target`, "higher": `metric >= target`)."""
    derived = f"{metric} {'<=' if direction == 'lower' else '>='} {target!r}"
    if train_target and train_target.replace(" ", "") != derived.replace(" ", ""):
        raise ConfigError(
            f"train.target = {train_target!r} and population.target = {target!r} (on "
            f"{metric}, {direction}) disagree: with population.strategy = \"none\" each "
            f"trainer stops at population.target; remove train.target (or set it to "
            f"{derived!r}).")
    return derived


def read_log(path: Path) -> dict:
    """The figures of one instance's MLPerf log the weak-scaling score needs (times in ms)."""
    found: dict = {"path": str(path)}
    for line in Path(path).read_text().splitlines():
        if not line.startswith(":::MLLOG "):
            continue
        event = json.loads(line[len(":::MLLOG "):])
        key = event["key"]
        if key in ("run_start", "run_stop"):
            found[f"{key}_ms"] = event["time_ms"]
        if key == "run_stop":
            found["status"] = event["metadata"].get("status")
        if key in ("number_of_nodes", "accelerators_per_node", "seed"):
            found[key] = event["value"]
    missing = [k for k in ("run_start_ms", "run_stop_ms", "number_of_nodes",
                           "accelerators_per_node") if k not in found]
    if missing:
        raise ValueError(f"{path}: the MLPerf log has no {', '.join(missing)}; it was cut "
                         "short (the instance failed before its run_stop).")
    return found


def models_per_minute(models: int, span_s: float) -> float:
    """MLPerf HPC's weak-scaling figure: `models` trained to the target over the `span_s` seconds
    from the first start to the last stop among them (0 when none reached it)."""
    if not models:
        return 0.0
    return models / (span_s / 60) if span_s > 0 else float("inf")


def score(paths: list[Path]) -> dict:
    """MLPerf HPC's weak-scaling score of a set of instance logs (module docstring)."""
    logs = [read_log(p) for p in paths]
    scales = {p["path"]: int(p["number_of_nodes"]) * max(int(p["accelerators_per_node"]), 1)
              for p in logs}
    if len(set(scales.values())) > 1:
        raise ValueError(f"the instances differ in size (number_of_nodes x "
                         f"accelerators_per_node): {scales}; MLPerf's weak scaling needs every "
                         "instance the same size.")
    done = [p for p in logs if p.get("status") == "success"]
    out = {"number_of_models": len(done), "number_of_instances": len(logs),
           "instance_scale": next(iter(scales.values()), 0)}
    if done:
        span_s = (max(p["run_stop_ms"] for p in done) - min(p["run_start_ms"] for p in done)) / 1e3
        out.update(time_to_train_all_s=span_s,
                   models_per_minute=models_per_minute(len(done), span_s))
    else:
        out.update(time_to_train_all_s=None, models_per_minute=models_per_minute(0, 0.0))
    return out


def collect(run_dir: Path, trainers: int, benchmark: str) -> list[Path]:
    """Copy each instance's log (trainer_KK/mlperf.log) to RUN_DIR/weak/<benchmark>/result_K.txt.
    Returns the copies' paths."""
    folder = Path(run_dir) / RESULTS / benchmark
    folder.mkdir(parents=True, exist_ok=True)
    copies = []
    for k in range(trainers):
        source = Path(run_dir) / f"trainer_{k:02d}" / "mlperf.log"
        if not source.is_file():
            raise FileNotFoundError(f"{source}: trainer {k}'s MLPerf log is missing; every "
                                    "instance's first rank writes one when mlperf.enabled = true.")
        copies.append(Path(shutil.copyfile(source, folder / f"result_{k}.txt")))
    return copies


def summarize(run_dir: Path, trainers: int, benchmark: str) -> dict:
    """Rank 0, after every instance has stopped: the result folder and the summary's figures."""
    results = collect(run_dir, trainers, benchmark)
    figures = score(results)
    return {"mlperf_results": str(results[0].parent), "models_per_minute":
            figures["models_per_minute"], "time_to_train_all_s": figures["time_to_train_all_s"],
            "instance_scale": figures["instance_scale"]}


def describe(summary: dict) -> str:
    """One line for the console: the weak-scaling figure of a population summary, in words."""
    trainers, models = summary["trainers"], summary.get("models_reached_target", 0)
    if not summary.get("time_to_train_all_s"):
        return f"weak scaling: none of the {trainers} instances reached the target"
    span = summary["time_to_train_all_s"]
    span_text = f"{span:.3g} s" if span < 120 else f"{span / 60:.3g} min"
    return (f"weak scaling: {summary['models_per_minute']:.3g} models/min: {models} of "
            f"{trainers} instances ({summary['instance_scale']} accelerator(s) each) reached the "
            f"target, {span_text} from the first run_start to the last run_stop; MLPerf logs "
            f"in {summary['mlperf_results']}")
