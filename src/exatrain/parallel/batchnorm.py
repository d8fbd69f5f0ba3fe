"""BatchNorm whose statistics span every rank that holds part of the batch (or of a sample).

Serial BatchNorm normalises with the mean and variance of the whole batch. Split the batch over
data-parallel replicas (`data`, `shard`) or each sample over spatial ranks (`space`), and each rank
sees only part of it: per-rank statistics would train a different model from the serial one (and
one that changes with the number of ranks). Here the statistics are combined exactly over `axis`.

Communication per BatchNorm layer and training forward/backward, C channels, R ranks of `axis`:
  forward   all-gather of (count, mean, M2) per channel in float64:  R × (2C + 1) × 8 bytes
  backward  all-reduce of (Σ dy, Σ dy·x̂) per channel:               2C × element bytes
Evaluation with running statistics is local. Tag "batchnorm" on the ledger.

`GlobalBatchNorm` replaces `nn.BatchNorm1d/2d/3d` where the batch is split but samples are whole
(`parallel.batchnorm = "global"`, the default); under `space` the spatial layers do the same with
their `SpatialBatchNorm`. `"replica"` keeps torch's per-replica statistics (DDP's behaviour: no
communication, but results depend on the number of replicas).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import Axis, all_gather_into, all_reduce

class BatchNormStats(torch.autograd.Function):
    """Training-mode BatchNorm with statistics over every rank of `axis`.

    Forward: per channel, local count, mean and M2 = Σ (x - mean)² (torch's Welford kernel),
    all-gathered in float64 and combined exactly (Chan et al.):
        mean = Σ n_r m_r / N,   M2 = Σ M2_r + Σ n_r (m_r - mean)²,   var = M2 / N.
    Backward (x̂ = (x - mean)/σ): all-reduce of (Σ dy, Σ dy·x̂), then
        dx = γ/σ · (dy - Σdy/N - x̂ · Σ(dy·x̂)/N);  dγ = Σ dy·x̂,  dβ = Σ dy  (local partial sums).
    The normalisation runs in torch's fused kernel (F.batch_norm with the global statistics) and
    the backward in place, keeping the layout of x (channels-last stays channels-last).
    Returns (y, mean, biased var, N); mean/var/N are for the running statistics.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, axis: Axis):
        c = x.shape[1]
        n = x.numel() // c
        # local mean and 1/sqrt(var + eps) from torch's fused kernel, 8x faster than var_mean over
        # a channels-last tensor on CPU even though its normalised output is discarded (one pass);
        # the variance back from it in float64
        _, mean, invstd = torch.native_batch_norm(x, None, None, None, None, True, 0.0, eps)
        var = (invstd.double() ** -2 - eps).clamp_min(0.0)
        local = torch.cat([torch.full((1,), float(n), dtype=torch.float64, device=x.device),
                           mean.double(), var * n])
        if axis.size > 1:
            stats = local.new_empty(axis.size * local.numel())
            all_gather_into(stats, local, axis, tag="batchnorm")
            stats = stats.view(axis.size, -1)
        else:
            stats = local.view(1, -1)
        counts, means, m2 = stats[:, :1], stats[:, 1:c + 1], stats[:, c + 1:]
        total = counts.sum()
        gmean = (counts * means).sum(0) / total
        gvar = (m2.sum(0) + (counts * (means - gmean) ** 2).sum(0)) / total
        mean_x = gmean.to(x.dtype)
        var_x = gvar.to(x.dtype)
        invstd = torch.rsqrt(var_x + eps)
        # the normalisation itself with given statistics: torch's fused inference kernel
        y = F.batch_norm(x, mean_x, var_x, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(x, weight, mean_x, invstd, total)
        ctx.axis = axis  # the count stays a tensor: reading it would make the host wait
        ctx.mark_non_differentiable(mean_x, var_x, total)
        return y, mean_x, var_x, total

    @staticmethod
    def backward(ctx, grad, _gmean, _gvar, _total):
        x, weight, mean, invstd, total = ctx.saved_tensors
        c = x.shape[1]
        shape = (1, c) + (1,) * (x.dim() - 2)
        dims = [0] + list(range(2, x.dim()))
        grad = grad.contiguous(memory_format=_layout(x))
        centred = x - mean.view(shape)
        sum_dy = grad.sum(dims)
        sum_dy_xhat = (grad * centred).sum(dims) * invstd
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])
            all_reduce(sums, ctx.axis, tag="batchnorm")
            sums = sums / total.to(sums.dtype)
            g_dy, g_dy_xhat = sums[:c], sums[c:]
            scale = invstd if weight is None else invstd * weight
            # dx = scale·(dy - ḡ_dy - x̂·ḡ_dy·x̂) = scale·dy - [(x - μ)·scale·σ⁻¹·ḡ_dy·x̂ + scale·ḡ_dy],
            # computed in place in the buffer of (x - μ): four passes, no other full-size temporary
            grad_x = (centred.mul_((scale * invstd * g_dy_xhat).view(shape))
                      .add_((scale * g_dy).view(shape)).neg_().addcmul_(grad, scale.view(shape)))
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat
        if ctx.needs_input_grad[2]:
            grad_b = sum_dy
        return grad_x, grad_w, grad_b, None, None


