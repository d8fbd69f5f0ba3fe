"""Dropout for the `space` axis: masks distributed as a serial mask (module `SpatialDropout`)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .functions import shared_mask
from .layers import SpatialLayer

class SpatialDropout(SpatialLayer):
    """Dropout under a space split.

    Element-wise dropout on a block draws its own mask (the blocks' masks together are distributed
    as a serial mask). Channel dropout (Dropout1d/2d/3d) must drop the same channels in every block
    of a sample, and any dropout after a gather must drop the same elements on every spatial rank:
    those masks are drawn on one rank and broadcast over `space` (mask bytes, tag "dropout").
    """

    def __init__(self, drop: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(drop, name, runtime, may_gather)
        self.p = float(drop.p)
        self.channelwise = type(drop).__name__ in ("Dropout1d", "Dropout2d", "Dropout3d")

    def describe(self) -> str:
        return f"p={self.p}" + (", channels" if self.channelwise else "")

    def forward(self, x):
        mode, x = self.enter_whole(x)
        if not self.training or self.p == 0.0:
            return x
        if self.channelwise:
            shape = tuple(x.shape[:2]) + (1,) * (x.dim() - 2)
        elif mode == "split":
            return F.dropout(x, self.p, True)
        else:
            shape = tuple(x.shape)
        return x * shared_mask(shape, 1.0 - self.p, self.runtime.space, x)
