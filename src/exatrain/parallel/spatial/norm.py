"""Normalisation layers for the `space` axis: BatchNorm, GroupNorm / InstanceNorm, LayerNorm /
RMSNorm, each with the statistics serial torch computes (over the whole sample, or per voxel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm import all_reduce
from ..batchnorm import BatchNormStats, take_over_batchnorm, update_running_stats
from .functions import AllReduceSum
from .layers import SpatialLayer
from ...errors import SpatialSplitError

class SpatialBatchNorm(SpatialLayer):
    """BatchNorm1d/2d/3d with statistics over the whole batch and the whole sample.

    Split: statistics over every data and spatial rank (`data+space`); replicated (after a gather,
    where the spatial ranks hold identical tensors): over the data ranks. Running statistics are
    updated with the global mean and the unbiased global variance, as serial BatchNorm does.
    Evaluation with running statistics is local and needs no communication.
    """

    is_norm_layer = True  # computes in fp32 under mixed precision, as torch's norms (precision.py)

    def __init__(self, bn: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(bn, name, runtime, may_gather)
        take_over_batchnorm(self, bn)

    def describe(self) -> str:
        return f"{self.num_features} features"

    def forward(self, x):
        rt = self.runtime
        mode, x = self.enter_whole(x)
        use_batch = self.training or self.running_mean is None
        if not use_batch:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        axis = rt.batch_axis if mode == "split" else rt.data_axis
        y, mean, var, count = BatchNormStats.apply(x, self.weight, self.bias, self.eps, axis)
        if self.training and self.track_running_stats:
            update_running_stats(self, mean, var, count)
        return y


class SpatialGroupNorm(SpatialLayer):
    """GroupNorm and InstanceNorm1d/2d/3d with each sample's statistics over its whole domain.

    Split: per sample and group, the block's sum and sum of squares in float64, summed over
    `space` (`AllReduceSum`: every block's output uses them, so their gradients are summed
    back), then mean = S1 / M, var = S2 / M - mean² (M: the group's elements in the whole
    sample, biased as torch's) and y = (x - mean) / sqrt(var + eps) · weight + bias on the
    block. Replicated (after a gather): the plain op, or the same sums without the all-reduce
    where running statistics are kept.
    Communication: one all-reduce of 2 × N × G float64 forward and one backward, 16 N G bytes
    each per rank (tag "norm"; G = channels for InstanceNorm).

    InstanceNorm with track_running_stats=True, in training: serial torch updates
    running ← (1 - momentum) running + momentum · mean over the batch of each sample's mean
    (and unbiased variance, M / (M - 1)), so the per-sample statistics (already whole-sample
    here) are summed over the local batch and all-reduced over the data replicas with the
    BatchNorm statistics' axes (`runtime.data_axis`): one all-reduce of 2 C + 1 float64,
    16 C + 8 bytes (tag "norm"), no backward; every rank then holds the serial buffers.
    momentum=None updates nothing, as in torch. In evaluation the running statistics
    normalise each voxel locally, with no communication.
    """

    is_norm_layer = True  # computes in fp32 under mixed precision, as torch's norms (precision.py)

    def __init__(self, norm: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(norm, name, runtime, may_gather)
        if isinstance(norm, nn.GroupNorm):
            self.groups, self.num_channels = norm.num_groups, norm.num_channels
        else:
            self.groups = self.num_channels = norm.num_features
            self.momentum = norm.momentum
        keys = ("running_mean", "running_var", "num_batches_tracked")
        for key in keys:  # InstanceNorm's buffers (None without running statistics), same keys
            self.register_buffer(key, getattr(norm, key, None))
        self.eps = norm.eps
        self.weight, self.bias = norm.weight, norm.bias  # None without affine, as in torch

    def describe(self) -> str:
        return f"{self.num_channels} channels in {self.groups} groups"

    def forward(self, x):
        rt = self.runtime
        mode, x = self.enter_whole(x)
        running = self.running_mean is not None
        if running and not self.training:  # the running statistics: per voxel, local
            return F.instance_norm(x, self.running_mean, self.running_var, self.weight,
                                   self.bias, False, 0.0, self.eps)
        if mode != "split" and not running:
            return self.replicated_forward(x)
        n, c = x.shape[:2]
        xg = x.reshape(n, self.groups, -1)
        sums = torch.stack([xg.sum(-1, dtype=torch.float64),
                            (xg * xg).sum(-1, dtype=torch.float64)])
        count = xg.shape[-1]
        if mode == "split":
            sums = AllReduceSum.apply(sums, rt.space, "norm")
            count *= rt.size  # equal blocks
        mean = sums[0] / count
        var = (sums[1] / count - mean * mean).clamp_min(0.0)
        if running and self.momentum:
            self._update_running_stats(mean.detach(), var.detach(), count)
        rstd = torch.rsqrt(var + self.eps)
        y = ((xg - mean.to(x.dtype)[..., None]) * rstd.to(x.dtype)[..., None]).reshape(x.shape)
        if self.weight is not None:
            shape = (1, c) + (1,) * (x.dim() - 2)
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        """Serial InstanceNorm's update from each sample's whole-volume (N, C) statistics."""
        unbiased = var * (count / max(count - 1, 1))
        totals = torch.cat([mean.sum(0), unbiased.sum(0),
                            mean.new_tensor([float(mean.shape[0])])])
        all_reduce(totals, self.runtime.data_axis, tag="norm")
        c, m = mean.shape[1], self.momentum
        batch = totals[-1]
        self.running_mean.mul_(1 - m).add_((totals[:c] / batch * m).to(self.running_mean.dtype))
        self.running_var.mul_(1 - m).add_((totals[c:2 * c] / batch * m).to(self.running_var.dtype))

    def replicated_forward(self, x):
        return F.group_norm(x, self.groups, self.weight, self.bias, self.eps)


class SpatialLayerNorm(SpatialLayer):
    """LayerNorm / RMSNorm over channels (channels-last, as ConvNeXt blocks use it): statistics
    per voxel over its normalized trailing dims, which are local to each block when none of them
    is split. Block-local, no communication; its weight's gradient is the block's partial sum.

    A split dim among the normalised ones would need the whole sample: on a block it is 1/P of
    the sample's length, so the input's trailing dims do not match normalized_shape, and that
    is refused by name at the first forward (GroupNorm(1, C) is the per-sample norm over
    (C, *spatial) exatrain splits).
    """

    is_norm_layer = True

    def __init__(self, norm: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(norm, name, runtime, may_gather)
        self.rms = isinstance(norm, nn.RMSNorm)
        self.normalized_shape, self.eps = tuple(norm.normalized_shape), norm.eps
        self.weight, self.bias = norm.weight, getattr(norm, "bias", None)

    def describe(self) -> str:
        return f"normalized_shape {self.normalized_shape}"

    def plan(self, shape):
        k = len(self.normalized_shape)
        if tuple(shape[-k:]) != self.normalized_shape:
            raise SpatialSplitError(
                f"{self.source_type} '{self.qualname}' normalises over the last {k} dims "
                f"{list(self.normalized_shape)}, but on this rank's spatial block its input is "
                f"{list(shape)}: a dim it normalises over is split by space="
                f"{self.runtime.parts}, so its statistics would need the whole sample. Normalise "
                f"over channels only (permute to channels-last, LayerNorm(C)), use "
                f"nn.GroupNorm(1, C) for a per-sample norm over (C, *spatial), or space=(1, 1, 1).")
        return ()

    def replicated_forward(self, x):
        if self.rms:
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
