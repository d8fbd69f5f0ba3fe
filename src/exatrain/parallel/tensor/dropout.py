"""Dropout whose masks come from a generator exatrain owns, not the global random stream.

Under tensor parallelism the ranks of a tensor group must draw equal masks for replicated
activations (and distinct ones for sequence shards). Re-seeding the global generator for that
would change every random number the user's own code draws afterwards (augmentation, sampling,
noise), so every nn.Dropout of the split model is replaced by a `SeededDropout` that reads a
`torch.Generator` held by the model's TensorParallel state; seeding it touches nothing else.
No communication: the seed itself is agreed once per forward by convert.TensorParallel.
"""

from __future__ import annotations

import torch
from torch import nn


class DropoutStream:
    """The generator of one parallelized model, on its device."""

    def __init__(self, device):
        self.generator = torch.Generator(device=device)

    def seed(self, value: int) -> None:
        self.generator.manual_seed(value % 2 ** 63)


class SeededDropout(nn.Dropout):
    """nn.Dropout drawing its mask from `stream.generator` (same p, same scaling by 1/(1-p))."""

    def __init__(self, p: float, inplace: bool, stream: DropoutStream):
        super().__init__(p, inplace)
        self.stream = stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.p == 1.0:
            return x * 0.0
        keep = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self.stream.generator)
        return x * keep / (1.0 - self.p)


def replace_dropout(root: nn.Module, stream: DropoutStream) -> int:
    """Swap every exact nn.Dropout under `root` for a SeededDropout; returns how many."""
    count = 0
    for module in root.modules():
        for name, child in list(module.named_children()):
            if type(child) is nn.Dropout:
                setattr(module, name, SeededDropout(child.p, child.inplace, stream))
                count += 1
    return count


__all__ = ["DropoutStream", "SeededDropout", "replace_dropout"]
