"""One trainer of a population, composed into its Trainer (`Trainer.compose`): tournaments every
`population.interval` steps, the throughput mode's target, its hyperparameters, its records'
fields and its checkpoint state. See `population.run` for the population as a whole.

Lock-step by construction: a tournament happens inside `after_step` at the steps that are
multiples of the interval, which every trainer reaches (all run the same `train.steps`; with
`train.epochs`, the epochs of the smallest partition, the same number for all); the only
communication between trainers is at those points, so no rank can wait for a partner that never
comes. (Throughput mode has no such points: trainers may stop at different steps.)

A trainer that adopts another's model takes its hyperparameters too (exchange_hyperparameters)
and mutates those named in `population.mutate` (`population.hparams`). A trainer whose loss or
gradient turns non-finite skips its steps (counted, `diverged_steps`) until a tournament replaces
its model: its NaN scores lose every tournament, so one bad learning rate never stops the job.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch

from ..comm import all_gather_object
from ..mesh import TrainerMesh
from ..train.config import Config, ConfigError
from ..train.hooks import RunHooks
from . import exchange, hparams, pairing, weak_scaling


def member_config(config: Config, trainer: int) -> Config:
    """Trainer `trainer`'s config: its own seed and its starting hyperparameters."""
    member = copy.deepcopy(config)
    member.run.seed = config.run.seed + trainer  # trainer 0 is the ordinary job
    p = config.population
    if p.strategy == "none" and p.target:  # weak scaling: the instance stops at the target
        member.train.target = weak_scaling.instance_target(p.metric[0], p.direction[0], p.target,
                                                           config.train.target)
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
