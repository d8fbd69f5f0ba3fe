"""`exatrain bench kfac`: K-FAC against AdamW (and SGD), and sub-graph parallelism against data.

Part 1, optimizers (2 ranks, Plan(data=2), the same global batch, seeds and data for all): on the
CosmoFlow job (the default job's model and data at `--size`, 32 = the default job) and on a
residual 3D CNN on the same data, each optimizer of `--optimizers` trains up to `--steps` steps
(2,000, the default job's) with an evaluation every `--eval-every`, stopping at the target. With
no arguments they are what a user gets: `kfac` and `adamw` at the config's defaults (K-FAC's
defaults are its best measured recipe), and `adamw_tuned`, AdamW at its tuned `--lr-adamw-tuned`;
`sgd` on request. An `--lr-*` or `--kfac-*` option given replaces that default. Figures per
workload W and optimizer O:

  W_O_steps_to_target     first evaluated step with val_mae ≤ 0.5 × baseline_mae (the MAE of
                          predicting the training mean; `--target-fraction`), None if not
                          reached; W_O_best_val_mae beside it
  W_O_seconds_to_target   training seconds to that step (the step times the Trainer logged,
                          evaluations excluded)
                          With `--seeds N` every optimizer runs N times (run.seed F..F+N-1,
                          F = `--first-seed`, seed by seed in turn) and both are the median
                          run's (the lower of the middle two for even N; a run that never
                          reached the target counts as the slowest); `..._per_seed` lists them,
                          W_O_curves holds every run's (step, seconds, val_mae), `--plot` draws
                          them. `--stop-at-target` ends a run there (the schedule still spans
                          `--steps`).
  W_O_step_s              median step time
  W_kfac_step_overhead    K-FAC step time / the first-order (SGD) step time, with sgd run
  W_kfac_vs_adamw_seconds K-FAC's seconds to target / AdamW's (< 1: K-FAC faster);
                          W_kfac_vs_adamw_tuned_seconds the same against the tuned AdamW
  W_kfac_vs_adamw_p_value with `--seeds N`: the exact two-sided rank-sum (Mann-Whitney) p-value
                          of the two optimizers' seconds to target per seed (small: the
                          difference is more than the spread between seeds); also _tuned
  W_kfac_step_over_adamw  K-FAC's step time / AdamW's (also _tuned)
  W_kfac_reached_every_seed  whether every K-FAC run reached the target; `kfac_settings` the
                          optim.kfac_* values it ran with
  W_kfac_bytes_per_step   the K-FAC collectives the ledger counted, per step
  W_kfac_preconditioned_steps, W_kfac_decompositions  the first seed's steps K-FAC
                          preconditioned and the factor refreshes it ran (steps / inverse_every
                          when it did all its work)

and `second_order_bytes_per_rank_f<f>`: the largest K-FAC state any rank holds, for every
grad_worker_fraction f the 2 ranks allow (1/2: memory-optimal, 1: communication-optimal), counted
from its tensors (`KFAC.memory_bytes`), with `..._formula` from the module doc beside it.

Part 2, sub-graph parallelism (2 ranks, `--parts branches`): DeepCAM under Plan(data=2) beside
parallel.branches = "data", against the serial model; its figures are in `bench.kfac_branches`.
The plot (`--plot`) is `bench.kfac_plot`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from .kfac_branches import branch_figures


def add_arguments(parser) -> None:
    """With no arguments the bench runs what a user gets: the default job (CosmoFlow 32³, 4,608
    samples, global batch 8 on 2 ranks, 2,000 steps, each run stopped at the target), every
    optimizer at the config's defaults, beside AdamW at its tuned learning rate, 3 seeds. Each
    K-FAC option below, when given, replaces that key's default for the run."""
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--target-fraction", type=float, default=0.5,
                        help="target val_mae = this x the predict-the-mean baseline")
    parser.add_argument("--batch", type=int, default=8, help="global batch (both ranks)")
    parser.add_argument("--samples", type=int, default=4608, help="CosmoFlow samples to write")
    parser.add_argument("--lr-adamw", type=float, default=None,
                        help="AdamW's lr (default: optim.lr's default)")
    parser.add_argument("--lr-adamw-tuned", type=float, default=2e-4,
                        help="the lr of `adamw_tuned`: AdamW's fastest on the default job")
    parser.add_argument("--lr-sgd", type=float, default=None)
    parser.add_argument("--lr-kfac", type=float, default=None)
    parser.add_argument("--kfac-factor-every", type=int, default=None)
    parser.add_argument("--kfac-inverse-every", type=int, default=None)
    parser.add_argument("--kfac-damping", type=float, default=None)
    parser.add_argument("--kfac-kl-clip", type=float, default=None)
    parser.add_argument("--kfac-inverse", default=None, help="eigen or cholesky")
    parser.add_argument("--kfac-base", default=None, help="sgd or adamw: K-FAC's update")
    parser.add_argument("--kfac-factor-positions", type=int, default=None,
                        help="a conv's A from at most this many positions per sample (0: all)")
    parser.add_argument("--kfac-grad-worker-fraction", type=float, default=None)
    parser.add_argument("--workloads", default="cosmoflow,resnet")
    parser.add_argument("--optimizers", default="kfac,adamw,adamw_tuned",
                        help="which to train: kfac, adamw, sgd, adamw_tuned (AdamW at "
                             "--lr-adamw-tuned); K-FAC's ratios need kfac and the other")
    parser.add_argument("--deepcam-size", type=int, default=64)
    parser.add_argument("--deepcam-width", type=int, default=16)
    parser.add_argument("--deepcam-steps", type=int, default=10)
    parser.add_argument("--parts", default="optim,memory,branches")
    parser.add_argument("--stop-at-target", action=argparse.BooleanOptionalAction, default=True,
                        help="end each run at its first evaluation that reaches the target "
                             "(train.target; the schedule still spans --steps)")
    parser.add_argument("--data-dir", default="",
                        help="CosmoFlow files to reuse (written there if missing); default: a "
                             "temporary directory")
    parser.add_argument("--seeds", type=int, default=3,
                        help="runs per optimizer (run.seed 0..N-1: init and sample order); "
                             "the median run's steps and seconds to target are reported")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="run.seed of the first run (seeds F..F+N-1): extend an earlier "
                             "sweep; a seed's steps to target do not depend on the launch")
    parser.add_argument("--plot", default="",
                        help="PNG of every run's val_mae against its training seconds")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="section.key=value for every run (repeatable)")


