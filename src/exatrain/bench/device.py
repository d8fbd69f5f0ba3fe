"""`exatrain bench device`: each workload on one device, a best-practice plain-PyTorch loop beside exatrain.

For every case (CosmoFlow 128³ as MLPerf HPC defines it, DeepCAM on a crop, the SC23 tutorial's
ViT forecaster, GPT at the 125m and at the 1.3b shape; `bench.device_cases`), in one launch:

  baseline   plain PyTorch written for the bench (`bench.device_baseline`): the same model and
             initial weights, the same batches in the same order, autocast (bf16 on a GPU),
             channels-last, cudnn.benchmark, fused AdamW, torch.compile, SDPA
  exatrain   `exatrain run`'s Trainer on the same config, one process (no run directory:
             nothing is checkpointed), at exatrain's own defaults plus parallel.precision and
             parallel.compile as the baseline's
  alt        (--alt-set key=value) exatrain's path once more with other settings (CUDA graphs,
             say), beside the same baseline and exatrain: `<case>_alt_vs_exatrain` (speed-up),
             `<case>_alt_loss_rel_diff` (`tail_loss_rel_diff`: the last steps' mean losses)
  levers     (--levers all) the plain loop with one lever at a time: bf16, fp16, compile,
             cuda_graphs, foreach, fused, sdpa, fp8; and `plain` with none. A lever the device
             cannot pull is refused with the reason (`<case>_<lever>_refused`).

Figures per case and variant (`<case>_<variant>_<figure>`): samples_per_s (and tokens_per_s for
GPT), step_s_median (median of the timed steps after --warmup), mfu_peak (model FLOP/s over the
datasheet dense peak of the device in the step's dtype, `bench.device_peaks`; None on a CPU),
mfu_measured (over the matmul rate measured on this device in that dtype), peak_memory_bytes,
data_wait_fraction, losses (every step's, warm-up included); exatrain's compiled_graphs and
graph_breaks (with their reasons) under compile; with --profile, host_syncs_per_step,
compiled_share and profile_table (the path of its top-kernels table; `bench.device_profile`).
Step times are CUDA timing events on a GPU in both paths (neither waits for the device per
step). Per case: vs_baseline (exatrain /
baseline throughput), loss_max_rel_diff (largest relative difference of the two paths' step
losses: the check that they train the same model on the same batches), the published figure
(published_value, published_unit, published_source) and, at --sizes full, vs_published.

With --rounds R (3 by default at --sizes small) each path runs R times, alternately, the first
in turn (exatrain, baseline; baseline, exatrain; ...), each round from the same initial weights on
the same batches: a machine whose speed drifts during the launch (other tenants, the scheduler's
placement of threads) then slows both paths alike. vs_baseline is the median of the R paired
ratios (`vs_baseline_rounds` lists them); a path's step_s_median and data_wait_fraction are the
medians of its rounds'; losses, memory and compile figures are its first round's.

--sizes small shrinks every model so that the whole harness runs on a CPU in seconds (the
harness check of tests/test_bench_device.py); --sizes full is for one GPU (scripts/gpu-figures.sh).
"""

from __future__ import annotations

import copy
import gc
import statistics
import tempfile
import time

import torch


