"""Each trainer's share of the training set, and the tournament set it holds out of its share.

The training set is split into K disjoint, nearly equal partitions by one seeded permutation
(the same on every rank); each trainer keeps the first `fraction` of its partition (at least one
sample per data replica) as its tournament set and trains on the rest. With K = 1 and no
tournaments the partition is the whole set in its own order, so one trainer trains on exactly the
samples an ordinary run does.
"""

from __future__ import annotations

import math

import numpy as np
from torch.utils.data import Subset

from ..errors import ConfigError


def partition(samples: int, trainers: int, trainer: int, fraction: float, seed: int,
              hold_out: bool, min_tournament: int = 1) -> tuple[list[int], list[int]]:
    """(training indices, tournament indices) of `trainer`; both sorted, disjoint over trainers."""
    if trainers == 1 and not hold_out:
        return list(range(samples)), []
    order = np.random.default_rng([seed, 11]).permutation(samples)
    mine = np.sort(np.array_split(order, trainers)[trainer])
    held = max(min_tournament, math.ceil(fraction * len(mine))) if hold_out else 0
    if len(mine) - held < 1:
        raise ConfigError(
            f"trainer {trainer} of {trainers} gets {len(mine)} of the {samples} training samples, "
            f"too few to hold out {held} for tournaments and still train; add samples, lower "
            "plan.trainer or population.tournament_fraction.")
    held_out = np.sort(np.random.default_rng([seed, 13, trainer]).permutation(mine)[:held])
    train = np.setdiff1d(mine, held_out)
    return train.tolist(), held_out.tolist()


def split(dataset, samples_train: list[int], samples_tournament: list[int]):
    """(training set, tournament set) views of `dataset`; the whole set when nothing is split."""
    train = dataset if len(samples_train) == len(dataset) and not samples_tournament else \
        Subset(dataset, samples_train)
    return train, Subset(dataset, samples_tournament) if samples_tournament else None
