"""`exatrain report RUN_DIR [RUN_DIR ...] [--out DIR]`: figures and a one-page Markdown summary.

One run: training/validation curves, samples/s and MFU over steps, where each step's time went
(input wait, exposed communication, compute), memory per rank, bytes per step
by mesh axis against the algorithm's minimum, and the pipeline timeline where the run has one.
Several runs of one workload: the same curves overlaid, scaling curves (throughput and parallel
efficiency against ranks) and a side-by-side table. A benchmark JSON (`exatrain bench NAME --json`)
is drawn as a table. The summary `report.md` names every figure it links.
"""

from __future__ import annotations

import json
from pathlib import Path

from .units import human_value
from . import figures
from .runs import RunRecord, read_run
from ..errors import ArgumentError, MissingFileError

# summary keys of the side-by-side table, in order
TABLE_KEYS = ("world_size", "plan", "steps", "samples_per_s", "step_s_median", "mfu",
              "final_loss", "state_bytes", "peak_activation_bytes", "exposed_comm_fraction",
              "data_wait_fraction", "time_to_train_s", "wall_s")


def _markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _last(run: RunRecord, key: str):
    if key in run.summary:
        return run.summary[key]
    return next((r[key] for r in reversed(run.train) if key in r), None)


def _runs_section(runs: list[RunRecord], out: Path, made: dict) -> list[str]:
    lines = []
    made["curves"] = figures.curves(runs, out / "curves.png")
    made["throughput"] = figures.throughput(runs, out / "throughput.png")
    path = figures.step_time(runs, out / "step_time.png")
    if path:
        made["step_time"] = path
    for run in runs:
        suffix = f"_{run.name}" if len(runs) > 1 else ""
        made[f"memory{suffix}"] = figures.memory(run, out / f"memory{suffix}.png")
    path = figures.bytes_per_axis(runs, out / "bytes_per_axis.png")
    if path:
        made["bytes_per_axis"] = path
    for run in runs:
        timeline = run.path / "pipeline_timeline.json"
        if timeline.is_file():
            from .timeline import plot_timeline
            suffix = f"_{run.name}" if len(runs) > 1 else ""
            made[f"pipeline_timeline{suffix}"] = plot_timeline(
                timeline, out / f"pipeline_timeline{suffix}.png")
    if len(runs) >= 2 and len({r.world_size for r in runs}) >= 2:
        made["scaling"] = figures.scaling(runs, out / "scaling.png")
    header = ["", *[r.name for r in runs]]
    rows = [[key, *[human_value(key, _last(r, key)) if _last(r, key) is not None else "-"
                    for r in runs]] for key in TABLE_KEYS]
    evals = sorted({k for r in runs for e in r.evals for k in e if k != "step"})
    rows += [[key, *[human_value(key, r.evals[-1].get(key)) if r.evals else "-" for r in runs]]
             for key in evals]
    lines += ["## Runs", "", _markdown_table(header, rows), ""]
    return lines


def _benchmark_section(path: Path, out: Path, made: dict) -> list[str]:
    result = json.loads(path.read_text())
    rows = [(k, human_value(k, v)) for k, v in result.items()
            if not isinstance(v, (dict, list))] if isinstance(result, dict) else []
    if not rows:   # not an object, or one without a single flat figure
        raise ArgumentError(f"{path}: a benchmark JSON is one flat object of figures "
                            "(as `exatrain bench NAME --json` writes); this is not.")
    made[f"bench_{path.stem}"] = figures.table(rows, f"benchmark {path.stem}",
                                               out / f"bench_{path.stem}.png")
    return [f"## Benchmark `{path.name}`", "", _markdown_table(["figure", "value"],
                                                              [list(r) for r in rows]), ""]


def build_report(paths: list[str | Path], out: str | Path | None = None) -> dict[str, Path]:
    """Write the figures and report.md into `out`; returns {figure name: path}."""
    paths = [Path(p) for p in paths]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise MissingFileError(f"exatrain report: {', '.join(missing)} does not exist; give run "
                               "directories (runs/<workload>-<time>/) or benchmark JSON files.")
    run_paths = [p for p in paths if p.is_dir()]
    bench_paths = [p for p in paths if p.is_file()]
    if out is None:
        out = run_paths[0] / "report" if len(paths) == 1 and run_paths else Path("report")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [read_run(p) for p in run_paths]
    workloads = {r.workload for r in runs}
    made: dict[str, Path] = {}
    title = (f"exatrain report: {', '.join(sorted(workloads))}" if runs else "exatrain report")
    lines = [f"# {title}", ""]
    if len(workloads) > 1:
        lines += [f"Note: these runs train different workloads ({', '.join(sorted(workloads))}); "
                  "scaling curves compare like with like only.", ""]
    if runs:
        lines += _runs_section(runs, out, made)
    for path in bench_paths:
        lines += _benchmark_section(path, out, made)
    lines += ["## Figures", ""]
    lines += [f"- **{name}**: ![{name}]({p.name})" for name, p in made.items()]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    made["report"] = out / "report.md"
    if len(run_paths) == 1 and (run_paths[0] / "trackers.json").is_file():
        from .trackers import attach  # the same W&B and MLflow runs get them
        attach(run_paths[0], list(made.values()))
    return made
