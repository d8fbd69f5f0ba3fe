"""The `exatrain` command line: run, preflight, predict, data, plan, tune, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console


def _run(args) -> int:
    from .launch import detect
    from .launch.signals import hold_early_signals

    if detect() is not None and not args.print_batch_script:
        hold_early_signals()  # one rank of a launched job: a warning while starting is kept
        from .launch.preload import import_rank_modules
        import_rank_modules()  # torch._dynamo, which its first optimizer imports: paused
    from .train.config import ConfigError, load_config
    from .train.run import find_resume_checkpoint, run_job
    from .workloads import get_workload

    console = Console(stderr=True)
    script_args = getattr(args, "script_args", [])
    if args.config and args.config.endswith(".py"):  # a script that calls exatrain.fit
        return _run_script(args, script_args, console)
    if script_args:
        raise ConfigError(f"arguments after `--` ({' '.join(script_args)}) go to a Python "
                          f"script (`exatrain run train.py -- ARGS`), not to a config; set a "
                          f"config's keys with --set SECTION.KEY=VALUE")
    config_path = args.config
    if args.resume:
        find_resume_checkpoint(args.resume)  # fail now, before any rank starts
        config_path = config_path or str(Path(args.resume) / "config.toml")
    overrides = (args.set or []) + ([f"observe.profile_steps={args.profile}"] if args.profile else [])
    config = load_config(config_path, overrides)
    if args.print_batch_script:
        return _print_batch_script(args, config)
    launch = detect()
    if launch is not None:  # under torchrun / srun / flux / jsrun / mpirun: this is one rank
        summary = run_job(config, args.resume)
        if launch.rank == 0:
            _draw_timeline(summary.get("run_dir"))
            _print_summary(console, summary)
        return 0
    nproc = args.nproc or config.run.nproc
    plan, supervise_groups = config.plan, None
    if config.fault_tolerance.enabled:  # replica groups: each a job of its own
        from .train.resilience.replicas import GROUP_ENV, group_count, group_plan_options
        plan = group_plan_options(config)
        if os.environ.get(GROUP_ENV) is None:  # this process starts every group (nproc in all)
            from .train.resilience.replica_launch import supervise_groups
            nproc_group = nproc // group_count(config) or 1
            plan.resolve(nproc_group)
    if supervise_groups is None:
        plan.resolve(nproc)  # refuse a Plan that does not fit before any rank starts
    workload = get_workload(config.run.workload)
    console.print(f"[bold]exatrain run[/]: {config.run.workload} on {nproc} local rank(s)")
    workload.prepare(config, progress=_progress(console, "writing data"))  # once, here, before the ranks start

    def plain(text: str) -> None:  # a restart's report quotes errors: "[/x/pair.cc:537]" is
        console.print(text, highlight=False, markup=False)  # no markup

    if supervise_groups is not None:  # one restart loop per replica group, and a lighthouse
        argv = ["run", *([config_path] if config_path else [])]  # (--resume: the run's config)
        for item in overrides:
            argv += ["--set", item]
        summary = supervise_groups(config, argv, nproc, args.max_restarts, report=plain,
                                   resume=args.resume)
    elif args.max_restarts > 0 or nproc > 1:
        from .train.resilience.restart import supervise
        summary = supervise(run_job, config, nproc, args.resume, args.max_restarts,
                            report=plain)
    else:
        summary = run_job(config, args.resume)
    _draw_timeline(summary.get("run_dir"))
    _print_summary(console, summary)
    return 0


def _run_script(args, script_args: list[str], console: Console) -> int:
    """`exatrain run SCRIPT [--nproc N] [-- ARGS]`: every rank runs the script with ARGS as its
    sys.argv[1:]; the summary of each et.fit it called is printed as a config run's is."""
    from .launch import detect
    from .train.fit import launch, run_script

    rank = detect()
    if rank is not None:  # under torchrun / srun / ...: this process is one rank
        summaries = run_script(args.config, script_args)
        if rank.rank != 0:
            return 0
    else:
        nproc = args.nproc or 1
        console.print(f"[bold]exatrain run[/]: {args.config} on {nproc} local rank(s)")
        summaries = launch(args.config, nproc, script_args)[0]
    for summary in summaries:
        _print_summary(console, summary)
    return 0


