"""Population training: K trainers on the `trainer` axis, with tournaments every N steps.

`Plan(trainer=K, ...)` splits the job into K trainers (`mesh.TrainerMesh`), each running the
intra-trainer Plan (pipe, data, shard, space, tensor) as if it were its own job: its own model (seeded
with run.seed + trainer id), its own disjoint partition of the training set with its own
tournament set held out of it, its own hyperparameters, its own run directory
(RUN_DIR/trainer_KK/: metrics.jsonl, summary.json, checkpoints/). Every metrics line carries the
trainer id, its hyperparameters (`trainer`, `hp_lr`, `hp_weight_decay`, `hp_dropout`), the wall
time since its training began (`elapsed_s`) and the part of it spent in validation passes
(`val_eval_s`; tournament scoring counts as training).

Tournaments (`population.strategy`), after every `population.interval` steps, evaluated on each
trainer's own tournament set (`population.metric`, `population.direction`):

  pairwise    LTFB's random pairwise exchange: partners from a seeded shuffle every rank computes
              alike; the two swap models (point-to-point, `population.exchange`), each evaluates
              the partner's model on its own tournament set and keeps it only if it wins every
              metric (the local model wins ties); the odd trainer out plays itself
  truncation  scores are gathered over the trainer axis; the bottom k take copies of random
              top-k trainers
  evolution   regularized evolution: a random sample's best replaces the oldest trainer
  none        throughput mode: no tournaments; each trainer stops when it reaches
              `population.target`; the summary reports models trained per hour, and with
              `[mlperf] enabled` MLPerf HPC's weak-scaling score from one MLPerf log per trainer
              (`population.weak_scaling`)

A trainer that adopts another's model takes its hyperparameters too (exchange_hyperparameters)
and mutates those named in `population.mutate` (`population.hparams`). A trainer whose loss or
gradient turns non-finite skips its steps (counted, `diverged_steps`) until a tournament replaces
its model: its NaN scores lose every tournament, so one bad learning rate never stops the job.

Each trainer is a plain Trainer with a `PopulationMember` composed into it (`population.member`:
the tournaments, lock-step by construction). This module puts the population together
(`setup_population`), runs it (`run_population`) and ends it (`finish`).

At the end every trainer evaluates its final model on the validation set; the best one is exported
as a plain state dict (RUN_DIR/best_model.pt), and rank 0 writes RUN_DIR/population.json (each
trainer's scores, wins and hyperparameter history) and RUN_DIR/population_curves.png.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..comm import all_gather_object, all_reduce
from ..mesh import TrainerMesh
from ..train.checkpoints import checkpoint
from ..train.config import Config, ConfigError
from ..train.job import ResumeError, build, join, prepare_run
from ..train.trainer import Trainer
from . import pairing, weak_scaling
from .member import PopulationMember, member_config
from .partition import partition, split


# ---------------------------------------------------------------------- the job
def _common_checkpoint(trainer_dir: Path, mesh: TrainerMesh) -> Path:
    """The newest step every trainer has a complete checkpoint of (a crash may have cut one
    trainer's last save short)."""
    root = checkpoint.checkpoint_dir(trainer_dir)
    mine = {p.name for p in root.glob("step_*")
            if (p / checkpoint.STATE_FILE).is_file() and not p.name.endswith(".partial")}
    common = set.intersection(*map(set, all_gather_object(sorted(mine), mesh.trainer_axis)))
    if not common:
        raise ResumeError(f"{trainer_dir.parent}: no step has a complete checkpoint of every "
                          f"trainer (trainer {mesh.trainer} has {sorted(mine) or 'none'}); start "
                          "a new run instead.")
    return root / max(common)


def setup_population(config: Config, resume_dir: str | None = None,
                     job_figures: dict | None = None) -> tuple:
    """Join the job, build this rank's trainer (`job.build`, over its trainer's mesh: each
    trainer's model seeded with its own seed, its own partition of the training set), a
    `PopulationMember` composed into it. `job_figures`: how the ranks were started.
    Returns (mesh, Trainer, PopulationMember)."""
    setup_times = {"init_start": time.time()}  # MLPerf's init and staging phases
    mesh = join(config)
    try:
        view = mesh.trainer_mesh()
        setup_times["staging_start"] = time.time()
        workload_module, run_dir = prepare_run(config, mesh, resume_dir)
        k, options = view.trainer, config.population
        member = member_config(config, k)
        trainer_dir = run_dir / f"trainer_{k:02d}"
        trainer_dir.mkdir(parents=True, exist_ok=True)
        resume_from = _common_checkpoint(trainer_dir, view) if resume_dir else None
        held_out = {}

        def make_workload(member: Config, view: TrainerMesh):
            """The member's workload with its partition of the training set (the tournament
            set held out of it); train.epochs counted in the smallest partition."""
            workload = workload_module.build(member, view)
            tournaments = view.trainers > 1 and options.strategy != "none"
            replicas = view.plan.data * view.plan.shard
            parts = [partition(len(workload.train_set), view.trainers, j,
                               options.tournament_fraction, config.run.seed, tournaments,
                               min_tournament=replicas) for j in range(view.trainers)]
            train, held = parts[k]
            if member.train.steps == 0:  # epochs: of the smallest partition, the same for all
                smallest = min(len(p[0]) for p in parts)
                member.train.steps = member.train.epochs * (smallest // member.train.batch_size)
                if member.train.steps == 0:
                    raise ConfigError(
                        f"train.batch_size={member.train.batch_size} is larger than the smallest "
                        f"trainer's training partition ({smallest} samples of "
                        f"{len(workload.train_set)} over {view.trainers} trainers); lower it.")
            workload.train_set, held_out["set"] = split(workload.train_set, train, held)
            return workload

        def make_trainer(view, workload, member, model, run_dir, console, **figures):
            """The member's Trainer with its population hooks composed in."""
            trainer = Trainer(view, workload, member, model, run_dir=run_dir, console=console,
                              **figures)
            trainer.compose(PopulationMember(
                view, options, config.run.seed, held_out["set"], model=trainer.model,
                optimizer=trainer.optimizer, schedule=trainer.schedule,
                weight_decay=member.optim.weight_decay,
                dropout=float(getattr(member.model, "dropout", 0.0)), evaluate=trainer.evaluate,
                log=trainer.log, workload_name=member.run.workload, console=console))
            return trainer

        built = build(member, view, make_workload, run_dir=trainer_dir, resume_from=resume_from,
                      make_trainer=make_trainer, job_mesh=mesh, setup_times=setup_times,
                      job_figures=job_figures)
        return mesh, built.trainer, built.trainer.hooks
    except BaseException:
        mesh.close()
        raise


def full_state_dict(model) -> dict:
    """The whole model as a plain state dict on the CPU (collective within the trainer)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from ..parallel.shard import ZeroDataParallel
    from ..parallel.tensor.state import for_checkpoint
    inner = model.module if isinstance(model, ZeroDataParallel) else model
    state = for_checkpoint(model, get_model_state_dict(inner))
    return {k: (v.full_tensor() if type(v).__name__ == "DTensor" else v).detach().cpu().clone()
            for k, v in state.items()}


def _read_metrics(trainer_dir: Path) -> list[dict]:
    """A trainer's metrics lines; of lines repeated by a resumed run, the last one counts."""
    path = trainer_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    kept: dict[tuple, dict] = {}
    for line in lines:
        kind = "tournament" if "tournament" in line else "loss" if "loss" in line else "eval"
        kept[(line["step"], kind)] = line
    return list(kept.values())


def _report(run_dir: Path, options, records: list[dict]) -> dict:
    """Rank 0: population.json and population_curves.png from every trainer's metrics."""
    from .plot import plot_curves

    metric = options.metric[0]
    trainers = []
    for record in records:
        lines = _read_metrics(run_dir / f"trainer_{record['trainer']:02d}")
        curve = [(x["step"], x[metric]) for x in lines
                 if metric in x and "loss" not in x and "tournament" not in x]
        events = [{k: v for k, v in x.items() if not k.startswith("hp_")}
                  for x in lines if "tournament" in x]
        trainers.append({**record, "val_curve": curve, "tournaments": events,
                         # tournaments it kept its own model through (self-play excluded)
                         "wins": sum(1 for e in events if not e["adopted"]
                                     and e.get("partner") != record["trainer"]),
                         "adoptions": sum(1 for e in events if e["adopted"])})
    summary = {"strategy": options.strategy, "metric": metric, "trainers": trainers}
    (run_dir / "population.json").write_text(json.dumps(summary, indent=1))
    plot_curves({t["trainer"]: t["val_curve"] for t in trainers},
                {t["trainer"]: [(e["step"], e["from"]) for e in t["tournaments"] if e["adopted"]]
                 for t in trainers},
                metric, run_dir / "population_curves.png",
                title=f"{len(trainers)} trainers, {options.strategy}")
    return summary


def finish(mesh, member: PopulationMember, final: dict, model, run_dir: Path, fit: dict,
           job_figures: dict, config: Config, console=None) -> dict:
    """Collective: final scores of every trainer (`final`: this one's on the validation set),
    the best `model` exported into the job's `run_dir`, the report."""
    options, view = member.options, member.mesh
    record = {"trainer": member.trainer_id, "final": final, "hparams": member.hparams.as_dict(),
              "hp_history": member.hp_history, "steps": fit["steps"], "wall_s": fit["wall_s"],
              "transfers_sent": member.transfers_sent, "reached": member.reached,
              "diverged_steps": member.diverged_steps}
    records = all_gather_object(record, member.trainer_axis)
    metric, direction = options.metric[0], options.direction[0]
    best = pairing.ranking([r["final"] for r in records], [metric], [direction])[0]
    if member.trainer_id == best:
        state = full_state_dict(model)
        if mesh.rank == 0:
            torch.save(state, run_dir / "best_model.pt")
    sent = mesh.ledger.entries.get(("trainer", "send", "exchange"))
    counted = torch.tensor([float(sent.bytes if sent else 0)], dtype=torch.float64,
                           device=mesh.device)
    all_reduce(counted, mesh.world, tag="metric")
    if mesh.rank == 0:
        _report(run_dir, options, records)
    mesh.barrier()  # the report and the best model exist before anyone returns
    weak = {}  # MLPerf HPC weak scaling: after the barrier, so a missing log fails rank 0 alone
    if mesh.rank == 0 and options.strategy == "none" and config.mlperf.enabled:
        from ..observe.mlperf import benchmark_name
        weak = weak_scaling.summarize(run_dir, view.trainers,
                                      benchmark_name(config.mlperf, config.run.workload))
    reached = [r["reached"] for r in records if r["reached"]]
    summary = {"trainers": view.trainers, "strategy": options.strategy,
               "plan": str(mesh.plan), "trainer_plan": str(view.plan),
               "world_size": mesh.world_size, "steps": fit["steps"],
               "steps_by_trainer": [r["steps"] for r in records],
               "best_trainer": best, f"best_{metric}": records[best]["final"][metric],
               f"final_{metric}_by_trainer": [r["final"][metric] for r in records],
               "final_lr_by_trainer": [r["hparams"]["lr"] for r in records],
               "transfers": sum(r["transfers_sent"] for r in records),
               "diverged_steps_by_trainer": [r["diverged_steps"] for r in records],
               "exchange_bytes": int(counted.item()),
               "wall_s": max(r["wall_s"] for r in records),
               "run_dir": str(run_dir), "best_model": str(run_dir / "best_model.pt")}
    if options.strategy == "none":
        # the trainers' clocks start together (a barrier); with [mlperf] enabled `weak` replaces
        # the figure with the same one read from the MLPerf logs' timestamps
        span_s = max((r["wall_s"] for r in reached), default=0.0)
        summary.update(models_reached_target=len(reached),
                       models_per_minute=weak_scaling.models_per_minute(len(reached), span_s))
    summary.update(weak, **job_figures)
    if mesh.rank == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if weak and console:
        console.print(weak_scaling.describe(summary), highlight=False)
    return summary


def run_population(config: Config, resume_dir: str | None = None,
                   job_figures: dict | None = None) -> dict:
    """Train a population per `config` on this rank; returns the population summary.
    `job_figures`: how the ranks were started (`run.job_figures`), in every summary."""
    mesh, trainer, member = setup_population(config, resume_dir, job_figures or {})
    try:
        mesh.barrier()  # every trainer starts its clock (elapsed_s) at the same moment
        fit = trainer.fit()
        summary = finish(mesh, member, trainer.evaluate(), trainer.model, trainer.run_dir.parent,
                         fit, job_figures or {}, config, trainer.console)
    except BaseException as exc:
        # every trainer's tracked run: a trainer that trained well fails with its job (it
        # raises here too, at the next exchange with a trainer that failed)
        trainer.finished(None, exc)
        raise
    finally:
        mesh.close()
    trainer.finished(fit)  # this trainer's own summary (RUN_DIR/trainer_KK)
    return summary