def add_arguments(parser) -> None:
    parser.add_argument("--sizes", choices=("small", "full"), default="full",
                        help="full: realistic shapes for one GPU; small: tiny shapes, a CPU check")
    parser.add_argument("--cases", default="all",
                        help="comma-separated: cosmoflow,deepcam,vit,gpt_125m,gpt_1b (default all)")
    parser.add_argument("--levers", default="none",
                        help="'all', 'none' or a comma-separated list of levers to measure one "
                             "at a time (bf16,fp16,compile,cuda_graphs,foreach,fused,sdpa,fp8)")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16", "fp8"),
                        default="auto",
                        help="of the baseline and exatrain (auto: bf16 on a GPU, fp32 on a CPU)")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave torch.compile out of the baseline and exatrain")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of both paths and the levers")
    parser.add_argument("--workers", type=int, default=-1,
                        help="loader workers of both paths (-1: each path's default)")
    parser.add_argument("--profile", action="store_true",
                        help="profile --profile-steps more steps of each path after the timed "
                             "ones: top kernels (a table beside the JSON), host syncs per step, "
                             "the share of compiled code")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps each profile covers")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="section.key=value for exatrain's path (repeatable): a setting's "
                             "effect, side by side with the same baseline")
    parser.add_argument("--alt-set", dest="alt_sets", action="append", default=[],
                        help="section.key=value (repeatable): exatrain's path once more with "
                             "these settings on top of --set, as variant `alt`, beside the "
                             "same baseline and exatrain (`<case>_alt_vs_exatrain`)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="exatrain's path alone (step time and memory for the planner's "
                             "check): no baseline, so no vs_baseline")
    parser.add_argument("--rounds", type=int, default=0,
                        help="baseline and exatrain run this many times each, alternately, on "
                             "the same data (0: 3 at --sizes small, 1 at full); vs_baseline is "
                             "the median of the rounds' ratios")
    parser.add_argument("--prepare-only", action="store_true",
                        help="write the chosen cases' data sets into --data-dir and stop (on a "
                             "GPU machine: while another case trains)")
    parser.add_argument("--data-dir", default="",
                        help="where the data sets are written once and reused (default: a "
                             "temporary directory)")


def _variants(levers: str) -> dict:
    from .device_baseline import LEVERS, PLAIN
    if levers == "none":
        return {}
    names = list(LEVERS) if levers == "all" else [v.strip() for v in levers.split(",") if v.strip()]
    unknown = [n for n in names if n not in LEVERS]
    if unknown:
        raise ValueError(f"--levers: unknown {', '.join(unknown)}; choose from {', '.join(LEVERS)}, "
                         "'all' or 'none'.")
    return {"plain": PLAIN, **{n: LEVERS[n] for n in names}}


def _figures(run: dict, batch: int, flops_per_sample: float, tokens: int, peak, measured) -> dict:
    out = {"samples_per_s": batch / run["step_s_median"], **run}
    if tokens:
        out["tokens_per_s"] = out["samples_per_s"] * tokens
    model_flops = flops_per_sample * out["samples_per_s"]
    out["mfu_peak"] = model_flops / peak if peak else None
    out["mfu_measured"] = model_flops / measured if measured else None
    return out


def _exatrain(config, mesh, workload, warmup: int, steps: int, window=None) -> dict:
    """`exatrain run`'s path on one process: parallelize, Trainer, fit (no run directory), one
    log record at the end (every step's loss and time are in it: nothing is read per step);
    `window` profiles the steps after the timed ones."""
    from ..parallel import parallelize
    from ..train.trainer import Trainer
    model = parallelize(workload.model, mesh, config.parallel,
                        **workload.spatial_io())
    workload.model = model
    # `window`, when given, is stepped after every step and stopped at the end
    trainer = Trainer(mesh, workload, config, model, run_dir=None, profiler=window)
    summary = trainer.fit()
    n = warmup + steps
    times, waits = trainer.step_times[:n], trainer.step_waits[:n]
    losses = [loss for r in trainer.history for loss in r.get("step_losses", [])][:n]
    timed = slice(warmup, n) if n > warmup else slice(0, n)
    out = {"losses": losses, "step_s_median": statistics.median(times[timed]),
           "data_wait_fraction": statistics.median(w / t for w, t in zip(waits[timed],
                                                                         times[timed])),
           "peak_memory_bytes": summary["memory_per_rank"][0]["peak_mem_bytes"],
           "peak_memory_source": "cuda_max_allocated" if mesh.device.type == "cuda"
           else "process_peak_rss"}
    for key in ("compiled_graphs", "graph_breaks", "graph_break_reasons"):
        if key in summary:
            out[key] = summary[key]
    return out


