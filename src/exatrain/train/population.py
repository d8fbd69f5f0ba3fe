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
              `population.target`; the summary reports models trained per hour

A trainer that adopts another's model takes its hyperparameters too (exchange_hyperparameters)
and mutates those named in `population.mutate` (`population.hparams`). A trainer whose loss or
gradient turns non-finite skips its steps (counted, `diverged_steps`) until a tournament replaces
its model: its NaN scores lose every tournament, so one bad learning rate never stops the job.

Lock-step by construction: a tournament happens inside `after_step` at the steps that are
multiples of the interval, which every trainer reaches (all run the same `train.steps`; with
`train.epochs`, the epochs of the smallest partition, the same number for all); the only
communication between trainers is at those points, so no rank can wait for a partner that never
comes. (Throughput mode has no such points: trainers may stop at different steps.)

At the end every trainer evaluates its final model on the validation set; the best one is exported
as a plain state dict (RUN_DIR/best_model.pt), and rank 0 writes RUN_DIR/population.json (each
trainer's scores, wins and hyperparameter history) and RUN_DIR/population_curves.png.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import numpy as np
import torch

from ..comm import all_gather_object, all_reduce
from ..mesh import TrainerMesh
from ..population import exchange, hparams, pairing
from ..population.partition import partition, split
from .checkpoints import checkpoint
from .config import Config, ConfigError
from .job import ResumeError, build, join, prepare_run
from .hooks import RunHooks
from .trainer import Trainer


def member_config(config: Config, trainer: int) -> Config:
    """Trainer `trainer`'s config: its own seed and its starting hyperparameters."""
    member = copy.deepcopy(config)
    member.run.seed = config.run.seed + trainer  # trainer 0 is the ordinary job
    p = config.population
    if p.lr:
        member.optim.lr = p.lr[trainer]
    if p.weight_decay:
        member.optim.weight_decay = p.weight_decay[trainer]
    if p.dropout:
        if not hasattr(member.model, "dropout"):
            raise ConfigError(f"population.dropout is set, but the {config.run.workload} model "
                              "has no dropout option; remove population.dropout.")
        member.model.dropout = p.dropout[trainer]
    return member


class PopulationMember(RunHooks):
    """One trainer of the population, composed into its Trainer (`Trainer.compose`): tournaments
    after every `population.interval` steps, the throughput mode's target, and the member's
    hyperparameters, records and checkpoint state.

    It is given what it uses: the trainer's mesh, the `[population]` options, the job's seed,
    its tournament set, the model, optimizer and learning-rate schedule it exchanges and
    retunes, and the Trainer's `evaluate(dataset)` and `log(record)`."""

    def __init__(self, mesh: TrainerMesh, options, job_seed: int, tournament_set, *, model,
                 optimizer, schedule, weight_decay: float, dropout: float, evaluate, log,
                 workload_name: str,
                 console=None):
        self.options, self.mesh = options, mesh
        self.trainer_id, self.trainers = mesh.trainer, mesh.trainers
        self.trainer_axis = mesh.trainer_axis
        self.seed = job_seed  # the job's, shared by every trainer: pairings, selections
        self.tournament_set = tournament_set
        self.model, self.optimizer, self.schedule = model, optimizer, schedule
        self.evaluate, self.log, self.console = evaluate, log, console
        self.workload_name = workload_name
        self.hparams = hparams.Hyperparameters(schedule.peak_lr, weight_decay, dropout)
        self.hp_history = [{"step": 0, **self.hparams.as_dict()}]
        self.births = [0] * self.trainers   # evolution: the tournament each trainer was born at
        self.adoptions = 0                  # tournaments after which this trainer took a model
        self.transfers_sent = 0             # models this trainer sent (for the byte formula)
        self.reached: dict | None = None    # throughput mode: when the target was reached
        self.diverged_steps = 0             # steps skipped for a non-finite loss or gradient
        self.step = 0                       # the trainer's steps done (after_step, load_state)
        self._started = time.perf_counter()

    @property
    def tournaments_on(self) -> bool:
        return self.trainers > 1 and self.options.strategy != "none"

    @property
    def handles_nonfinite(self) -> bool:
        """With tournaments a diverged trainer skips its steps until a tournament replaces its
        model (its NaN scores lose every one) instead of stopping the job; the Trainer then
        reads the verdict every step."""
        return self.tournaments_on

    # ------------------------------------------------------------------ hooks
    def fit_begin(self) -> None:
        if self.tournaments_on:  # a metric the workload lacks fails now, not at the 1st tournament
            self._checked(self.score())
        self._started = time.perf_counter()

    def _checked(self, scores: dict) -> dict:
        missing = [m for m in self.options.metric if m not in scores]
        if missing:  # the same verdict on every rank: they all computed the same metric names
            raise ConfigError(f"population.metric={self.options.metric}: the "
                              f"{self.workload_name} workload reports {sorted(scores)}, not "
                              f"{missing}; pick from those.")
        return scores

    def record_fields(self, validation_s: float) -> dict:
        # elapsed_s: wall time since fit began (tournaments and validation included), and
        # val_eval_s the part of it spent on validation passes, for time-to-quality
        return {"trainer": self.trainer_id, "elapsed_s": time.perf_counter() - self._started,
                "val_eval_s": validation_s,
                **{f"hp_{k}": v for k, v in self.hparams.as_dict().items()}}

    def diverged(self) -> None:
        self.diverged_steps += 1

    def after_step(self, step: int, history: list[dict]) -> bool:
        self.step = step
        if self.tournaments_on and step % self.options.interval == 0:
            self.tournament(step // self.options.interval)
        elif self.options.strategy == "none" and self.options.target and self.reached is None:
            return self._check_target(history)
        return False

    def checkpoint_state(self) -> dict:
        return {"population": {"trainer": self.trainer_id, "hparams": self.hparams.as_dict(),
                               "hp_history": self.hp_history, "births": self.births,
                               "adoptions": self.adoptions,
                               "transfers_sent": self.transfers_sent, "reached": self.reached,
                               "diverged_steps": self.diverged_steps}}

    def load_state(self, state: dict) -> None:
        saved = state["population"]
        self.step = int(state["step"])
        self.set_hparams(hparams.Hyperparameters(**saved["hparams"]), record=False)
        self.hp_history, self.births = saved["hp_history"], saved["births"]
        self.adoptions, self.transfers_sent = saved["adoptions"], saved["transfers_sent"]
        self.reached, self.diverged_steps = saved["reached"], saved["diverged_steps"]

    # ------------------------------------------------------------------ hyperparameters
    def set_hparams(self, hp: hparams.Hyperparameters, record: bool = True) -> None:
        self.hparams = hp
        hp.apply(self.schedule, self.optimizer, self.model)
        if record:
            self.hp_history.append({"step": self.step, **hp.as_dict()})

    def _adopt(self, donor_hp: hparams.Hyperparameters, tournament: int) -> None:
        """After taking another trainer's model: its hyperparameters, mutated."""
        hp = donor_hp if self.options.exchange_hyperparameters else self.hparams
        if self.options.mutate:
            rng = np.random.default_rng([self.seed, tournament, self.trainer_id, 5])
            hp = hparams.mutate(hp, self.options, rng)
        self.adoptions += 1
        self.set_hparams(hp)

    # ------------------------------------------------------------------ tournaments
    def score(self) -> dict[str, float]:
        """The current model's metrics on this trainer's tournament set."""
        return self.evaluate(self.tournament_set)

    def _state(self) -> list[torch.Tensor]:
        return exchange.model_tensors(self.model, self.optimizer if
                                      self.options.exchange_optimizer else None)

    def _load(self, tensors, values) -> None:
        exchange.load(tensors, values)
        refresh = getattr(self.model, "refresh_shards", None)  # ZeRO-1/2 offload: host copies
        if refresh is not None:
            refresh()

    def _move(self, send_to: list[int], recv_from: int | None):
        """Send this trainer's model and hyperparameters to `send_to`, receive from `recv_from`.
        Returns (tensors, received tensors, received hyperparameters)."""
        tensors = self._state()
        received = exchange.transfer(tensors, self.trainer_axis, send_to, recv_from)
        hp = exchange.transfer([self.hparams.as_tensor()], self.trainer_axis, send_to, recv_from,
                               tag="hparams")
        self.transfers_sent += len(send_to)
        return tensors, received, hparams.Hyperparameters.from_tensor(hp[0]) if hp else None

    def tournament(self, index: int) -> None:
        local = self._checked(self.score())
        strategy = self.options.strategy
        if strategy == "pairwise":
            event = self._pairwise(index, local)
        else:
            scores = all_gather_object(local, self.trainer_axis, tag="score")
            event = self._truncation(index, scores) if strategy == "truncation" else \
                self._evolution(index, scores)
        self.log({"step": self.step, "tournament": index,
                   **{f"tournament_{k}": v for k, v in local.items()}, **event})
        if self.console:  # rank 0: its own trainer's side of the tournament
            metric = self.options.metric[0]
            verdict = f"took the model of trainer {event['from']}" if event["adopted"] else \
                "kept its model"
            self.console.print(f"tournament {index} (step {self.step}): trainer {self.trainer_id} "
                               f"{verdict} ({metric} {local[metric]:.4g} on its tournament set)",
                               highlight=False)

    def _pairwise(self, index: int, local: dict) -> dict:
        o = self.options
        partner = pairing.pairwise_partners(self.seed, index, self.trainers)[self.trainer_id]
        if partner == self.trainer_id:
            return {"partner": partner, "adopted": False}
        tensors, received, their_hp = self._move([partner], partner)
        backup = [t.clone() for t in tensors]
        self._load(tensors, received)
        theirs = self.score()
        won = pairing.partner_wins(local, theirs, o.metric, o.direction)
        if won:
            self._adopt(their_hp, index)
        else:
            self._load(tensors, backup)
        return {"partner": partner, "adopted": won, "from": partner if won else self.trainer_id,
                **{f"partner_tournament_{k}": v for k, v in theirs.items()}}

    def _truncation(self, index: int, scores: list[dict]) -> dict:
        o = self.options
        donors = pairing.truncation_donors(scores, o.metric, o.direction, o.truncation_k,
                                           self.seed, index)
        donor = donors.get(self.trainer_id)
        send_to = sorted(b for b, d in donors.items() if d == self.trainer_id)
        tensors, received, their_hp = self._move(send_to, donor)
        if donor is not None:
            self._load(tensors, received)
            self._adopt(their_hp, index)
        return {"adopted": donor is not None,
                "from": donor if donor is not None else self.trainer_id,
                "replaced": sorted(donors)}

    def _evolution(self, index: int, scores: list[dict]) -> dict:
        o = self.options
        parent, oldest = pairing.evolution_step(scores, self.births, o.metric, o.direction,
                                                o.sample_size, self.seed, index)
        self.births[oldest] = index
        me = self.trainer_id
        if parent != oldest:
            tensors, received, their_hp = self._move([oldest] if me == parent else [],
                                                     parent if me == oldest else None)
            if me == oldest:
                self._load(tensors, received)
                self._adopt(their_hp, index)
        elif me == oldest:  # the oldest is the sample's best: its child is itself, mutated
            self._adopt(self.hparams, index)
        return {"adopted": me == oldest, "from": parent if me == oldest else me,
                "parent": parent, "replaced": [oldest]}

    # ------------------------------------------------------------------ throughput mode
    def _check_target(self, history: list[dict]) -> bool:
        """Throughput mode: True (stop here: this model is trained) when the step's evaluation
        reached `population.target`."""
        metric, direction = self.options.metric[0], self.options.direction[0]
        last = history[-1] if history else {}
        if last.get("step") != self.step or metric not in last:
            return False
        value = last[metric]
        if value <= self.options.target if direction == "lower" else value >= self.options.target:
            self.reached = {"step": self.step, "wall_s": time.perf_counter() - self._started,
                            metric: value}
            return True
        return False


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
    from ..population.plot import plot_curves

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
           job_figures: dict) -> dict:
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
        hours = max([r["wall_s"] for r in reached] or [summary["wall_s"]]) / 3600
        summary.update(models_reached_target=len(reached), models_per_hour=len(reached) / hours)
    summary.update(job_figures)
    if mesh.rank == 0:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
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
                         fit, job_figures or {})
    except BaseException as exc:
        # every trainer's tracked run: a trainer that trained well fails with its job (it
        # raises here too, at the next exchange with a trainer that failed)
        trainer.finished(None, exc)
        raise
    finally:
        mesh.close()
    trainer.finished(fit)  # this trainer's own summary (RUN_DIR/trainer_KK)
    return summary
