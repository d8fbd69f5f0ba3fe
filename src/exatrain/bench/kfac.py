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

and `second_order_bytes_per_rank_f<f>`: the largest K-FAC state any rank holds, for every
grad_worker_fraction f the 2 ranks allow (1/2: memory-optimal, 1: communication-optimal), counted
from its tensors (`KFAC.memory_bytes`), with `..._formula` from the module doc beside it.

Part 2, sub-graph parallelism (2 ranks): DeepCAM (`--deepcam-size`², width `--deepcam-width`)
under Plan(data=2), and the same with parallel.branches = "data" (ASPP's branches split over the
two ranks), interleaved step by step from the same weights on the same batches:
`deepcam_data_step_s`, `deepcam_branches_step_s`, their ratio, the branch bytes per step, and
for both layouts `deepcam_<layout>_max_rel_err_vs_serial` (outputs of the first step and every
state entry after the steps, against the serial model on the whole batch, computed in this
process), with the entry where it is worst (`..._worst_state_entry`) and the whole state's
relative norm error (`..._state_rel_norm_err_vs_serial`, ‖Δ‖ / ‖serial‖ over all entries): plain
data parallelism beside the branches separates what float32's reordered sums do over the steps
from the branches. The two layouts are also compared with each other, rank by rank:
`deepcam_branches_vs_data_max_rel_err` (and its `..._worst_state_entry`),
`..._rel_err_in_data_worst_entry` (in the entry where data parallelism is furthest from serial),
`..._state_rel_norm_err` and `..._output_rel_err_step1`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn


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
        return {"curve": curve, "step_s": summary["step_s_median"],
                "baseline_mae": summary.get("baseline_mae"),
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


def _deepcam_model(size_w: int):
    from ..models.deepcam import DeepCAM
    torch.manual_seed(0)
    return DeepCAM(in_channels=4, num_classes=3, width=size_w, dropout=0.0)


def _deepcam_rank(size: int, width: int, steps: int, warmup: int, batch: int) -> dict:
    from ..mesh import init
    from ..parallel import parallelize, unwrap
    from ..parallel.options import ParallelOptions
    from ..plan import Plan

    mesh = init(Plan(data=2))
    try:
        g = torch.Generator().manual_seed(3)
        xs = torch.randn(steps + warmup, batch, 4, size, size, generator=g)
        mine = slice(mesh.rank * batch // 2, (mesh.rank + 1) * batch // 2)
        models = {name: parallelize(_deepcam_model(width), mesh, ParallelOptions(branches=mode))
                  for name, mode in (("data", "none"), ("branches", "data"))}
        opts = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in models.items()}
        times = {n: [] for n in models}
        first_out = {}
        marks = {}
        for step in range(steps + warmup):
            for name, model in models.items():
                mark = mesh.ledger.snapshot()
                t0 = time.perf_counter()
                out = model(xs[step][mine].to(mesh.device))
                (out.float() ** 2).mean().backward()
                opts[name].step()
                opts[name].zero_grad()
                dt = time.perf_counter() - t0
                if step >= warmup:
                    times[name].append(dt)
                if step == 0:
                    first_out[name] = out.detach().cpu()
                marks[name] = mesh.ledger.since(mark).bytes_by_axis(tag="branch").get("data", 0)
        return {"times": times, "first_out": first_out,
                "state": {name: {k: v.detach().cpu().clone()
                                 for k, v in unwrap(m).state_dict().items()}
                          for name, m in models.items()},
                "branch_bytes": marks["branches"]}
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


NAMES = {"kfac": "K-FAC", "adamw": "AdamW", "sgd": "SGD", "adamw_tuned": "AdamW\n(tuned lr)"}


def plot_to_target(result: dict, path) -> Path:
    """Two panels per workload: val_mae against training seconds for every optimizer (one colour)
    and seed (one line), the target dashed, each run's first evaluation at the target marked;
    beside it every run's seconds to the target, the median run's as a bar (an open marker at
    the top: a run that never reached it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({k[:-len("_target_val_mae")] for k in result
                        if k.endswith("_target_val_mae")})
    fig, axes = plt.subplots(1, 2 * len(workloads), figsize=(8.8 * len(workloads), 4.2),
                             dpi=110, squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1] * len(workloads)})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, spread, w in zip(axes[0][::2], axes[0][1::2], workloads):
        target = result[f"{w}_target_val_mae"]
        optimizers = [k[len(w) + 1:-len("_curves")] for k in result
                      if k.startswith(f"{w}_") and k.endswith("_curves")]
        for color, o in zip(colors, optimizers):
            seconds = result[f"{w}_{o}_seconds_to_target"]
            name = NAMES.get(o, o).replace("\n", " ")
            if o == "kfac" and "kfac_base" in result:
                name += f" on {NAMES.get(result['kfac_base'], result['kfac_base'])}"
            if f"{w}_{o}_lr" in result:
                name += f", lr {result[f'{w}_{o}_lr']:g}"
            name += f" ({len(result[f'{w}_{o}_curves'])} seeds)"
            label = (f"{name}: median {seconds:.1f} s, {result[f'{w}_{o}_steps_to_target']} steps"
                     if seconds else f"{name}: target not reached")
            for j, curve in enumerate(result[f"{w}_{o}_curves"]):
                t = [c[1] for c in curve]
                m = [c[2] for c in curve]
                ax.plot(t, m, "-", color=color, lw=1.1, alpha=0.75, label=label if j == 0 else None)
                hit = next((c for c in curve if c[2] <= target), None)
                if hit:
                    ax.plot([hit[1]], [hit[2]], "o", color=color, ms=5, mec="black", mew=0.5)
        ax.plot([], [], "o", color="0.6", ms=5, mec="black", mew=0.5,
                label="a run's first evaluation at the target")
        ax.axhline(target, ls="--", color="0.3", lw=1)
        ax.annotate(f"target {target:.3f} (0.5 × baseline)", (0.01, target),
                    xycoords=("axes fraction", "data"), textcoords="offset points",
                    xytext=(2, -11), fontsize=7, color="0.3")
        ax.set_xlabel("training seconds (evaluations excluded)")
        ax.set_ylabel("validation MAE")
        ax.set_title(f"{w}: {result.get('ranks', 2)} ranks, global batch {result['global_batch']}",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        _plot_spread(spread, result, w, optimizers, colors)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _plot_spread(ax, result: dict, w: str, optimizers: list, colors: list) -> None:
    """Every run's seconds to the target per optimizer, the median run's as a bar."""
    runs = {o: result.get(f"{w}_{o}_seconds_to_target_per_seed",
                          [result[f"{w}_{o}_seconds_to_target"]]) for o in optimizers}
    top = 1.1 * max((s for r in runs.values() for s in r if s is not None), default=1.0)
    for x, (color, o) in enumerate(zip(colors, optimizers)):
        jitter = [x + 0.09 * ((j % 5) - 2) for j in range(len(runs[o]))]
        reached = [(j, s) for j, s in zip(jitter, runs[o]) if s is not None]
        ax.plot([j for j, _ in reached], [s for _, s in reached], "o", color=color, ms=5,
                mec="black", mew=0.5)
        missed = [j for j, s in zip(jitter, runs[o]) if s is None]
        ax.plot(missed, [top] * len(missed), "o", mfc="none", color=color, ms=5)
        median = result[f"{w}_{o}_seconds_to_target"]
        if median:
            ax.hlines(median, x - 0.3, x + 0.3, color=color, lw=2.5)
    ax.set_xticks(range(len(optimizers)), [NAMES.get(o, o) for o in optimizers], fontsize=8)
    ax.set_xlim(-0.6, len(optimizers) - 0.4)
    ax.set_ylim(0, top * 1.05)
    ax.set_ylabel("seconds to the target, per seed")
    lines = []
    for other in ("adamw", "adamw_tuned"):
        ratio, p = (result.get(f"{w}_kfac_vs_{other}_{k}") for k in ("seconds", "p_value"))
        if ratio:
            short = {"adamw": "AdamW", "adamw_tuned": "tuned AdamW"}[other]
            lines.append(f"K-FAC / {short}: {ratio:.2f}"
                         + (f", p {p:.2f}" if p is not None else ""))
    title = "\n".join(lines) or "bar: the median run"
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3, axis="y")


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
    from ..data.cosmoflow import write_cosmoflow
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
                plot_to_target(result, args.plot)
        if "memory" in parts:
            config = _config(work, "cosmoflow", "kfac", args, 1, size, data)
            per_rank = launch(_memory_rank, 2, args=(config, (0.5, 1.0)))
            for f in (0.5, 1.0):
                result[f"second_order_bytes_per_rank_f{f}"] = max(r[f][0] for r in per_rank)
                result[f"second_order_bytes_per_rank_f{f}_formula"] = max(r[f][1] for r in per_rank)
    if "branches" in parts:
        b, s, w = 4, args.deepcam_size, args.deepcam_width
        ranks = launch(_deepcam_rank, 2, args=(s, w, args.deepcam_steps, args.warmup, b))
        for name in ("data", "branches"):
            result[f"deepcam_{name}_step_s"] = statistics.median(
                max(r["times"][name][i] for r in ranks) for i in range(args.deepcam_steps))
        result["deepcam_branches_vs_data"] = (result["deepcam_branches_step_s"]
                                              / result["deepcam_data_step_s"])
        result["deepcam_branch_bytes_per_step"] = ranks[0]["branch_bytes"]
        # serial: the same model, the same batches, the whole batch in one process
        model = _deepcam_model(w)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(3)
        xs = torch.randn(args.deepcam_steps + args.warmup, b, 4, s, s, generator=g)
        first_err = {}
        for step in range(len(xs)):
            out = model(xs[step])
            if step == 0:
                ref = out.detach()
                for name in ("data", "branches"):
                    full = torch.cat([r["first_out"][name] for r in ranks])
                    first_err[name] = float((full - ref).abs().max() / ref.abs().max())
            (out ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
        state = model.state_dict()
        # plain data parallelism is measured beside the branches against the same serial run:
        # what both show is float32's reordered sums amplified by the steps, not the branches
        worst_vs_serial = {}
        for name in ("data", "branches"):
            errs = _entry_errors([r["state"][name] for r in ranks], state)
            worst = worst_vs_serial[name] = max(errs, key=errs.get)
            result[f"deepcam_{name}_max_rel_err_vs_serial"] = max(first_err[name], errs[worst])
            result[f"deepcam_{name}_worst_state_entry"] = worst
            result[f"deepcam_{name}_output_rel_err_step1"] = first_err[name]
            result[f"deepcam_{name}_state_rel_norm_err_vs_serial"] = max(
                _norm_error(r["state"][name], state) for r in ranks)
        # the two layouts against each other, rank by rank (the same batches and weights): how
        # much of the error vs serial the branches add to plain data parallelism's
        between: dict[str, float] = {}
        for r in ranks:
            for k, e in _entry_errors([r["state"]["branches"]], r["state"]["data"]).items():
                between[k] = max(between.get(k, 0.0), e)
        worst = max(between, key=between.get)
        result["deepcam_branches_vs_data_max_rel_err"] = between[worst]
        result["deepcam_branches_vs_data_worst_state_entry"] = worst
        result["deepcam_branches_vs_data_rel_err_in_data_worst_entry"] = \
            between[worst_vs_serial["data"]]
        result["deepcam_branches_vs_data_state_rel_norm_err"] = max(
            _norm_error(r["state"]["branches"], r["state"]["data"]) for r in ranks)
        result["deepcam_branches_vs_data_output_rel_err_step1"] = max(
            float((r["first_out"]["branches"] - r["first_out"]["data"]).abs().max()
                  / r["first_out"]["data"].abs().max()) for r in ranks)
        result["deepcam"] = f"DeepCAM {s}x{s}, width {w}, batch {b} (2 per rank)"
    return result


def _entry_errors(states: list[dict], ref: dict) -> dict[str, float]:
    """Per floating-point entry of `ref`: the largest |state - ref| / max |ref| over `states`."""
    return {k: max(float((st[k].double() - v.double()).abs().max()
                         / v.double().abs().max().clamp_min(1e-30)) for st in states)
            for k, v in ref.items() if v.is_floating_point()}


def _norm_error(state: dict, ref: dict) -> float:
    """‖state - ref‖ / ‖ref‖ over all floating-point entries together (the whole state)."""
    keys = [k for k, v in ref.items() if v.is_floating_point()]
    diff = sum(float((state[k].double() - ref[k].double()).pow(2).sum()) for k in keys)
    norm = sum(float(ref[k].double().pow(2).sum()) for k in keys)
    return (diff / max(norm, 1e-300)) ** 0.5
