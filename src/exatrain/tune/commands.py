"""`exatrain plan` and `exatrain tune`: the command-line face of the planner and the tuner."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..plan import Plan, PlanError
from .layout import Options, options_from_config
from ..errors import ArgumentError, MissingFileError
from ..observe.units import human_count


def parse_plan(text: str) -> Plan:
    """'data=32,shard=4,tensor=8' or 'data=64,space=2x4x4' or 'tensor=2x2x2' -> Plan."""
    degrees = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if not value:
            raise PlanError(f"--plan {text!r}: write axis=degree pairs, e.g. "
                            "data=32,shard=4,tensor=8 or data=64,space=2x4x4")
        nums = tuple(int(v) for v in value.lower().split("x"))
        degrees[key.strip()] = nums[0] if len(nums) == 1 else nums
    return Plan(**degrees)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _options_shown(plan, options) -> str:
    """A Plan's options as the table shows them: its ZeRO stage named whenever it shards
    (`Options.label` leaves out the default stage 3), "-" for none."""
    label = options.label()
    if plan.shard > 1 and options.zero_stage == 3:
        label = f"zero3 {label}".strip()
    return label or "-"


def _human_s(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def plan_command(args) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..train.config import load_config
    from .search import rank_plans
    from .spec import spec_from_config
    from .systems import load_system

    if args.calibrate:
        from .calibrate import calibrate
        path = calibrate(out=args.calibrate_out, quick=args.quick)
        print(f"wrote {path}{_use_it(path)}")
        return 0
    if args.calibrate_from:
        return calibrate_from_command(args)
    if args.config and args.config.endswith(".py"):   # a script that calls exatrain.fit
        return _plan_script_command(args)
    if getattr(args, "script_args", []):
        from ..errors import ConfigError
        raise ConfigError(f"arguments after `--` ({' '.join(args.script_args)}) go to a Python "
                          f"script (`exatrain plan train.py --world N -- ARGS`), not to a "
                          f"config; set a config's keys with --set SECTION.KEY=VALUE")
    config = load_config(args.config, args.set or [])
    world = args.world or config.run.nproc
    if args.dry_run is not None:
        from .dryrun import dry_run
        plan = parse_plan(args.plan) if args.plan else config.plan.resolve(world)
        plan.validate(world)
        result = dry_run(config, plan, args.dry_run)
        _emit(result, args.json) if args.json else _print_dry_run(result)
        return 0
    console = Console(width=None if sys.stdout.isatty() else 160)
    system = load_system(args.system)
    spec = spec_from_config(config)
    base = options_from_config(config)
    if args.plan:   # one Plan: its prediction, and plan.py's and the model's verdicts
        measured = measured_run(args.run_dir) if args.run_dir else None
        return _one_plan(console, spec, parse_plan(args.plan), system, base, world, args.json,
                         explain=args.explain or bool(measured), measured=measured)
    import time
    t0 = time.perf_counter()
    ranking = rank_plans(spec, world, system, base)
    elapsed = time.perf_counter() - t0
    if args.json:
        _emit({"model": spec.name, "params": spec.params, "world": world, "system": system.name,
               "considered": ranking.considered, "seconds": elapsed,
               "ranked": [p.to_dict() for p in ranking.ranked],
               "refused": [r.to_dict() for r in ranking.refused]}, args.json)
        return 0
    table = Table(title=f"{spec.name} ({human_count(spec.params, 'params')}) on {world} ranks of "
                        f"{system.name}: {len(ranking.ranked)} of {ranking.considered} "
                        f"(Plan, options) fit, ranked by predicted step time")
    for col in ("#", "plan", "options", "step", "compute", "comm", "bubble", "memory/rank",
                "bytes per axis per step"):
        table.add_column(col, justify="right" if col in ("#", "step", "compute", "comm",
                                                         "bubble", "memory/rank") else "left")
    ties = tie_ranks(ranking.ranked[:args.top], step_error(system))
    for i, p in enumerate(ranking.ranked[:args.top], 1):
        table.add_row(ties[i - 1], str(p.plan).removeprefix("Plan(").removesuffix(")") or "serial",
                      _options_shown(p.plan, p.options), _human_s(p.step_s),
                      _human_s(p.parts_s["compute"]), _human_s(p.parts_s["comm_exposed"]),
                      _human_s(p.parts_s["bubble"]), _human_bytes(p.memory["total"]),
                      ", ".join(f"{a} {_human_bytes(b)}" for a, b in p.bytes_by_axis.items()))
    console.print(table)
    for line in honesty_notes(ranking.ranked[:args.top], system):
        console.print(line, highlight=False)
    counts = ranking.refusal_counts()
    console.print(f"considered {ranking.considered} in {elapsed:.2f} s; refused: " +
                  (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"))
    shown: dict[str, int] = {}
    seen_plans: set = set()
    for r in ranking.refused:
        if r.plan in seen_plans:   # its other option variants are refused for the same reason
            continue
        if shown.get(r.kind, 0) < args.why:
            seen_plans.add(r.plan)
            shown[r.kind] = shown.get(r.kind, 0) + 1
            opts = f" ({r.options.label()})" if r.options.label() else ""
            reason = r.reason.removeprefix(f"{r.plan}: ")
            console.print(f"  [bold]{r.kind}[/]: " + escape(f"{r.plan}{opts}: {reason}"),
                          highlight=False)
    return 0


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f} %"


def _use_it(path) -> str:
    """How the plan command names a system file it wrote."""
    from .systems import system_file
    named = system_file(path.stem).resolve() == path.resolve()
    return f" (plan with --system {path.stem if named else path})"


def calibrate_from_command(args) -> int:
    """`exatrain plan --calibrate-from BENCH.json ... --system SYSTEM` (`tune.devicefit`)."""
    from rich.console import Console
    from rich.table import Table

    from .devicefit import compare, read_bench, write_system
    from .systems import load_system
    if args.system == "cpu-local":
        raise ArgumentError("--calibrate-from: name the data-sheet system of the device the "
                            "bench ran on, e.g. --system h100-infiniband (cpu-local is "
                            "calibrated by --calibrate)")
    records, skipped = read_bench(args.calibrate_from)
    if not records:
        raise ArgumentError("--calibrate-from: none of the recorded cases is one the planner "
                            "knows: " + "; ".join(f"{c}: {why}" for c, why in skipped))
    system = load_system(args.system)
    result = compare(records, system)
    path = write_system(result, args.system, args.calibrate_out)
    if args.json:
        _emit({**{k: v for k, v in result.items() if k != "calibrated_system"},
               "skipped": dict(skipped), "wrote": str(path)}, args.json)
        return 0
    console = Console(width=None if sys.stdout.isatty() else 160)
    rows = result["rows"]
    devices = ", ".join(sorted({r["device"] for r in rows}))
    table = Table(title=f"one rank on {system.name}'s data sheet against {devices}")
    for col in ("case", "batch", "precision", "step predicted", "measured", "error",
                "memory predicted", "measured", "error"):
        table.add_column(col, justify="left" if col in ("case", "precision") else "right")
    for r in rows:
        mem = r["memory_measured_bytes"]
        table.add_row(f"{r['case']} ({r['model']})", str(r["batch"]),
                      r["precision"] + (" compile" if r["compile"] else ""),
                      _human_s(r["step_predicted_s"]), _human_s(r["step_measured_s"]),
                      _pct(r["step_error"]), _human_bytes(r["memory_predicted_bytes"]),
                      _human_bytes(mem) if mem else "not recorded", _pct(r["memory_error"]))
    console.print(table)
    mem = (f"{result['memory_mape']:.1f} % over {result['memory_cases']} case(s) with memory "
           "recorded" if result["memory_mape"] is not None else "none recorded")
    console.print(f"data sheet: step MAPE {result['step_mape']:.1f} % over {len(rows)} "
                  f"case(s); memory MAPE {mem}", highlight=False)
    for case, why in skipped:
        console.print(f"not predicted: {case}: {why}", highlight=False)
    console.print("fitted efficiency: " + ", ".join(
        f"{k} {result['efficiency_before'][k]:.3g} -> {result['efficiency_after'][k]:.3g}"
        for k in result["efficiency_after"]), highlight=False)
    after = Table(title=f"after the fit ({path.stem})")
    for col in ("case", "measured", "calibrated", "error", "held out", "error"):
        after.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        held = r["step_held_out_s"]
        after.add_row(r["case"], _human_s(r["step_measured_s"]), _human_s(r["step_calibrated_s"]),
                      _pct(r["step_calibrated_error"]),
                      _human_s(held) if held is not None else "-",
                      _pct(r["step_held_out_error"]))
    console.print(after)
    loo = (f"{result['step_mape_held_out']:.1f} % over {result['held_out_cases']} case(s)"
           if result["step_mape_held_out"] is not None else "none")
    console.print(f"calibrated: step MAPE {result['step_mape_calibrated']:.1f} % in-sample; "
                  f"leave-one-out {loo}", highlight=False)
    if result["not_held_out"]:
        console.print("not held out (the only case of its compute kind, fitted exactly): " +
                      ", ".join(result["not_held_out"]), highlight=False)
    console.print(f"wrote {path}{_use_it(path)}", highlight=False)
    return 0


def step_error(system) -> float:
    """The relative step-time error the model has been measured to make on `system` (its
    `[overheads] step_error`, written by `exatrain plan --calibrate`), else DEFAULT_ERROR."""
    return float(getattr(system, "overheads", {}).get("step_error", DEFAULT_ERROR))


DEFAULT_ERROR = 0.25   # where no calibration measured it: the roofline's error on small steps


def tie_ranks(ranked: list, error: float) -> list[str]:
    """Rank labels, fastest first; a Plan whose predicted step is within `error` of the best of
    its group's is labelled with the group's rank and '=' (a tie the model cannot break)."""
    labels, lead, lead_rank = [], None, 0
    for i, p in enumerate(ranked, 1):
        if lead is None or p.step_s > lead * (1 + error):
            lead, lead_rank = p.step_s, i
            labels.append(str(i))
        else:
            labels.append(f"{lead_rank}=")
            if labels[lead_rank - 1] == str(lead_rank):
                labels[lead_rank - 1] = f"{lead_rank}="
    return labels


def honesty_notes(ranked: list, system) -> list[str]:
    """What the ranking cannot tell: Plans within the model's measured error of the best, and
    the terms the system file has not calibrated (their cost counted as zero)."""
    from .overheads import LABELS, uncalibrated
    notes = []
    error = step_error(system)
    measured = "step_error" in getattr(system, "overheads", {})
    if ranked:
        close = [p for p in ranked if p.step_s <= ranked[0].step_s * (1 + error)]
        if len(close) > 1:
            notes.append(f"note: the first {len(close)} are within the model's "
                         f"{'measured' if measured else 'assumed'} error (±{100 * error:.0f} %) "
                         "of each other ('='): their order is not a prediction; measure them "
                         "(exatrain tune) before choosing.")
    missing = uncalibrated(system)
    if missing:
        notes.append(f"note: not calibrated on {system.name}, counted as 0: " +
                     "; ".join(LABELS[t] for t in missing) +
                     (". Run `exatrain plan --calibrate` on this machine." if
                      system.name == "cpu-local" else
                      " (on GPUs these mostly hide behind the kernels; small steps pay them)."))
    return notes


def measured_run(run_dir: str) -> dict:
    """Median step time and memory (state + peak activations) of a run's metrics.jsonl."""
    import statistics
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise MissingFileError(f"--run-dir {run_dir}: no metrics.jsonl there; give the "
                               "directory `exatrain run` wrote (runs/NAME-DATE)")
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    steps = [x for x in lines if "step_s" in x]
    if not steps:
        raise ArgumentError(f"--run-dir {run_dir}: metrics.jsonl has no step_s records yet")
    memory = [x.get("state_bytes", 0) + x.get("peak_activation_bytes", 0) for x in steps]
    return {"step_s": statistics.median(x["step_s"] for x in steps),
            "memory_bytes": max(memory), "records": len(steps), "run_dir": str(run_dir)}