# ---------------------------------------------------------------------- the residual CNN task
@dataclass
class ResNetData:
    path: str = ""


class _Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv3d(c, c, 3, padding=1)
        self.conv2 = nn.Conv3d(c, c, 3, padding=1)
        self.act = nn.LeakyReLU(0.3)

    def forward(self, x):
        return self.act(x + self.conv2(self.act(self.conv1(x))))


class ResidualCNN(nn.Module):
    """Stem, then (residual block, 2x down-sampling convolution) per level, pooled, linear head."""

    def __init__(self, in_channels: int = 4, channels: int = 16, levels: int = 3, outputs: int = 4):
        super().__init__()
        layers = [nn.Conv3d(in_channels, channels, 3, padding=1), nn.LeakyReLU(0.3)]
        for _ in range(levels):
            layers += [_Block(channels), nn.Conv3d(channels, channels, 2, stride=2),
                       nn.LeakyReLU(0.3)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(channels, outputs))

    def forward(self, x):
        return self.head(self.features(x))


def build_resnet(data: ResNetData = ResNetData(), channels: int = 16, levels: int = 3):
    """A user workload (run.workload = "exatrain.bench.kfac:build_resnet") on CosmoFlow files."""
    from ..data.cosmoflow import CosmoFlowDataset
    from ..workloads.user import Task

    train = CosmoFlowDataset(f"{data.path}/train.h5", transform=_log1p)
    val = CosmoFlowDataset(f"{data.path}/val.h5", transform=_log1p)
    targets = torch.stack([train[i][1] for i in range(len(train))])
    mean = targets.mean(0)
    val_targets = torch.stack([val[i][1] for i in range(len(val))])
    baseline = float((val_targets - mean).abs().mean())
    x0 = train[0][0]
    return Task(model=ResidualCNN(x0.shape[0], channels, levels, targets.shape[1]),
                train_set=train, val_set=val, loss=nn.functional.mse_loss,
                metrics={"mae": lambda out, y: (out - y).abs().mean(1)},
                baselines={"baseline_mae": baseline})


