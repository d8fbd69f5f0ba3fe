"""Learning-rate schedule: linear warm-up, then cosine/linear/constant decay; large-batch scaling.

Large global batches need a larger learning rate: the linear rule (Goyal et al. 2017) scales it by
B / B0, the square-root rule (Krizhevsky 2014; Hoffer et al. 2017; common for Adam) by sqrt(B / B0),
where B0 is the batch size the base learning rate was tuned for.
"""

from __future__ import annotations

import math


def scaled_lr(lr: float, batch_size: int, base_batch_size: int, rule: str) -> float:
    if rule == "none" or base_batch_size in (0, batch_size):
        return lr
    ratio = batch_size / base_batch_size
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))


def lr_at(step: int, peak_lr: float, total_steps: int, warmup_steps: int, decay: str,
          min_lr_ratio: float = 0.0) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`."""
    if warmup_steps and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if decay == "constant":
        return peak_lr
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    floor = peak_lr * min_lr_ratio
    if decay == "linear":
        return floor + (peak_lr - floor) * (1 - progress)
    return floor + (peak_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