def explain_lines(pred, system) -> list[str]:
    """The cost breakdown of one prediction: one line per term, with its count and cost."""
    from .overheads import COST_KEYS, LABELS, TERMS
    parts = pred.parts_s
    table = getattr(system, "overheads", {})
    lines = [f"    {'compute (FLOPs / calibrated rate)':<52}{_human_s(parts['compute']):>10}",
             f"    {'communication exposed (bytes / β + α per step)':<52}"
             f"{_human_s(parts['comm_exposed']):>10}",
             f"    {'memory traffic (bytes / elementwise bandwidth)':<52}"
             f"{_human_s(parts.get('memory_traffic', 0.0)):>10}",
             f"    {'pipeline bubble':<52}{_human_s(parts['bubble']):>10}",
             f"    {'optimizer (state streamed through memory)':<52}"
             f"{_human_s(parts['optimizer']):>10}"]
    for term in TERMS:
        key = COST_KEYS[term]
        how = (f"{pred.calls.get(term, 0):,.0f} × {_human_s(table[key])}" if key in table
               else f"{pred.calls.get(term, 0):,.0f} × ? (not calibrated: 0)")
        lines.append(f"    {LABELS[term]:<52}{_human_s(parts.get(term, 0.0)):>10}   {how}")
    return lines


