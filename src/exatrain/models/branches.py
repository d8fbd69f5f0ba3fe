"""Branches: a model's independent parallel branches as one container (plain PyTorch).

    self.aspp = et.Branches([conv1x1, conv3x3_r1, conv3x3_r2], combine="concat")

Every branch reads the same input; their outputs are added ("sum") or concatenated along the
channel dim 1 ("concat"). Serially it is just that. Because the branches are independent,
`parallel.branches = "data"` runs them side by side on the ranks of the data axis
(`exatrain.parallel.branches`). It is an `nn.ModuleList`, so parameter names are those of a
ModuleList of the same branches (`name.0.weight`, ...) and checkpoints move between the two.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ModelOptionError

COMBINES = ("sum", "concat")


class Branches(nn.ModuleList):
    """Independent branches that read the same input; their outputs are combined.

    Args:
        branches: the branch modules (any `nn.Module`s).
        combine: `"concat"` concatenates the outputs along dim 1 (channels), `"sum"` adds them.
    """

    def __init__(self, branches: list[nn.Module], combine: str = "concat"):
        super().__init__(branches)
        if combine not in COMBINES:
            raise ModelOptionError(
                f"Branches(combine={combine!r}): use one of {', '.join(COMBINES)}.")
        if len(self) == 0:
            raise ModelOptionError("Branches([]): give at least one branch.")
        self.combine = combine

    def combine_outputs(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        if self.combine == "sum":
            out = outputs[0]
            for o in outputs[1:]:
                out = out + o
            return out
        return torch.cat(outputs, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine_outputs([branch(x) for branch in self])

    def extra_repr(self) -> str:
        return f"combine={self.combine!r}"
