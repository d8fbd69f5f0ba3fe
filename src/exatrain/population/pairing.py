"""Who meets whom in a tournament, and who wins: pure functions of a shared seed and scores.

Every rank of every trainer calls these with the same arguments (the run's seed, the tournament
index, and, for the selection strategies, the scores all trainers gathered), so every rank
reaches the same decision without any communication to agree on it (LBANN's "partners from a
shared seeded shuffle").

  random pairwise exchange  a seeded permutation of the K trainers, read two by two; with K odd
                            the last one plays itself (keeps its model)
  truncation selection      rank the trainers by score; each of the bottom k copies a random one
                            of the top k
  regularized evolution     sample `sample_size` trainers; the best of the sample is the parent;
                            the oldest trainer of the population (earliest birth, lowest id on
                            ties) is replaced by a mutated copy of the parent (Real et al. 2019)

Scores are dicts {metric: value}; `directions` says per metric whether lower or higher is
better. Ranking is lexicographic over the metrics, ties broken by trainer id. A non-finite score
(a diverged model) is worse than any finite one.
"""

from __future__ import annotations

import math

import numpy as np


def _rng(seed: int, tournament: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng([seed, tournament, purpose])


def pairwise_partners(seed: int, tournament: int, trainers: int) -> list[int]:
    """partner[k] for every trainer k: a permutation that is its own inverse (an involution)."""
    order = _rng(seed, tournament, 1).permutation(trainers).tolist()
    partner = list(range(trainers))  # the odd one out plays itself
    for a, b in zip(order[0::2], order[1::2]):
        partner[a], partner[b] = b, a
    return partner


def _cost(value: float, direction: str) -> float:
    """Lower is better; NaN and ±inf become +inf (the worst)."""
    if not math.isfinite(value):
        return math.inf
    return value if direction == "lower" else -value


def _better(a: float, b: float, direction: str) -> bool:
    return _cost(a, direction) < _cost(b, direction)


def partner_wins(local: dict, partner: dict, metrics: list[str], directions: list[str]) -> bool:
    """The partner's model wins only if it is strictly better on every metric (ties: local)."""
    directions = directions * len(metrics) if len(directions) == 1 else directions
    return all(_better(partner[m], local[m], d) for m, d in zip(metrics, directions))


def ranking(scores: list[dict], metrics: list[str], directions: list[str]) -> list[int]:
    """Trainer ids from best to worst."""
    directions = directions * len(metrics) if len(directions) == 1 else directions

    def key(k):
        return tuple(_cost(scores[k][m], d) for m, d in zip(metrics, directions)) + (k,)
    return sorted(range(len(scores)), key=key)


def truncation_donors(scores: list[dict], metrics: list[str], directions: list[str], k: int,
                      seed: int, tournament: int) -> dict[int, int]:
    """{replaced trainer: donor}: each of the bottom k takes a copy of a random one of the top k."""
    order = ranking(scores, metrics, directions)
    top, bottom = order[:k], order[len(order) - k:]
    rng = _rng(seed, tournament, 2)
    return {b: int(top[rng.integers(len(top))]) for b in sorted(bottom)}


def evolution_step(scores: list[dict], births: list[int], metrics: list[str],
                   directions: list[str], sample_size: int, seed: int,
                   tournament: int) -> tuple[int, int]:
    """(parent, replaced): the best of a random sample, and the oldest trainer it replaces."""
    rng = _rng(seed, tournament, 3)
    sample = sorted(rng.choice(len(scores), sample_size, replace=False).tolist())
    parent = ranking([scores[k] for k in sample], metrics, directions)[0]
    oldest = min(range(len(births)), key=lambda k: (births[k], k))
    return sample[parent], oldest