def _one_plan(console, spec, plan: Plan, system, options: Options, world: int, json_out,
              explain: bool = False, measured: dict | None = None) -> int:
    from .cost import predict
    from .search import shape_problem
    verdicts = []
    try:
        plan.validate(world)
        plan.require_implemented()
    except PlanError as exc:
        verdicts.append(f"plan rule: {exc}")
    problem = shape_problem(spec, plan, options)
    if problem:
        verdicts.append(f"{problem[0]}: {problem[1]}")
    pred = predict(spec, plan, system, options, world)
    if pred.memory["total"] > system.usable_memory:
        verdicts.append(f"out of memory: needs {_human_bytes(pred.memory['total'])} per rank")
    out = {**pred.to_dict(), "valid": not verdicts, "refused_because": verdicts,
           "calls": pred.calls, "step_error": step_error(system)}
    if measured:
        out["measured"] = measured
    if json_out:
        _emit(out, json_out)
        return 0
    console.print(f"[bold]{plan}[/] on {world} ranks of {system.name}: "
                  f"{'valid' if not verdicts else 'REFUSED'}", highlight=False)
    for v in verdicts:
        console.print(f"  {v}", highlight=False)
    console.print(f"  step {_human_s(pred.step_s)} = " + " + ".join(
        f"{k} {_human_s(v)}" for k, v in pred.parts_s.items() if v), highlight=False)
    if explain:
        for line in explain_lines(pred, system):
            console.print(line, highlight=False)
    if measured:
        console.print(f"  measured step {_human_s(measured['step_s'])} (median of "
                      f"{measured['records']} records of {measured['run_dir']}): predicted "
                      f"{100 * (pred.step_s / measured['step_s'] - 1):+.0f} %; the model's "
                      f"error on {system.name}: ±{100 * step_error(system):.0f} %",
                      highlight=False)
    console.print("  memory/rank " + ", ".join(f"{k} {_human_bytes(v)}"
                                               for k, v in pred.memory.items()), highlight=False)
    if measured and measured["memory_bytes"]:
        console.print(f"  measured memory/rank {_human_bytes(measured['memory_bytes'])} (state + "
                      f"peak activations): predicted "
                      f"{100 * (pred.memory['total'] / measured['memory_bytes'] - 1):+.0f} %",
                      highlight=False)
    console.print("  bytes/step " + ", ".join(f"{a} {_human_bytes(b)}"
                                             for a, b in pred.bytes_by_axis.items()),
                  highlight=False)
    if explain:
        for line in honesty_notes([], system):
            console.print(line, highlight=False)
    return 0


