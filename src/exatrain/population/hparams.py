"""A trainer's hyperparameters (peak learning rate, weight decay, dropout) and their mutation.

The learning rate is the peak of the trainer's schedule (`peak_lr`); the schedule's shape
(warm-up, decay) is the job's. Weight decay goes into every optimizer parameter group; dropout
into every dropout module of the model. Mutation multiplies each chosen value by one factor drawn
from `population.mutation_factors` and clips it to its bounds (a value of 0 stays 0: weight decay
or dropout switched off is not switched on by mutation).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
from torch import nn

from .options import HPARAMS, PopulationOptions


@dataclass(frozen=True)
class Hyperparameters:
    lr: float
    weight_decay: float
    dropout: float

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, k) for k in HPARAMS], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> "Hyperparameters":
        return cls(**dict(zip(HPARAMS, values.double().cpu().tolist())))

    def as_dict(self) -> dict:
        return asdict(self)

    def apply(self, schedule, optimizer, model) -> None:
        """Train with these values from the next step on: the peak of `schedule` (its
        `peak_lr`), the weight decay of every group of `optimizer`, the dropout of `model`."""
        schedule.peak_lr = self.lr
        for group in optimizer.param_groups:
            group["weight_decay"] = self.weight_decay
        for module in model.modules():
            if isinstance(module, nn.modules.dropout._DropoutNd):
                module.p = self.dropout


def initial(options: PopulationOptions, trainer: int, lr: float, weight_decay: float,
            dropout: float) -> Hyperparameters:
    """Trainer `trainer`'s starting values: its entry in population.lr etc., else the job's."""
    pick = {k: (getattr(options, k)[trainer] if getattr(options, k) else default)
            for k, default in zip(HPARAMS, (lr, weight_decay, dropout))}
    return Hyperparameters(**pick)


def mutate(hp: Hyperparameters, options: PopulationOptions,
           rng: np.random.Generator) -> Hyperparameters:
    """`hp` with every key in population.mutate scaled by a random factor, within its bounds."""
    changes = {}
    for key in options.mutate:
        factor = float(options.mutation_factors[rng.integers(len(options.mutation_factors))])
        lo, hi = getattr(options, f"{key}_bounds")
        changes[key] = float(min(max(getattr(hp, key) * factor, lo), hi))
    return replace(hp, **changes)