def _log1p(x):
    import numpy as np
    return np.log1p(x.astype(np.float32)) - 2.6  # roughly centred (cf. workloads.cosmoflow)


# ---------------------------------------------------------------------- rank functions
def _train_rank(config) -> dict:
    from ..train.run import setup

    mesh, trainer = setup(config)
    try:
        ledger_mark = mesh.ledger.snapshot()
        summary = trainer.fit()
        kfac_bytes = mesh.ledger.since(ledger_mark).bytes_by_axis(tag="kfac")
        curve, seconds = [], 0.0
        for h in trainer.history:
            if "samples_per_s" in h:  # a log record: training time of its interval
                n = len(h["step_losses"])
                seconds += config.train.batch_size * n / h["samples_per_s"]
            if "val_mae" in h:
                curve.append((h["step"], seconds, h["val_mae"]))
        kfac = getattr(trainer.optimizer, "decompositions", None)
        return {"curve": curve, "step_s": summary["step_s_median"],
                "baseline_mae": summary.get("baseline_mae"),
                "kfac_decompositions": kfac, "kfac_preconditioned_steps":
                    getattr(trainer.optimizer, "steps", None) if kfac is not None else None,
                "kfac_bytes_per_step": sum(kfac_bytes.values()) / max(1, summary["steps"])}
    finally:
        mesh.close()


def _memory_rank(config, fractions) -> dict:
    from ..optim.kfac import KFAC, KFACSettings
    from ..train.run import setup
    from ..optim.factory import build_optimizer

    mesh, trainer = setup(config)
    try:
        out = {}
        for f in fractions:
            inner = build_optimizer(trainer.model.parameters(), config.optim, 0.01)
            opt = KFAC(trainer.model, inner, mesh, replace(
                KFACSettings.from_options(config.optim), grad_worker_fraction=f))
            out[f] = (opt.memory_bytes(), opt.memory_formula())
            opt.close()
        return out
    finally:
        mesh.close()


# ---------------------------------------------------------------------- the bench
# K-FAC's command-line options (`--kfac-damping` ...): each replaces its `optim.*` key when given
KFAC_OPTIONS = ("kfac_factor_every", "kfac_inverse_every", "kfac_damping", "kfac_kl_clip",
                "kfac_inverse", "kfac_base", "kfac_factor_positions", "kfac_grad_worker_fraction")


def _optimizer_keys(optimizer: str, args) -> list[str]:
    """`optim.*` overrides of one optimizer's runs: its name, its lr where one was given (else the
    config's default), K-FAC's options where given."""
    name = "adamw" if optimizer == "adamw_tuned" else optimizer
    lr = {"adamw": args.lr_adamw, "adamw_tuned": args.lr_adamw_tuned, "sgd": args.lr_sgd,
          "kfac": args.lr_kfac}[optimizer]
    keys = [f"optim.name='{name}'"] + ([f"optim.lr={lr!r}"] if lr is not None else [])
    for option in KFAC_OPTIONS:
        value = getattr(args, option)
        if value is not None:
            keys.append(f"optim.{option}={value!r}")
    return keys


def _config(work: Path, workload: str, optimizer: str, args, steps: int, size: int,
            data: Path | None = None, target: float | None = None, more: list[str] = ()):
    from ..train.config import load_config

    data = data or work / "data"
    common = [f"train.steps={steps}", f"train.eval_every={args.eval_every}",
              f"train.log_every={args.eval_every}", f"train.batch_size={args.batch}",
              "plan.data=2", *_optimizer_keys(optimizer, args),
              f"run.out_dir={work / 'runs'}", f"run.name={workload}-{optimizer}", "run.seed=0",
              "run.backend=gloo" if not torch.cuda.is_available() else "run.backend=auto"]
    if workload == "cosmoflow":
        extra = [f"model.size={size}", f"model.conv_layers={min(5, size.bit_length() - 1)}",
                 f"data.size={size}", f"data.path={data}",
                 "data.generate=false"]
    else:
        extra = ["run.workload='exatrain.bench.kfac:build_resnet'", f"data.path={data}"]
    if target is not None:
        extra.append(f"train.target='val_mae <= {target!r}'")
    return load_config(None, common + extra + list(more) + list(args.overrides))