def _emit(data: dict, where: str) -> None:
    text = json.dumps(data, indent=1, default=str)
    if where == "-":
        sys.stdout.write(text + "\n")
    else:
        Path(where).parent.mkdir(parents=True, exist_ok=True)
        Path(where).write_text(text)


def _print_dry_run(r: dict) -> None:
    from rich.console import Console
    console = Console()
    console.print(f"[bold]dry run[/]: rank {r['rank']} of {r['world']} under {r['plan']}, "
                  f"coords {r['coords']}")
    console.print(f"input {r['input_shape']} ({r['samples_per_rank']} samples per rank), "
                  f"{r['params_local']:,} parameters on this rank")
    for name, shape in r["param_shapes"].items():
        console.print(f"  {name:<48} {shape}", highlight=False)
    s = r["state_bytes"]
    console.print(f"state {_human_bytes(s['total'])} (params {_human_bytes(s['params'])}, grads "
                  f"{_human_bytes(s['grads'])}, optimizer {_human_bytes(s['optimizer'])}); "
                  f"step peak {_human_bytes(r['step_peak_bytes'])}")
    console.print("ledger: " + ", ".join(f"{a} {_human_bytes(b)}"
                                         for a, b in r["ledger_bytes"].items()))
    for note in r["notes"]:
        console.print(f"note: {note}")


def tune_command(args) -> int:
    from ..train.config import load_config
    from .tuner import tune_config

    config = load_config(args.config, args.set or [])
    world = args.world or config.run.nproc
    report = tune_config(config, world, args.budget, system=args.system, steps=args.steps,
                         prior_paths=args.prior or [], record=args.record)
    if args.json:
        _emit(report, args.json)
    print(json.dumps({k: v for k, v in report.items() if k != "trials"}, indent=1, default=str))
    return 0