def _preflight(args) -> int:
    """Links and ranks checked under the job's launcher and Plan; exit code 3 when any is slow."""
    from .launch import detect, spawn
    from .observe.preflight import SLOW_EXIT_CODE, PreflightOptions, exclude_line, format_report
    from .train.config import load_config

    config = load_config(args.config, args.set or [])
    options = PreflightOptions(threshold=args.threshold, iters=args.iters)
    if args.sizes:
        options.sizes = [_bytes(s) for s in args.sizes.split(",")]
    if args.link_bytes:
        options.link_bytes = _bytes(args.link_bytes)
    launch = detect()
    if launch is not None:  # under torchrun / srun / flux / jsrun / mpirun: this is one rank
        report = preflight_job(config, options)
        main = launch.rank == 0
    else:
        nproc = args.nproc or config.run.nproc
        config.plan.resolve(nproc)  # refuse a Plan that does not fit before any rank starts
        report = spawn(preflight_job, nproc, args=(config, options))[0] if nproc > 1 else \
            preflight_job(config, options)
        main = True
    if main:
        print(format_report(report))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=1))
        if args.exclude_file:
            Path(args.exclude_file).write_text(exclude_line(report) + "\n")
    return 0 if report["ok"] else SLOW_EXIT_CODE


def preflight_job(config, options) -> dict:
    """One rank of `exatrain preflight`: join the job as `exatrain run` would (its launcher,
    Plan and process group), measure (observe.preflight, which takes the mesh so that it sits
    below train), leave."""
    from .observe.preflight import preflight_rank
    from .train.job import join

    mesh = join(config)
    try:
        return preflight_rank(mesh, config, options)
    finally:
        mesh.close()