def _pooled(runs: list[dict]) -> dict:
    """One path's rounds as one: the medians of the rounds' step times and input waits, the
    largest peak memory; losses and everything else from the first round."""
    out = dict(runs[0])
    out["step_s_median"] = statistics.median(r["step_s_median"] for r in runs)
    out["data_wait_fraction"] = statistics.median(r["data_wait_fraction"] for r in runs)
    out["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in runs)
    return out


def _progress(case: str, variant: str, figures: dict) -> None:
    """One line per finished path on stderr, so a cut run still says what it measured."""
    import sys
    print(f"bench device: {case} {variant}: {figures['samples_per_s']:.4g} samples/s, step "
          f"{figures['step_s_median'] * 1e3:.2f} ms, input wait "
          f"{figures['data_wait_fraction']:.1%}", file=sys.stderr, flush=True)


def _phase(case: str, what: str, since: float) -> None:
    """A line per phase before the first timed path (data, model), so a cut run says where."""
    import sys
    print(f"bench device: {case}: {what} after {time.perf_counter() - since:.1f} s",
          file=sys.stderr, flush=True)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _config(case, args, data_root: str, device: torch.device, precision: str):
    """The case's `exatrain run` config (and its override list, for variants of it)."""
    from ..train.config import load_config
    from .device_cases import COMMON, data_path
    warmup, steps = args.warmup, args.steps or (50 if args.sizes == "small" else 20)
    extra = args.profile_steps if args.profile else 0
    sets = {**COMMON, **case.sets, **case.data_sets, "run.workload": case.workload,
            "data.path": data_path(data_root, case), "train.steps": warmup + steps + extra,
            "train.log_every": warmup + steps + extra,
            "parallel.precision": precision, "parallel.compile": not args.no_compile,
            "parallel.compile_backend": args.compile_backend, "plan.data": 1,
            "run.nproc": 1, "run.backend": "nccl" if device.type == "cuda" else "gloo"}
    if args.workers >= 0:
        sets["train.num_workers"] = args.workers
    overrides = [f"{k}={_toml(v)}" for k, v in sets.items()] + list(getattr(args, "overrides", []))
    return load_config(None, overrides), overrides


def run_case(case, args, data_root: str, device: torch.device, precision: str) -> dict:
    """Baseline, exatrain and the levers of one case; returns its flat figures."""
    from ..mesh import init
    from ..observe.matmul_rate import measured_matmul_flops_cached
    from ..parallel.precision import DTYPES
    from ..plan import Plan
    from ..train.config import load_config
    from ..workloads import get_workload
    from .device_baseline import best_practice, default_workers, notes, refusal, train_plain
    from .device_cases import plain_loss
    from .device_peaks import datasheet_peak_flops
    from .device_profile import Window, write_table

    warmup, steps = args.warmup, args.steps or (50 if args.sizes == "small" else 20)
    compile = not args.no_compile
    extra = args.profile_steps if args.profile else 0
    config, overrides = _config(case, args, data_root, device, precision)
    alt_sets = list(getattr(args, "alt_sets", []))
    alt_config = load_config(None, overrides + alt_sets) if alt_sets else None
    module = get_workload(case.workload)
    started = time.perf_counter()
    module.prepare(config)
    _phase(case.name, "data ready", started)
    batch, optim = config.train.batch_size, config.optim
    mesh = init(Plan(data=1), backend=None if config.run.backend == "auto" else config.run.backend)
    try:
        torch.manual_seed(config.run.seed)
        workload = module.build(config, mesh)
        plain_model = copy.deepcopy(workload.model)  # the weights both paths start from
        _phase(case.name, "model built", started)
        flops, tokens = workload.flops_per_sample, workload.tokens_per_sample
        loss_fn, decode = plain_loss(case, workload, config), workload.decode
        train_set = workload.train_set

        def figures(run, levers_precision):
            # MFU against the peak and the measured matmul rate of the precision that run
            # trained in (fp8 has no matmul of its own to time: its measured rate is bf16's)
            dtype = DTYPES.get(levers_precision, torch.bfloat16)
            return {**_figures(run, batch, flops, tokens,
                               datasheet_peak_flops(device, levers_precision),
                               measured_matmul_flops_cached(device, dtype)),
                    "precision": levers_precision}

        workers = args.workers if args.workers >= 0 else default_workers()
        baseline = best_practice(precision, compile)
        built = [workload]  # the first round trains the workload built above
        del workload
        profiles: dict = {}

        def exatrain_round(first: bool) -> dict:
            if built:
                wl = built.pop()
            else:  # the same initial weights as the first round's (and the baseline's)
                torch.manual_seed(config.run.seed)
                wl = module.build(config, mesh)
            window = Window(device, warmup + steps, extra) if extra and first else None
            run = _exatrain(config, mesh, wl, warmup, steps, window)
            if window:
                profiles["exatrain"] = window
            del wl
            _free(device)
            return run

        def baseline_round(first: bool) -> dict:
            window = Window(device, warmup + steps, extra) if extra and first else None
            run = train_plain(plain_model, train_set, loss_fn, decode, baseline, device, optim,
                              batch, warmup, steps, config.run.seed, workers, args.compile_backend,
                              window)
            if window:
                profiles["baseline"] = window
            _free(device)
            return run

        rounds = args.rounds or (3 if args.sizes == "small" else 1)
        paths = {"exatrain": exatrain_round, "baseline": baseline_round}
        if getattr(args, "no_baseline", False):
            del paths["baseline"]
        done: dict[str, list[dict]] = {name: [] for name in paths}
        for r in range(rounds):
            for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                done[name].append(paths[name](r == 0))
                label = name + (f" (round {r + 1} of {rounds})" if rounds > 1 else "")
                _progress(case.name, label, figures(done[name][-1], precision))
        results = {name: figures(_pooled(runs), precision) for name, runs in done.items()}
        ratios = [b["step_s_median"] / e["step_s_median"]
                  for e, b in zip(done["exatrain"], done.get("baseline", []))]
        if alt_config is not None:  # the same initial weights and batches, other settings
            torch.manual_seed(config.run.seed)
            try:
                alt = _exatrain(alt_config, mesh, module.build(alt_config, mesh), warmup, steps)
                results["alt"] = {**figures(alt, alt_config.parallel.precision),
                                  "settings": alt_sets}
                _progress(case.name, "alt", results["alt"])
            except Exception as e:  # noqa: BLE001 - a refused variant keeps the case's figures
                results["alt"] = {"settings": alt_sets, "refused": f"{type(e).__name__}: {e}"}
            _free(device)
        note = notes(baseline, device, plain_model)
        if note and "baseline" in results:
            results["baseline"]["note"] = note
        runs = _variants(args.levers)
        for name, levers in runs.items():
            refused = refusal(levers, device, plain_model)
            if refused:
                results[name] = {"refused": refused}
                continue
            window = Window(device, warmup + steps, extra) if extra else None
            run = train_plain(plain_model, train_set, loss_fn, decode, levers, device, optim,
                              batch, warmup, steps, config.run.seed, workers, args.compile_backend,
                              window)
            results[name] = figures(run, levers.precision)
            _progress(case.name, name, results[name])
            if window:
                profiles[name] = window
            if notes(levers, device, plain_model):
                results[name]["note"] = notes(levers, device, plain_model)
            _free(device)
    finally:
        mesh.close()
    for variant, window in profiles.items():
        figs, table = window.figures()
        results[variant].update(figs, profile_table=write_table(args.json, case.name, variant,
                                                                 table))
    out = {f"{case.name}_{variant}_{key}": value for variant, figs in results.items()
           for key, value in figs.items()}
    base, ours = results.get("baseline"), results["exatrain"]
    out[f"{case.name}_vs_baseline"] = statistics.median(ratios) if ratios else None
    out[f"{case.name}_vs_baseline_rounds"] = ratios
    if "step_s_median" in results.get("alt", {}):
        out[f"{case.name}_alt_vs_exatrain"] = (ours["step_s_median"]
                                              / results["alt"]["step_s_median"])
        out[f"{case.name}_alt_loss_rel_diff"] = tail_loss_rel_diff(results["alt"]["losses"],
                                                                   ours["losses"])
    out[f"{case.name}_loss_max_rel_diff"] = max(
        abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours["losses"], base["losses"])) \
        if base else None
    plain = results.get("plain")
    for name, figs in results.items():
        if plain and "samples_per_s" in figs and name not in ("plain", "exatrain"):
            out[f"{case.name}_{name}_speedup_vs_plain"] = figs["samples_per_s"] / plain["samples_per_s"]
    out.update(_published(case, results, args.sizes == "full"))
    out[f"{case.name}_batch"] = batch
    out[f"{case.name}_sets"] = _sets(getattr(args, "overrides", []))  # what --set changed
    out[f"{case.name}_params"] = sum(p.numel() for p in plain_model.parameters())
    return out