def _baseline_mae(data: Path) -> float:
    """MAE on the validation set of predicting the training set's mean targets."""
    from ..data.cosmoflow import CosmoFlowDataset, predict_mean_baseline_mae
    return predict_mean_baseline_mae(CosmoFlowDataset(f"{data}/train.h5"),
                                     CosmoFlowDataset(f"{data}/val.h5"))


def _median_reached(reached: list[tuple]) -> tuple:
    """The median run's (steps, seconds) to the target over seeds, a run that never reached it
    counting as slower than all that did (None when that is the median)."""
    order = sorted(reached, key=lambda r: (r[1] is None, r[1] or 0.0))
    return order[(len(order) - 1) // 2]


EXACT_SPLITS = 200_000   # up to C(18, 9) = 48,620 splits: exact; C(20, 10) = 184,756 too


def rank_sum_p_value(a: list, b: list, exact_splits: int = EXACT_SPLITS) -> float:
    """The exact two-sided p-value of the Mann-Whitney rank-sum test that `a` and `b` come from
    one distribution: the share of all C(n, |a|) ways to split the n pooled values into groups of
    |a| and |b| whose rank sum of the first group lies at least as far from its mean as `a`'s.
    Ties take their mean rank (steps to a target come in multiples of the evaluation interval),
    and None (a run that never reached the target) ranks above every reached value. Beyond
    `exact_splits` splits the normal approximation with the tie and continuity corrections."""
    from itertools import combinations

    key = lambda v: (v is None, v or 0.0)
    pooled = sorted(list(a) + list(b), key=key)
    ranks, i = {}, 0
    while i < len(pooled):   # mean rank (1-based) of each run of equal values
        j = i
        while j < len(pooled) and key(pooled[j]) == key(pooled[i]):
            j += 1
        ranks[key(pooled[i])] = (i + j + 1) / 2
        i = j
    values = [ranks[key(v)] for v in pooled]
    n, na = len(pooled), len(a)
    mean = na * (n + 1) / 2
    observed = abs(sum(ranks[key(v)] for v in a) - mean)
    if math.comb(n, na) > exact_splits:
        ties = sum(t ** 3 - t for t in Counter(values).values())
        variance = na * (n - na) / 12 * ((n + 1) - ties / (n * (n - 1)))
        z = max(observed - 0.5, 0.0) / math.sqrt(variance)
        return min(1.0, math.erfc(z / math.sqrt(2)))
    splits = extreme = 0
    for group in combinations(values, len(a)):
        splits += 1
        extreme += abs(sum(group) - mean) >= observed - 1e-9
    return extreme / splits


def _to_target(curve, target):
    return next(((step, s) for step, s, mae in curve if mae <= target), (None, None))


def run(args, launch=None) -> dict:
    """The figures of the module doc. `launch(fn, nproc, args=...)` runs `fn(*args)` on `nproc`
    ranks and returns their results by rank: by default `exatrain.launch.spawn`, fresh processes
    for every run (tests hand in a pool of ranks that are already started)."""
    from ..data.cosmoflow_synth import write_cosmoflow
    from ..launch import spawn

    launch = launch or spawn
    size, steps = args.size or 32, args.steps or 2000
    parts = set(args.parts.split(","))
    result: dict = {"ranks": 2, "global_batch": args.batch, "size": size, "max_steps": steps,
                    "device": "cuda" if torch.cuda.is_available() else "cpu"}
    with tempfile.TemporaryDirectory(prefix="exatrain-bench-kfac-") as tmp:
        work = Path(tmp)
        data = Path(args.data_dir) if args.data_dir else work / "data"
        if parts & {"optim", "memory"} and not (data / "val.h5").exists():
            write_cosmoflow(data, samples=args.samples, size=size, seed=1234)
        if "optim" in parts:
            # the baseline (predicting the training set's mean) is the data's, not a run's
            target = args.target_fraction * _baseline_mae(data)
            stop = target if args.stop_at_target else None
            seeds = range(args.first_seed, args.first_seed + args.seeds)
            for workload in args.workloads.split(","):
                # seed by seed, every optimizer in turn: a drifting machine slows all alike
                configs = {(o, seed): _config(work, workload, o, args, steps, size, data, stop,
                                              [f"run.seed={seed}"])
                           for seed in seeds for o in args.optimizers.split(",")}
                per_seed = [{o: launch(_train_rank, 2, args=(configs[o, seed],))[0]
                             for o in args.optimizers.split(",")} for seed in seeds]
                runs = {o: [r[o] for r in per_seed] for o in per_seed[0]}
                result[f"{workload}_target_val_mae"] = target
                for o, rs in runs.items():
                    reached = [_to_target(r["curve"], target) for r in rs]
                    step, seconds = _median_reached(reached)
                    result[f"{workload}_{o}_steps_to_target"] = step
                    result[f"{workload}_{o}_seconds_to_target"] = seconds
                    optim = configs[o, seeds[0]].optim
                    result[f"{workload}_{o}_lr"] = optim.lr
                    if o == "kfac":   # the settings it ran with, defaults included
                        result["kfac_base"] = optim.kfac_base
                        result["kfac_settings"] = {k: getattr(optim, k) for k in vars(optim)
                                                   if k.startswith("kfac_")}
                    result[f"{workload}_{o}_step_s"] = statistics.median(r["step_s"] for r in rs)
                    result[f"{workload}_{o}_best_val_mae"] = statistics.median(
                        min(m for _, _, m in r["curve"]) for r in rs)
                    if len(rs) > 1:
                        result[f"{workload}_{o}_steps_to_target_per_seed"] = [s for s, _ in reached]
                        result[f"{workload}_{o}_seconds_to_target_per_seed"] = [
                            None if t is None else round(t, 2) for _, t in reached]
                    result[f"{workload}_{o}_curves"] = [r["curve"] for r in rs]
                if "kfac" not in runs:
                    continue
                result[f"{workload}_kfac_bytes_per_step"] = runs["kfac"][0]["kfac_bytes_per_step"]
                for figure in ("decompositions", "preconditioned_steps"):
                    result[f"{workload}_kfac_{figure}"] = runs["kfac"][0][f"kfac_{figure}"]
                if "sgd" in runs:
                    result[f"{workload}_kfac_step_overhead"] = (result[f"{workload}_kfac_step_s"]
                                                                / result[f"{workload}_sgd_step_s"])
                for other in ("adamw", "adamw_tuned"):
                    if other not in runs:
                        continue
                    a, k = (result[f"{workload}_{o}_seconds_to_target"] for o in (other, "kfac"))
                    result[f"{workload}_kfac_vs_{other}_seconds"] = k / a if a and k else None
                    if len(seeds) > 1:   # could the seeds' spread alone give that ratio?
                        result[f"{workload}_kfac_vs_{other}_p_value"] = rank_sum_p_value(
                            *(result[f"{workload}_{o}_seconds_to_target_per_seed"]
                              for o in ("kfac", other)))
                    result[f"{workload}_kfac_step_over_{other}"] = (
                        result[f"{workload}_kfac_step_s"] / result[f"{workload}_{other}_step_s"])
                result[f"{workload}_kfac_reached_every_seed"] = all(
                    s is not None for s, _ in (_to_target(r["curve"], target)
                                               for r in runs["kfac"]))
            if args.plot:
                from .kfac_plot import plot_to_target
                plot_to_target(result, args.plot)
        if "memory" in parts:
            config = _config(work, "cosmoflow", "kfac", args, 1, size, data)
            per_rank = launch(_memory_rank, 2, args=(config, (0.5, 1.0)))
            for f in (0.5, 1.0):
                result[f"second_order_bytes_per_rank_f{f}"] = max(r[f][0] for r in per_rank)
                result[f"second_order_bytes_per_rank_f{f}_formula"] = max(r[f][1] for r in per_rank)
    if "branches" in parts:
        result.update(branch_figures(args, launch))
    return result