def _layout(x: torch.Tensor) -> torch.memory_format:
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def update_running_stats(bn: nn.Module, mean: torch.Tensor, var: torch.Tensor, count) -> None:
    """Serial BatchNorm's running-statistics update with global (biased) `var` of `count` values:
    the running variance takes the unbiased variance, the momentum None means a cumulative mean."""
    with torch.no_grad():  # on the device: nothing here is read by the host
        bn.num_batches_tracked.add_(1)
        factor = (1.0 / bn.num_batches_tracked.to(mean.dtype) if bn.momentum is None
                  else bn.momentum)
        n = torch.as_tensor(count, device=var.device).to(var.dtype)
        unbiased = var * (n / (n - 1).clamp_min(1))
        bn.running_mean.mul_(1 - factor).add_(mean * factor)
        bn.running_var.mul_(1 - factor).add_(unbiased * factor)


def take_over_batchnorm(layer: nn.Module, bn: nn.Module) -> None:
    """Give `layer` the parameters, buffers (same state-dict keys) and settings of `bn`."""
    layer.weight, layer.bias = bn.weight, bn.bias
    layer.eps, layer.momentum = bn.eps, bn.momentum
    layer.num_features, layer.affine = bn.num_features, bn.affine
    layer.track_running_stats = bn.track_running_stats
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        layer.register_buffer(name, getattr(bn, name))


class GlobalBatchNorm(nn.Module):
    """A BatchNorm layer (same parameters, buffers and state-dict keys) whose training-mode
    statistics are over every rank of `axis`; evaluation uses the running statistics locally."""

    is_norm_layer = True  # computes in fp32 under mixed precision, as torch's norms (precision.py)
    keeps_buffers_equal = True  # its running statistics come from global ones (replica_buffers.py)

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, axis: Axis):
        super().__init__()
        self.axis = axis
        take_over_batchnorm(self, bn)

    def extra_repr(self) -> str:
        return f"{self.num_features}, statistics over {self.axis.size} ranks"

    def forward(self, x):
        if not self.training and self.running_mean is not None:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        y, mean, var, count = BatchNormStats.apply(x, self.weight, self.bias, self.eps, self.axis)
        if self.training and self.track_running_stats:
            update_running_stats(self, mean, var, count)
        return y


def globalise_batchnorm(model: nn.Module, axis: Axis) -> nn.Module:
    """Replace every BatchNorm of `model` (in place; returned) by a `GlobalBatchNorm` over `axis`."""
    if axis.size == 1:
        return model
    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(model, name, GlobalBatchNorm(child, axis))
        elif getattr(child, "keeps_local_batchnorm", False):
            continue  # its norms already see the whole batch (parallel.branches)
        else:
            globalise_batchnorm(child, axis)
    if isinstance(model, nn.modules.batchnorm._BatchNorm):
        return GlobalBatchNorm(model, axis)
    return model