def tail_loss_rel_diff(losses: list[float], reference: list[float], tail: int = 20) -> float:
    """|mean of the last `tail` losses − the reference's| / the reference's. Two runs of the same
    weights and batches in other arithmetic (fp8 beside bf16) part step by step within the loss's
    noise, so a step-by-step maximum grows with the run; the means of the last steps are what
    says whether the variant trains as well (`docs/how-to/gpu-bench.md` states the tolerance)."""
    k = max(1, min(tail, len(losses) // 2, len(reference) // 2))
    ours, ref = statistics.fmean(losses[-k:]), statistics.fmean(reference[-k:])
    return abs(ours - ref) / max(abs(ref), 1e-12)


def _published(case, results: dict, full: bool) -> dict:
    pub = case.published
    if pub is None:  # nothing published to set it beside (device_cases: why)
        return {**{f"{case.name}_{k}": None for k in ("published_value", "published_unit",
                                                      "published_source", "vs_published")},
                f"{case.name}_unpublished": case.unpublished}
    out = {f"{case.name}_published_value": pub.value, f"{case.name}_published_unit": pub.unit,
           f"{case.name}_published_source": pub.source}
    if case.differences:
        out[f"{case.name}_published_differences"] = list(case.differences)
    ours = results["exatrain"]
    if pub.unit == "speedup_vs_plain":
        mine = (results["baseline"]["samples_per_s"] / results["plain"]["samples_per_s"]
                if "samples_per_s" in results.get("plain", {}) and "baseline" in results
                else None)
    else:
        mine = ours.get(pub.unit)
    out[f"{case.name}_vs_published"] = mine / pub.value if (full and mine) else None
    return out


def _sets(overrides: list[str]) -> dict:
    """--set's section.key=value strings as a table of parsed values (the planner reads them:
    `exatrain plan --calibrate-from`)."""
    import tomllib
    return {key.strip(): tomllib.loads(f"v = {raw}")["v"]
            for key, raw in (o.split("=", 1) for o in overrides)}


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def run(args) -> dict:
    from ..workloads import get_workload
    from .device_cases import cases
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = args.precision if args.precision != "auto" else \
        ("bf16" if device.type == "cuda" else "fp32")
    chosen = cases(args.sizes)
    _variants(args.levers)  # an unknown lever is refused before any data is written
    if args.cases != "all":
        names = [c.strip() for c in args.cases.split(",")]
        unknown = set(names) - {c.name for c in chosen}
        if unknown:
            raise ValueError(f"--cases: unknown {', '.join(sorted(unknown))}; choose from "
                             f"{', '.join(c.name for c in chosen)}.")
        chosen = [c for c in chosen if c.name in names]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "sizes": args.sizes, "precision": precision, "compile": not args.no_compile,
              "torch": torch.__version__, "cases": ",".join(c.name for c in chosen)}
    if getattr(args, "prepare_only", False):
        if not args.data_dir:
            raise ValueError("--prepare-only writes the data sets for a later run: give --data-dir.")
        for case in chosen:
            started = time.perf_counter()
            config, _ = _config(case, args, args.data_dir, device, precision)
            get_workload(case.workload).prepare(config)
            _phase(case.name, "data ready", started)
        return {**result, "prepared": result["cases"]}
    with tempfile.TemporaryDirectory(prefix="exatrain-bench-device-") as tmp:
        for case in chosen:
            result.update(run_case(case, args, args.data_dir or tmp, device, precision))
    return result
