"""Validation metrics declared once, reduced exactly over batches and the data axes.

A metric that is not a sum (accuracy, IoU, MAE) cannot be averaged over ranks: each rank sees a
different number of samples, and a mean of per-rank IoUs is not the IoU of the set. So every
metric is declared as a ratio of two sums; the Trainer adds the sums over the validation batches
and all-reduces them over the data axes (one float64 SUM all-reduce of 8 bytes × 2 per metric on
the data axis, tag "metric"), and only then divides.

    Mean(fn)   fn(output, target) -> per-sample (or per-element) values, e.g. (o - t).abs():
               sum(values) / count(values). A 0-dim result is taken as the batch mean and
               weighted by the batch size (so a loss function is a valid Mean).
    Ratio(fn)  fn(output, target) -> (numerator, denominator), e.g. (intersection, union)
               for IoU: sum(numerators) / sum(denominators).

A plain callable is a Mean.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..parallel.nested import first_tensor


class Mean:
    """A metric that is the mean of per-sample (or per-element) values over the validation set.

    Args:
        fn: `fn(output, target)` returning the values, e.g. `lambda o, t: (o - t).abs()` for
            the MAE; a 0-dim result is taken as the batch's mean and weighted by its size, so a
            loss function is a valid Mean. The sums are added over batches and ranks before
            dividing, so the result is the mean over the whole set, at any Plan.
    """

    def __init__(self, fn: Callable):
        self.fn = fn

    def sums(self, output, target) -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.as_tensor(self.fn(output, target)).detach().double()
        if values.dim() == 0:
            # the batch: the target's (an output of several tensors may lead with a scalar)
            lead = target if isinstance(target, torch.Tensor) and target.dim() else first_tensor(output)
            n = float(len(lead)) if lead is not None and lead.dim() else 1.0
            return values * n, torch.tensor(n, dtype=torch.float64)
        return values.sum(), torch.tensor(float(values.numel()), dtype=torch.float64)


class Ratio:
    """A metric that is a ratio of two sums over the validation set, e.g. IoU.

    Args:
        fn: `fn(output, target)` returning `(numerator, denominator)` (tensors or numbers),
            e.g. `(intersection, union)`; the metric is sum(numerators) / sum(denominators)
            over every batch and rank, not a mean of per-batch ratios.
    """

    def __init__(self, fn: Callable):
        self.fn = fn

    def sums(self, output, target) -> tuple[torch.Tensor, torch.Tensor]:
        num, den = self.fn(output, target)
        return (torch.as_tensor(num).detach().double().sum(),
                torch.as_tensor(den).detach().double().sum())


def as_metric(value) -> Mean | Ratio:
    if isinstance(value, (Mean, Ratio)):
        return value
    if callable(value):
        return Mean(value)
    raise TypeError(f"a metric must be a callable(output, target), exatrain.Mean or "
                    f"exatrain.Ratio; got {value!r}")


def metric_functions(metrics: dict, prefix: str = "val_") -> tuple[Callable, Callable]:
    """(metric_sums, finalize) for a Workload, from {name: metric}."""
    declared = {name: as_metric(m) for name, m in metrics.items()}

    def metric_sums(output, target) -> dict[str, torch.Tensor]:
        out = {}
        for name, metric in declared.items():
            out[f"{name}/num"], out[f"{name}/den"] = metric.sums(output, target)
        return out

    def finalize(sums: dict) -> dict[str, float]:
        return {f"{prefix}{name}": float(sums[f"{name}/num"]) / max(float(sums[f"{name}/den"]), 1e-300)
                for name in declared}

    return metric_sums, finalize
