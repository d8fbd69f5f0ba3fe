"""The [population] config section: tournaments on the `trainer` axis (Plan trainer=K)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError

STRATEGIES = ("pairwise", "truncation", "evolution", "none")
HPARAMS = ("lr", "weight_decay", "dropout")


@dataclass
class PopulationOptions:
    # pairwise: random pairwise exchange (LTFB); truncation: the bottom `truncation_k` trainers
    # take copies of random top ones; evolution: regularized evolution (a sampled tournament's
    # best, mutated, replaces the oldest); none: throughput mode, K independent trainers
    strategy: str = "pairwise"
    interval: int = 20                 # optimizer steps between tournaments (every trainer alike)
    metric: list[str] = field(default_factory=lambda: ["val_mse"])   # from the workload's metrics
    direction: list[str] = field(default_factory=lambda: ["lower"])  # per metric: lower | higher
    tournament_fraction: float = 0.1   # of each trainer's partition held out for tournaments
    exchange_optimizer: bool = False   # move the optimizer state with the weights
    exchange_hyperparameters: bool = True  # the adopting trainer takes the winner's lr, wd, dropout
    mutate: list[str] = field(default_factory=lambda: ["lr"])  # hyperparameters the loser perturbs
    mutation_factors: list[float] = field(default_factory=lambda: [0.8, 1.25])  # one drawn per key
    lr_bounds: list[float] = field(default_factory=lambda: [1e-6, 1.0])
    weight_decay_bounds: list[float] = field(default_factory=lambda: [0.0, 0.1])
    dropout_bounds: list[float] = field(default_factory=lambda: [0.0, 0.5])
    # each trainer's starting hyperparameters, one value per trainer; empty: the optim/model ones
    lr: list[float] = field(default_factory=list)
    weight_decay: list[float] = field(default_factory=list)
    dropout: list[float] = field(default_factory=list)
    truncation_k: int = 1              # truncation: trainers replaced per tournament
    sample_size: int = 2               # evolution: trainers sampled per tournament
    target: float = 0.0                # none: stop a trainer once metric[0] reaches it (0: never)


def validate(options: PopulationOptions, trainers: int) -> None:
    """Raise ValueError naming the key and a value that works."""
    o = options
    if o.strategy not in STRATEGIES:
        raise ConfigError(f"population.strategy={o.strategy!r} is not one of "
                          f"{', '.join(STRATEGIES)}.")
    if o.interval < 1:
        raise ConfigError(f"population.interval={o.interval} must be at least 1 (steps between "
                          "tournaments).")
    if not o.metric or len(o.direction) not in (1, len(o.metric)):
        raise ConfigError(
            f"population.metric={o.metric} and population.direction={o.direction}: "
            "give at least one metric and one direction, or one direction per metric.")
    bad = [d for d in o.direction if d not in ("lower", "higher")]
    if bad:
        raise ConfigError(f"population.direction={o.direction}: each must be 'lower' or 'higher'.")
    if not 0 < o.tournament_fraction < 1:
        raise ConfigError(f"population.tournament_fraction={o.tournament_fraction} must be in "
                          "(0, 1).")
    unknown = [k for k in o.mutate if k not in HPARAMS]
    if unknown:
        raise ConfigError(
            f"population.mutate={o.mutate}: {unknown} unknown; choose from {HPARAMS}.")
    if not o.mutation_factors or any(f <= 0 for f in o.mutation_factors):
        raise ConfigError(f"population.mutation_factors={o.mutation_factors} must be positive.")
    for key in HPARAMS:
        lo_hi = getattr(o, f"{key}_bounds")
        if len(lo_hi) != 2 or lo_hi[0] > lo_hi[1]:
            raise ConfigError(f"population.{key}_bounds={lo_hi} must be [low, high] with "
                              "low ≤ high.")
        values = getattr(o, key)
        if values and len(values) != trainers:
            raise ConfigError(f"population.{key} has {len(values)} values for {trainers} trainers "
                              f"(plan.trainer={trainers}); give one per trainer or none.")
    if trainers > 1 and o.strategy == "truncation" and not 1 <= o.truncation_k <= trainers // 2:
        raise ConfigError(
            f"population.truncation_k={o.truncation_k} with {trainers} trainers: "
            f"use 1..{max(1, trainers // 2)} (the bottom k take copies of the top k).")
    if trainers > 1 and o.strategy == "evolution" and not 2 <= o.sample_size <= trainers:
        raise ConfigError(f"population.sample_size={o.sample_size} with {trainers} trainers: use "
                          f"2..{trainers}.")
