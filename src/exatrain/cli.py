"""The `exatrain` command line: run, data, bench."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console


def _run(args) -> int:
    from .launch import detect, spawn
    from .train.config import load_config
    from .train.run import find_resume_checkpoint, run_job
    from .workloads import get_workload

    console = Console(stderr=True)
    if args.config and args.config.endswith(".py"):  # a script that calls exatrain.fit
        from .train.fit import launch, run_script
        if detect() is not None:
            run_script(args.config)
        else:
            launch(args.config, args.nproc or 1)
        return 0
    config_path = args.config
    if args.resume:
        find_resume_checkpoint(args.resume)  # fail now, before any rank starts
        config_path = config_path or str(Path(args.resume) / "config.toml")
    overrides = (args.set or []) + ([f"observe.profile_steps={args.profile}"] if args.profile else [])
    config = load_config(config_path, overrides)
    launch = detect()
    if launch is not None:  # under torchrun / srun / flux / jsrun / mpirun: this is one rank
        summary = run_job(config, args.resume)
        if launch.rank == 0:
            _draw_timeline(summary.get("run_dir"))
        return 0
    nproc = args.nproc or config.run.nproc
    config.plan.resolve(nproc)  # refuse a Plan that does not fit before any rank starts
    workload = get_workload(config.run.workload)
    console.print(f"[bold]exatrain run[/]: {config.run.workload} on {nproc} local rank(s)")
    workload.prepare(config, progress=_progress(console, "writing data"))  # once, here, before the ranks start
    if nproc == 1:
        summary = run_job(config, args.resume)
    else:
        summary = spawn(run_job, nproc, args=(config, args.resume))[0]
    _draw_timeline(summary.get("run_dir"))
    _print_summary(console, summary)
    return 0


def _draw_timeline(run_dir) -> None:
    """A pipelined run keeps the picture of its last logged step beside the JSON."""
    path = Path(run_dir or ".") / "pipeline_timeline.json"
    if run_dir and path.is_file():
        from .observe.timeline import plot_timeline
        plot_timeline(path)


def _progress(console: Console, label: str):
    """A callback(done, total) that prints progress every tenth of the way."""
    def report(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            console.print(f"{label}: {done}/{total}", highlight=False)
    return report


def _print_summary(console: Console, summary: dict) -> None:
    from rich.table import Table

    table = Table(title="run summary", show_header=False)
    from .train.units import human_bytes, human_value

    for key, value in summary.items():
        if key == "memory_per_rank":  # a list per rank: its largest figures are what matter
            value = "max over ranks: state " + human_bytes(max(r["state_bytes"] or 0 for r in value)) \
                + ", peak " + human_bytes(max(r["peak_mem_bytes"] or 0 for r in value))
        elif key == "bytes_per_step":
            value = " ".join(f"{a}={human_bytes(b)}" for a, b in value.items()) or "-"
        else:
            value = human_value(key, value)
        table.add_row(key, str(value))
    console.print(table)
    if summary.get("run_dir"):
        console.print(f"results: [bold]{summary['run_dir']}[/] (config.toml, metrics.jsonl, "
                      "summary.json, checkpoints/)")


def _data(args) -> int:
    console = Console(stderr=True)
    info = args.write(args, progress=_progress(console, f"exatrain data {args.name}"))
    console.print(json.dumps(info, indent=1, default=str))
    return 0


def _report(args) -> int:
    from .observe.report import build_report

    made = build_report(args.paths, args.out)
    Console(stderr=True).print(f"report: [bold]{made['report']}[/] ({len(made) - 1} figures)")
    return 0


def _bench(args) -> int:
    from .bench import run_benchmark

    result = run_benchmark(args.name, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exatrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train (no CONFIG: the built-in CosmoFlow example)")
    run.add_argument("config", nargs="?", help="TOML config file (see examples/), or a Python "
                                                "script calling exatrain.fit")
    run.add_argument("--nproc", type=int, default=0, help="local ranks to spawn (default: run.nproc)")
    run.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                     help="override a config value; repeatable")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its "
                                                         "latest checkpoint")
    run.add_argument("--profile", type=int, metavar="STEPS", help="record a torch.profiler "
                     "trace of STEPS steps on every rank into RUN_DIR/profile/ (observe.profile_*)")
    run.set_defaults(func=_run)

    report = sub.add_parser("report", help="figures and a summary of finished runs or benchmarks")
    report.add_argument("paths", nargs="+", metavar="RUN_DIR|BENCH.json")
    report.add_argument("--out", metavar="DIR", help="where to write (default: RUN_DIR/report "
                                                     "for one run, ./report for several)")
    report.set_defaults(func=_report)

    from .data import writers
    data = sub.add_parser("data", help="write a data set as HDF5")
    writers.add_parsers(data)
    data.set_defaults(func=_data)

    from .bench import BENCHMARKS, add_common_arguments, bench_module
    bench = sub.add_parser("bench", help="side-by-side benchmark against the PyTorch baseline")
    names = bench.add_subparsers(dest="name", required=True)
    for name in BENCHMARKS:
        module = bench_module(name)
        one = names.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        one.add_argument("--json", metavar="PATH", help="write the figures as JSON")
        add_common_arguments(one)
        module.add_arguments(one)
        one.set_defaults(func=_bench)
    return parser


def main(argv=None) -> int:
    from .launch.local import RankFailed
    from .plan import PlanError
    from .train.config import ConfigError
    from .train.run import ResumeError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, PlanError, ResumeError, FileNotFoundError, ValueError) as exc:
        print(f"exatrain: error: {exc}", file=sys.stderr)
        return 2
    except RankFailed as exc:
        original = getattr(exc, "original", None)
        if isinstance(original, (ConfigError, PlanError, FileNotFoundError, ValueError)) or \
                type(original).__name__ == "NonFiniteLoss":
            print(f"exatrain: error on rank {exc.rank}: {original}", file=sys.stderr)
        else:
            print(f"exatrain: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
