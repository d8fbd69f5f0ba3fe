"""`exatrain bench ltfb`: a population of K trainers (LTFB) against one trainer with a K× batch.

Same ranks, same sample budget, same real regression task (CosmoFlow 16³ by default: 4096
generated samples, 3584 for training, 512 for validation):

  single      one trainer on all K ranks (Plan(data=K)), global batch K·b, S steps
  population  K trainers of one rank each (Plan(trainer=K)), batch b each on its own partition of
              the training set (a tenth held out for tournaments), S steps, random pairwise
              exchange every `--interval` steps

Both start from the same learning rate and schedule (the single trainer's learning rate is not
scaled with its batch: the comparison asks what K× more samples per step buy); the single trainer
and trainer 0 start from the same weights (run.seed), trainer k from run.seed + k. Every
`--eval-every` steps each trainer evaluates the same validation set; the time to target is the
training time since training began (`elapsed_s - val_eval_s` of the metrics line: steps and
tournaments, not the validation passes) at the first evaluation whose validation MSE is at or
below `--target`, for the population the first of any of its trainers. Validation passes are
the benchmark's measuring instrument, and each trainer of the population runs the whole
validation set on its own ranks (the single trainer splits it over all), so they are left out of
wall_s_* and reported with them in wall_s_with_eval_*. Steps to target count optimizer steps (of
that trainer).

Each variant runs `--repeats` times, alternating with the other; steps to a target are the same in
every repeat (training is deterministic; the bench checks), times are medians over repeats.

Writes target, steps_to_target_single, steps_to_target_population, wall_s_single,
wall_s_population (the times to target; null when not reached), trainers, exchange_bytes (the
model bytes sent between trainers, counted by the ledger on the `trainer` axis) and
exchange_bytes_formula = model parameter bytes × models sent (every tournament pair sends one
model each way), and the final validation MSE of each; the same two figures for the further
targets `--also` (steps_to_<target>_single, wall_s_to_<target>_population, ...), which show where
along the curve each side is ahead.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("--trainers", type=int, default=2, help="K: trainers = ranks (default 2)")
    parser.add_argument("--batch", type=int, default=256, help="batch per trainer (default 256)")
    parser.add_argument("--target", type=float, default=0.25, help="target validation MSE")
    parser.add_argument("--also", type=float, nargs="*", default=[0.30, 0.27, 0.24, 0.23],
                        help="further targets reported as steps/wall_s_to_<target>_<variant>")
    parser.add_argument("--interval", type=int, default=20, help="steps between tournaments")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    parser.add_argument("--samples", type=int, default=4096, help="samples generated")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (both)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each variant, alternating; times are medians (default 3)")
    parser.add_argument("--backend", default="auto", help="auto | gloo | nccl (gloo on a machine "
                                                          "with fewer GPUs than ranks)")
    parser.add_argument("--out", default="", help="keep data and runs here (default: a temporary "
                                                  "directory, removed at the end)")


def _curve(trainer_dir: Path) -> list[tuple[int, float, float, float]]:
    """(step, training seconds, seconds with validation, val_mse) of a trainer's evaluations."""
    lines = [json.loads(x) for x in (trainer_dir / "metrics.jsonl").read_text().splitlines()]
    return [(x["step"], x["elapsed_s"] - x["val_eval_s"], x["elapsed_s"], x["val_mse"])
            for x in lines if "val_mse" in x and "loss" not in x and "tournament" not in x]


def _to_target(curves: list, target: float) -> tuple:
    """(steps, training seconds, seconds with validation) at the first evaluation of any curve
    at or below `target` (Nones when none is): the earliest step, and of the trainers reaching
    it there, the earliest time."""
    hits = [(step, train_s, with_eval) for curve in curves
            for step, train_s, with_eval, mse in curve if mse <= target]
    return min(hits) if hits else (None, None, None)


def run(args) -> dict:
    if args.out:
        return _run(args, Path(args.out))
    with tempfile.TemporaryDirectory(prefix="exatrain-bench-ltfb-") as work:
        return _run(args, Path(work))