def _bytes(text: str) -> int:
    """"64", "4K", "16M", "1G" -> bytes (powers of 1024)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def _print_batch_script(args, config) -> int:
    from .launch.batch import Resources, batch_script

    nodes = args.nodes
    per_node = args.tasks_per_node or args.gpus_per_node or config.run.nproc
    resources = Resources(gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
                          account=args.account or "", partition=args.partition or "",
                          qos=args.qos or "", constraint=args.constraint or "",
                          sbatch_args=args.sbatch_arg or [])
    groups = 0
    if config.fault_tolerance.enabled:  # one srun step per replica group, and a lighthouse
        from .train.resilience.replicas import group_count
        groups = group_count(config)
    try:
        text = batch_script(args.print_batch_script, args.config or "", config, nodes, per_node,
                            time=args.time, warn_s=args.signal_before, overrides=args.set or [],
                            resources=resources, replica_groups=groups,
                            group_restarts=args.max_restarts or 3)
    except ValueError as exc:
        print(f"exatrain run: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


def _export(args) -> int:
    from .train.checkpoints.export import export_run

    info = export_run(args.run_dir, args.out, args.step)
    print(f"exported {info['tensors']} tensors ({info['bytes'] / 2**20:.1f} MiB) from "
          f"{info['checkpoint']} to {info['out']}", file=sys.stderr)
    return 0


def _predict(args) -> int:
    from .launch import detect, spawn
    from .infer.predict import (PredictError, check_plan, find_checkpoint, predict, predict_rank,
                                ranks_needed, run_config)

    kwargs = dict(run_dir=args.run_dir, data=args.data, out=args.out, step=args.step,
                  batch_size=args.batch_size, overrides=args.set or [])
    if detect() is not None:  # under torchrun / srun / ...: this is one rank
        predict(**kwargs)
        return 0
    find_checkpoint(args.run_dir, args.step)  # fail now, before any rank starts
    if args.data and not Path(args.data).exists():
        raise PredictError(f"--data {args.data}: no such file or directory.")
    config = run_config(args.run_dir, args.set or [])
    nproc = args.nproc or ranks_needed(config)
    check_plan(config.plan.resolve(nproc))
    if nproc == 1:
        predict(**kwargs)
    else:
        spawn(predict_rank, nproc, args=(kwargs,))
    return 0


def _draw_timeline(run_dir) -> None:
    """A pipelined run keeps the picture of its last logged step beside the JSON."""
    path = Path(run_dir or ".") / "pipeline_timeline.json"
    if run_dir and path.is_file():
        from .observe.timeline import plot_timeline
        plot_timeline(path)


def _progress(console: Console, label: str):
    """A callback(done, total): a bar with rate and ETA on a terminal, else a line every tenth."""
    from .observe.console import work_progress
    return work_progress(console, label)


def _print_summary(console: Console, summary: dict) -> None:
    from rich.table import Table

    from .observe.console import summary_rows

    table = Table(title="run summary", show_header=False)
    for key, value in summary_rows(summary):  # docs: reference/summary.md
        table.add_row(key, value)
    console.print(table)
    if summary.get("run_dir"):
        from pathlib import Path
        kept = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(summary["run_dir"]).iterdir())
        console.print(f"results: [bold]{summary['run_dir']}[/] ({', '.join(kept)})")


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


def _run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("config", nargs="?", help="TOML config file (see examples/), or a Python "
                                                "script calling exatrain.fit; `-- ARGS` at the "
                                                "end go to the script as its sys.argv[1:]")
    run.add_argument("--nproc", type=int, default=0, help="local ranks to spawn (default: run.nproc)")
    run.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                     help="override a config value; repeatable")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its "
                                                         "latest checkpoint")
    run.add_argument("--profile", type=int, metavar="STEPS", help="record a torch.profiler "
                     "trace of STEPS steps on every rank into RUN_DIR/profile/ (observe.profile_*)")
    run.add_argument("--max-restarts", type=int, default=0, metavar="N",
                     help="when a rank dies, restart all ranks from the last checkpoint, up to N "
                          "times (under torchrun: use torchrun --max-restarts); with "
                          "[fault_tolerance], restart a failed replica group up to N times (in a "
                          "batch script: default 3)")
    run.add_argument("--print-batch-script", choices=("slurm", "flux"),
                     help="print a batch script for this config (wall-time signal, requeue) and exit")
    run.add_argument("--nodes", type=int, default=1, help="nodes, for --print-batch-script")
    run.add_argument("--tasks-per-node", type=int, default=0,
                     help="ranks per node, for --print-batch-script (default: run.nproc)")
    run.add_argument("--time", default="04:00:00", help="wall time, for --print-batch-script")
    run.add_argument("--signal-before", type=int, default=180, metavar="SECONDS",
                     help="the wall-time warning this long before the limit, for --print-batch-script")
    for flag, kind, what in (("--gpus-per-node", int, "GPUs per node (one rank per GPU)"),
                             ("--cpus-per-task", int, "CPU cores per rank (sets OMP_NUM_THREADS)"),
                             ("--account", str, "the allocation to charge"),
                             ("--partition", str, "the partition (queue)"),
                             ("--qos", str, "the quality of service"),
                             ("--constraint", str, "node features, e.g. gpu")):
        run.add_argument(flag, type=kind, default=0 if kind is int else None,
                         help=f"{what}, for --print-batch-script slurm")
    run.add_argument("--sbatch-arg", action="append", metavar="NAME=VALUE",
                     help="any other sbatch option, written as `#SBATCH --NAME=VALUE` (repeatable)")
    run.set_defaults(func=_run)


def _preflight_arguments(pre: argparse.ArgumentParser) -> None:
    pre.add_argument("config", nargs="?", help="the job's TOML config (its Plan and paths)")
    pre.add_argument("--nproc", type=int, default=0, help="local ranks to spawn (default: run.nproc)")
    pre.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                     help="override a config value; repeatable")
    pre.add_argument("--json", metavar="PATH", help="write the whole report as JSON")
    pre.add_argument("--exclude-file", metavar="PATH", help="write the slow hosts, comma-separated, "
                     "for srun --exclude=$(cat PATH)")
    pre.add_argument("--sizes", metavar="LIST", help="message sizes, e.g. 1K,64K,1M,16M (default)")
    pre.add_argument("--link-bytes", metavar="SIZE", help="bytes per pairwise link test (default 4M)")
    pre.add_argument("--iters", type=int, default=10, help="timed calls per size (after 3 warm-up)")
    pre.add_argument("--threshold", type=float, default=0.5,
                     help="slow: below this fraction of the median (default 0.5)")
    pre.set_defaults(func=_preflight)


def _report_arguments(report: argparse.ArgumentParser) -> None:
    report.add_argument("paths", nargs="+", metavar="RUN_DIR|BENCH.json")
    report.add_argument("--out", metavar="DIR", help="where to write (default: RUN_DIR/report "
                                                     "for one run, ./report for several)")
    report.set_defaults(func=_report)


def _export_arguments(export: argparse.ArgumentParser) -> None:
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("--out", required=True, help="output .safetensors path")
    export.add_argument("--step", type=int, default=None, help="a checkpoint's step (default: latest)")
    export.set_defaults(func=_export)


def _predict_arguments(predict: argparse.ArgumentParser) -> None:
    predict.add_argument("run_dir", metavar="RUN_DIR")
    predict.add_argument("--data", metavar="PATH", help="data in a layout the run's workload "
                         "reads (CosmoFlow: a .h5 file, a per-sample directory, or a data "
                         "directory: its validation split); default: the run's validation set")
    predict.add_argument("--out", metavar="FILE", help="output HDF5 (default: RUN_DIR/predictions.h5)")
    predict.add_argument("--nproc", type=int, default=0, help="local ranks to spawn (default: the "
                         "fewest the Plan needs)")
    predict.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                         help="override the run's config, e.g. --set plan.space=[1,1,2]; repeatable")
    predict.add_argument("--step", type=int, default=None, help="a checkpoint's step (default: latest)")
    predict.add_argument("--batch-size", type=int, default=0,
                         help="samples per global batch (default: the run's train.batch_size)")
    predict.set_defaults(func=_predict)


def _data_arguments(data: argparse.ArgumentParser) -> None:
    from .data import writers
    writers.add_parsers(data)
    data.set_defaults(func=_data)


def _bench_arguments(bench: argparse.ArgumentParser, chosen: str | None) -> None:
    """One sub-parser per benchmark; only `chosen` (every one when None: `exatrain bench --help`
    lists them with their summaries) imports its module and gets its arguments."""
    from .bench import BENCHMARKS, add_common_arguments, bench_module

    names = bench.add_subparsers(dest="name", required=True)
    for name in BENCHMARKS:
        if chosen is not None and name != chosen:
            names.add_parser(name)   # a name argparse accepts and lists; never parsed here
            continue
        module = bench_module(name)
        one = names.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
        one.add_argument("--json", metavar="PATH", help="write the figures as JSON")
        add_common_arguments(one)
        module.add_arguments(one)
        one.set_defaults(func=_bench)


# Every subcommand, in the order `exatrain --help` lists them: its summary, and what adds its
# arguments. build_parser(argv) adds the arguments of the one subcommand argv runs, so the
# modules they import (the planner's exatrain.tune, the benchmarks' exatrain.bench) are imported
# only when that subcommand runs: `srun exatrain run` imports neither on any rank.
# "plan" and "tune" (None) are added together by exatrain.tune.commands.add_parsers, with its own
# summaries (tests/test_cli.py checks that the lazy and the full `exatrain --help` are the same).
COMMANDS = {
    "run": ("train (no CONFIG: the built-in CosmoFlow example)", _run_arguments),
    "preflight": ("before a long run: bus bandwidth per mesh axis, slow ranks and nodes (an srun "
                  "--exclude list), rank checks", _preflight_arguments),
    "report": ("figures and a summary of finished runs or benchmarks", _report_arguments),
    "export": ("write a run's model as one unsharded safetensors file", _export_arguments),
    "predict": ("run a trained model over a data set; write the predictions (with sample ids) to "
                "HDF5", _predict_arguments),
    "data": ("write a data set as HDF5", _data_arguments),
    "plan": ("every valid Plan ranked by predicted step time; --dry-run RANK, --calibrate", None),
    "tune": ("measure at most --budget Plans, surrogate on the cost model's residuals, return the "
             "best", None),
    "bench": ("side-by-side benchmark against the PyTorch baseline", _bench_arguments),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `exatrain` parser. With `argv` (a command line without the program name), only the
    subcommand it names gets its arguments, and under `bench` only the benchmark it names: the
    others are listed by name and summary, enough for `exatrain --help` and argparse's 'invalid
    choice'. Without `argv`, every subcommand in full (the CLI reference in docs/hooks.py)."""
    parser = argparse.ArgumentParser(prog="exatrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    if argv is None:   # every subcommand, every benchmark
        command = chosen = None
    else:
        command = argv[0] if argv and not argv[0].startswith("-") else ""
        chosen = argv[1] if command == "bench" and len(argv) > 1 and \
            not argv[1].startswith("-") else None
    for name, (summary, add_arguments) in COMMANDS.items():
        planner = name in ("plan", "tune")   # the planner adds both, with their arguments
        full = command is None or command == name or planner and command in ("plan", "tune")
        if planner and full:
            if name not in sub.choices:
                from .tune.commands import add_parsers as add_planner_parsers
                add_planner_parsers(sub)
            continue
        one = sub.add_parser(name, help=summary)
        if full:
            add_arguments(one, chosen) if name == "bench" else add_arguments(one)
    return parser


def main(argv=None) -> int:
    from .errors import is_peer_loss, is_user_error, known_cause
    from .launch.local import RankFailed

    argv = sys.argv[1:] if argv is None else list(argv)
    script_args = []
    if argv[:1] in (["run"], ["plan"]) and "--" in argv:  # `exatrain run SCRIPT ... -- ARGS`
        argv, script_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = build_parser(argv).parse_args(argv)
    args.script_args = script_args
    try:
        return args.func(args)
    except RankFailed as exc:
        original = getattr(exc, "original", None)
        if getattr(exc, "diagnosis", None):
            print(f"exatrain: {exc.diagnosis}\n(first failure: {str(exc).splitlines()[0]})",
                  file=sys.stderr)
            return 1
        if original is None and not exc.remote_traceback:  # died without raising: a signal
            print(f"exatrain: {exc}" + (f" (after {exc.restarts} restart(s))"
                                        if getattr(exc, "restarts", 0) else ""), file=sys.stderr)
            return 1
        if is_user_error(original):   # one line on behalf of every rank: the first to fail
            print(f"exatrain: {type(original).__name__} on rank {exc.rank}: {original}",
                  file=sys.stderr)
            return 2
        if known_cause(original):
            print(f"exatrain: error on rank {exc.rank}: {known_cause(original)}\n"
                  f"({type(original).__name__}: {original})", file=sys.stderr)
            return 2
        print(f"exatrain: internal error (a bug in exatrain or in the model code, not in your "
              f"input; the traceback follows and is in the run directory's error_rank*.log): {exc}",
              file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - sorted into the user's and ours below
        if is_user_error(exc):   # named by its class, as in the errors reference page
            print(f"exatrain: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        if known_cause(exc):
            print(f"exatrain: error: {known_cause(exc)}\n({type(exc).__name__}: {exc})",
                  file=sys.stderr)
            return 2
        if is_peer_loss(exc):  # under torchrun/srun: the launcher names the rank that died first
            print(f"exatrain: this rank lost its connection to another rank, which failed first; "
                  f"its own error (or the launcher's report) is the cause. ({str(exc)[:200]})",
                  file=sys.stderr)
            return 1
        import traceback
        traceback.print_exc()
        print(f"exatrain: internal error (a bug in exatrain or in the model code, not in your "
              f"input; traceback above): {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:  # a launched rank's group outlives its meshes (Mesh.close); ended here, in order
        from .launch.teardown import tear_down
        tear_down()


if __name__ == "__main__":
    sys.exit(main())