def _plan_script_command(args) -> int:
    """`exatrain plan SCRIPT.py --world N`: the script runs in this process up to its first
    et.fit call, which predicts (`train.fit.plan_script`, `et.plans`) instead of training."""
    from ..errors import ConfigError
    from ..train.fit import plan_script
    if not args.world:
        raise ConfigError("exatrain plan SCRIPT.py needs --world N (the ranks to plan for).")
    if args.plan or args.dry_run is not None or args.set:
        raise ConfigError("exatrain plan SCRIPT.py: --plan, --dry-run and --set are for configs; "
                          "the script's own et.fit sections are used.")
    from .user import plans
    result = plan_script(args.config, args.world, plans, args.system,
                         argv=getattr(args, "script_args", []))
    if args.json:
        _emit(result, args.json)
        return 0
    print(f"{result['model']} (sample {result['sample_shape']}, batch {result['batch']}, "
          f"{result['optimizer']}, {result['precision']}) on {result['world']} ranks of "
          f"{result['system']}: {len(result['ranked'])} Plans, fastest first")
    for p in result["ranked"][:args.top]:
        print(f"  {p['plan']:<28} {p['options'] or '-':<12} step {p['step_s'] * 1e3:9.2f} ms  "
              f"memory/rank {p['memory_per_rank']['total'] / 2 ** 20:9.1f} MiB")
    for r in result["refused"][:args.why]:
        print(f"  refused {r.get('plan', '')}: {r.get('reason', '')}")
    return 0


def add_parsers(sub) -> None:
    plan = sub.add_parser("plan", help="every valid Plan ranked by predicted step time; "
                                       "--dry-run RANK, --calibrate")
    plan.add_argument("config", nargs="?", help="TOML config (examples/*.toml; none: the built-in "
                                                "CosmoFlow example, changed with --set), or a "
                                                "script calling exatrain.fit (needs --world)")
    plan.add_argument("--world", type=int, default=0, help="ranks (default: run.nproc)")
    plan.add_argument("--system", default="cpu-local", help="system name or TOML path")
    plan.add_argument("--json", nargs="?", const="-", metavar="PATH",
                      help="write everything as JSON (to stdout without PATH)")
    plan.add_argument("--top", type=int, default=20, help="ranked Plans to print")
    plan.add_argument("--why", type=int, default=2, help="refused examples to print per reason")
    plan.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    plan.add_argument("--plan", help="one Plan, e.g. data=32,shard=4,tensor=8: its prediction "
                                     "and verdicts; with --dry-run the Plan to run (default: "
                                     "the config's [plan] at --world)")
    plan.add_argument("--dry-run", type=int, metavar="RANK", help="run one step of RANK over the "
                                                                  "fake process group")
    plan.add_argument("--explain", action="store_true", help="with --plan: the step's cost "
                      "term by term (count × calibrated cost per call)")
    plan.add_argument("--run-dir", default="", help="with --plan: a run directory of that Plan; "
                      "its measured step and memory are printed beside the prediction")
    plan.add_argument("--calibrate", action="store_true", help="measure this machine into a "
                                                               "system file")
    plan.add_argument("--calibrate-out", default="", help="system file to write (default: "
                      "cpu-local.toml, with --calibrate-from SYSTEM-measured.toml, in your "
                      "systems folder: $EXATRAIN_SYSTEMS_DIR or ~/.config/exatrain/systems, "
                      "where --system NAME finds it)")
    plan.add_argument("--calibrate-from", nargs="+", metavar="BENCH_JSON", help="`exatrain "
                      "bench device` JSON files: predict their one-GPU cases on --system, set "
                      "prediction beside measurement, fit the system's compute efficiency to "
                      "them and write the calibrated system file")
    plan.add_argument("--quick", action="store_true", help="calibrate with fewer repetitions")
    plan.set_defaults(func=plan_command)

    tune = sub.add_parser("tune", help="measure at most --budget Plans, surrogate on the cost "
                                       "model's residuals, return the best")
    tune.add_argument("config", nargs="?", help="TOML config (none: the built-in example, "
                                                "changed with --set)")
    tune.add_argument("--world", type=int, default=0)
    tune.add_argument("--budget", type=int, default=4, help="Plans to measure at most")
    tune.add_argument("--steps", type=int, default=3, help="timed steps per measured Plan")
    tune.add_argument("--system", default="cpu-local")
    tune.add_argument("--prior", action="append", metavar="JSON", help="measurements of a "
                      "smaller world or a sibling model (a --record file), reused as a prior")
    tune.add_argument("--record", default="", help="write this run's measurements here")
    tune.add_argument("--json", nargs="?", const="-", metavar="PATH")
    tune.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    tune.set_defaults(func=tune_command)