def _run(args, work: Path) -> dict:
    from ..data.cosmoflow_synth import write_cosmoflow
    from ..launch import spawn
    from ..models.cosmoflow import CosmoFlow
    from ..train.config import load_config
    from ..population.run import run_population

    k, b = args.trainers, args.batch
    size, steps = args.size or 16, args.steps or 80
    write_cosmoflow(work / "data", samples=args.samples, size=size, seed=5)
    common = [f"model.size={size}", "model.conv_layers=4", "model.base_channels=8",
              f"data.size={size}", f"data.path={work / 'data'}", "data.generate=false",
              f"train.steps={steps}", f"train.eval_every={args.eval_every}",
              f"train.log_every={args.eval_every}", f"optim.lr={args.lr}",
              f"run.out_dir={work / 'runs'}", "run.seed=0", f"run.backend={args.backend}"]
    single = load_config(None, [*common, f"plan.data={k}", f"train.batch_size={k * b}",
                                "run.name=single"])
    population = load_config(None, [*common, f"plan.trainer={k}", f"train.batch_size={b}",
                                    "population.strategy=pairwise",
                                    f"population.interval={args.interval}", "run.name=population"])
    # K=1 population = ordinary training (tested bit for bit); it logs elapsed_s like the others.
    # Repeats alternate the two, so that machine noise hits both alike.
    runs: dict[str, list] = {"single": [], "population": []}
    for _ in range(args.repeats):
        for name, config in (("single", single), ("population", population)):
            summary = spawn(run_population, k, args=(config,))[0]
            curves = [_curve(Path(summary["run_dir"]) / f"trainer_{t:02d}")
                      for t in range(summary["trainers"])]
            runs[name].append((summary, curves))

    def at(target: float, name: str) -> tuple:
        """(steps, training s, s with validation) to `target`, the times medians over repeats;
        the steps must agree over repeats."""
        hits = [_to_target(curves, target) for _, curves in runs[name]]
        if len({hit[0] for hit in hits}) > 1:
            raise RuntimeError(f"bench ltfb: {name} reached {target} at different steps in "
                               f"repeats ({hits}); training is not deterministic here.")

        def median(i):
            values = [hit[i] for hit in hits]
            return statistics.median(values) if None not in values else None
        return hits[0][0], median(1), median(2)

    steps_single, wall_single, with_eval_single = at(args.target, "single")
    steps_pop, wall_pop, with_eval_pop = at(args.target, "population")
    sweep = {}
    for target in args.also:
        for name in runs:
            sweep[f"steps_to_{target:g}_{name}"], sweep[f"wall_s_to_{target:g}_{name}"], _ = \
                at(target, name)
    single_summary, pop_summary = runs["single"][0][0], runs["population"][0][0]
    model_bytes = 4 * sum(p.numel() for p in CosmoFlow(size=size, conv_layers=4,
                                                       base_channels=8).parameters())
    return {"target": args.target, "trainers": k, "ranks": k,
            "batch_single": k * b, "batch_per_trainer": b, "steps": steps,
            "samples_per_step": k * b,
            "steps_to_target_single": steps_single, "steps_to_target_population": steps_pop,
            "wall_s_single": wall_single, "wall_s_population": wall_pop,
            "wall_s_with_eval_single": with_eval_single,
            "wall_s_with_eval_population": with_eval_pop,
            "final_val_mse_single": single_summary["final_val_mse_by_trainer"][0],
            "final_val_mse_population_best": pop_summary["best_val_mse"],
            "wall_s_total_single": statistics.median(r[0]["wall_s"] for r in runs["single"]),
            "wall_s_total_population": statistics.median(r[0]["wall_s"]
                                                         for r in runs["population"]),
            "repeats": args.repeats,
            "exchange_bytes": pop_summary["exchange_bytes"],
            "exchange_bytes_formula": model_bytes * pop_summary["transfers"],
            "exchange_bytes_ratio": pop_summary["exchange_bytes"] /
            max(1, model_bytes * pop_summary["transfers"]),
            **sweep,
            **({"run_dir_single": single_summary["run_dir"],
                "run_dir_population": pop_summary["run_dir"]} if args.out else {})}
