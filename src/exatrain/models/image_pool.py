"""ImagePool: DeepLab's image-level feature, one leaf module (plain PyTorch).

    y = relu(scale * (W · mean_{h,w}(x)) + shift), broadcast back to every position of x

The global average over the spatial dims of x (N, C, *spatial) gives one C-vector per sample; a
1×1 convolution (a matrix W of out × C, no bias) and a per-channel affine (scale, shift: no
BatchNorm, whose statistics over N one-pixel maps would be too few) and a ReLU turn it into an
out-vector, which is repeated over the spatial dims of x, so it can be concatenated with the
other branches of an ASPP head. DeepLabv3's "image pooling" branch, as MLPerf HPC's DeepCAM
reference has it (there: AdaptiveAvgPool2d, Conv2d 1×1, an affine, ReLU, then a tile to the
feature map's size).

Why one leaf instead of nn.AdaptiveAvgPool2d(1) followed by layers: a global pool is where a
spatially split model ends its split region (everything after it runs on whole tensors), but
here the pooled vector flows back into the split feature map. As one module with a type of its
own, a strategy can give it its own distributed version (`parallel.spatial.pool.
SpatialImagePool`: the mean is a sum over blocks, all-reduced), and the model stays plain.

Cost per sample: N·C·V additions for the mean (V the spatial size), 2·out·C FLOPs for W, and
out·V writes for the broadcast (a view: `expand`, no copy until a consumer copies it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelInputError, ModelOptionError

__all__ = ["ImagePool", "image_pool_features", "broadcast_over"]


def image_pool_features(mean: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        shift: torch.Tensor) -> torch.Tensor:
    """(N, out) features from the (N, C) per-sample means: projection, affine, ReLU."""
    return F.relu(F.linear(mean, weight) * scale + shift)


def broadcast_over(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(N, out) -> (N, out, *spatial of `like`): the same vector at every position, a view."""
    k = like.dim() - 2
    return y.reshape(*y.shape, *([1] * k)).expand(*y.shape, *like.shape[2:])


class ImagePool(nn.Module):
    """Image-level pooling branch: global mean, 1×1 projection, affine, ReLU, broadcast.

    Args:
        in_channels: channels C of the input.
        out_channels: channels of the output.

    Parameters: ``weight`` (out, C), ``scale`` (out), ``shift`` (out): out·(C + 2) in all.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        if in_channels < 1 or out_channels < 1:
            raise ModelOptionError(
                f"ImagePool needs in_channels and out_channels >= 1, got {in_channels}, "
                f"{out_channels}")
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels))
        self.scale = nn.Parameter(torch.ones(out_channels))
        self.shift = nn.Parameter(torch.zeros(out_channels))
        # as a 1×1 convolution: fan-in C, Kaiming-normal for the ReLU after it
        nn.init.normal_(self.weight, 0.0, math.sqrt(2.0 / in_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C, *spatial) -> (N, out, *spatial): the same vector at every position."""
        if x.dim() < 3 or x.shape[1] != self.in_channels:
            raise ModelInputError(
                f"ImagePool expects (N, {self.in_channels}, *spatial), got {tuple(x.shape)}: "
                f"build it with in_channels={x.shape[1] if x.dim() >= 3 else 'C'}")
        mean = x.mean(dim=tuple(range(2, x.dim())))
        return broadcast_over(image_pool_features(mean, self.weight, self.scale, self.shift), x)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}"
