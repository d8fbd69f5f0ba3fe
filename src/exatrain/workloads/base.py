"""What a workload hands the Trainer: model, data sets, loss, and summable validation statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.utils.data import Dataset


@dataclass
class Workload:
    model: nn.Module
    train_set: Dataset
    val_set: Dataset
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # Per validation batch: named sums (e.g. {"abs_err": ..., "count": ...}); the Trainer adds
    # them over batches and over `metric_axes`, then `finalize` turns sums into metrics.
    metric_sums: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]
    finalize: Callable[[dict[str, float]], dict[str, float]]
    baselines: dict[str, float] = field(default_factory=dict)
    metric_axes: tuple[str, ...] = ("data",)
    # Model FLOPs of one training sample (forward + backward), for MFU; 0 = unknown.
    flops_per_sample: float = 0.0
    # Tokens in one sample (sequence models), for tokens/s; 0 = not a sequence model.
    tokens_per_sample: int = 0
