"""Autograd Functions of spatial parallelism (besides the halo exchange in `comm.halo`).

Every Function here is one communication pattern over a `comm.Axis`; the byte counts follow the
ledger's payload convention (per rank). S is the number of spatial ranks of one sample, B×C the
batch and channels, `block` the local spatial extent, C the channels of a norm layer.

  GatherBlocks     blocks -> whole tensor on every spatial rank      all-gather, S × block bytes
                   backward: own block's slice (no communication)
  SplitBlocks      whole tensor -> own block (no communication)
                   backward: all-gather of the block gradients, S × block bytes
  SumOverAxis      forward all-reduce (sum), backward identity       all-reduce, tensor bytes
  BatchNormStats   BatchNorm over every rank holding part of the batch or of a sample:
                   forward all-gather of (count, mean, M2) per channel, S' × (2C + 1) × 8 bytes;
                   backward all-reduce of (Σ dy, Σ dy·x̂) per channel, 2C × element bytes
  shared_mask      a dropout mask drawn on one rank and broadcast, mask bytes

Why the gather's backward needs no communication: the layers after a gather run redundantly on
every spatial rank, on identical inputs, so every rank ends up with the same, complete gradient of
the gathered tensor; the exact gradient of a rank's block is its own slice of it. The parameters of
those redundant layers get the complete gradient on every spatial rank, so their gradients are
scaled by 1/S before the data-parallel all-reduce sums them over the spatial ranks (see
`exatrain.parallel.spatial`), which then counts them exactly once.
"""

from __future__ import annotations

import torch

from ...comm import Axis, all_gather_into, all_reduce, broadcast


def _block_slices(full_shape, parts, coords) -> tuple[slice, ...]:
    k = len(parts)
    lead = [slice(None)] * (len(full_shape) - k)
    spans = []
    for n, p, c in zip(full_shape[-k:], parts, coords):
        b = n // p
        spans.append(slice(c * b, (c + 1) * b))
    return tuple(lead + spans)


def gather_blocks_(x: torch.Tensor, axis: Axis, parts: tuple[int, ...]) -> torch.Tensor:
    """All-gather the blocks of the last len(parts) dims (row-major rank order) into one tensor."""
    k = len(parts)
    x = x.contiguous()
    out = x.new_empty((axis.size * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_into(out, x, axis, tag="gather")
    lead, block = tuple(x.shape[:-k]), tuple(x.shape[-k:])
    out = out.view(tuple(parts) + lead + block)
    # (P1..Pk, lead..., b1..bk) -> (lead..., P1, b1, ..., Pk, bk)
    nl = len(lead)
    order = list(range(k, k + nl))
    for i in range(k):
        order += [i, k + nl + i]
    out = out.permute(order)
    return out.reshape(lead + tuple(p * b for p, b in zip(parts, block)))


class GatherBlocks(torch.autograd.Function):
    """Spatial blocks -> the whole tensor on every spatial rank; backward keeps the own block.

    Communication: one all-gather over the space axis, S × block bytes per rank; none backward.
    """

    @staticmethod
    def forward(ctx, x, axis: Axis, parts: tuple[int, ...], coords: tuple[int, ...]):
        ctx.parts, ctx.coords = parts, coords
        return gather_blocks_(x, axis, parts)

    @staticmethod
    def backward(ctx, grad):
        own = grad[_block_slices(grad.shape, ctx.parts, ctx.coords)]
        return own.contiguous(), None, None, None


class SplitBlocks(torch.autograd.Function):
    """The whole tensor -> this rank's block; backward all-gathers the block gradients.

    Communication: none forward; one all-gather over the space axis backward, S × block bytes.
    """

    @staticmethod
    def forward(ctx, x, axis: Axis, parts: tuple[int, ...], coords: tuple[int, ...]):
        ctx.axis, ctx.parts = axis, parts
        return x[_block_slices(x.shape, parts, coords)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_blocks_(grad, ctx.axis, ctx.parts), None, None, None


class SumOverAxis(torch.autograd.Function):
    """Sum of per-rank partial values, on every rank; backward: identity (each rank its own term).

    For a quantity L = Σ_r l_r whose terms live on different ranks (a loss over a partitioned
    output, a global average pool): every rank sees the total, and backpropagates only its own
    term, whose parameter gradients the data-parallel all-reduce then sums.
    Communication: one all-reduce of the tensor forward; none backward.
    """

    @staticmethod
    def forward(ctx, x, axis: Axis, tag: str = "loss"):
        out = x.clone()
        all_reduce(out, axis, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def sum_over_axis(x: torch.Tensor, axis: Axis, tag: str = "loss") -> torch.Tensor:
    return x if axis.size == 1 else SumOverAxis.apply(x, axis, tag)


class BatchNormStats(torch.autograd.Function):
    """Training-mode BatchNorm with statistics over every rank of `axis` (data × space).

    Forward: per channel, local count, mean and M2 = Σ (x - mean)² (a two-pass, accurate local
    variance), all-gathered in float64 and combined exactly (Chan et al.):
        mean = Σ n_r m_r / N,   M2 = Σ M2_r + Σ n_r (m_r - mean)²,   var = M2 / N.
    Backward (x̂ = (x - mean)/σ): all-reduce of (Σ dy, Σ dy·x̂), then
        dx = γ/σ · (dy - Σdy/N - x̂ · Σ(dy·x̂)/N);  dγ = Σ dy·x̂,  dβ = Σ dy  (local partial sums).
    Returns (y, mean, biased var, N); mean/var/N are for the running statistics.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, axis: Axis):
        c = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        n = x.numel() // c
        var, mean = torch.var_mean(x, dim=dims, unbiased=False)
        local = torch.cat([torch.full((1,), float(n), dtype=torch.float64, device=x.device),
                           mean.double(), var.double() * n])
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
        invstd = torch.rsqrt(gvar + eps).to(x.dtype)
        shape = (1, c) + (1,) * (x.dim() - 2)
        scale = invstd if weight is None else invstd * weight
        y = (x - mean_x.view(shape)) * scale.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(x, weight, mean_x, invstd)
        ctx.axis, ctx.total = axis, float(total)
        gvar = gvar.to(x.dtype)
        ctx.mark_non_differentiable(mean_x, gvar, total)
        return y, mean_x, gvar, total

    @staticmethod
    def backward(ctx, grad, _gmean, _gvar, _total):
        x, weight, mean, invstd = ctx.saved_tensors
        c = x.shape[1]
        shape = (1, c) + (1,) * (x.dim() - 2)
        dims = [0] + list(range(2, x.dim()))
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        sum_dy = grad.sum(dims)
        sum_dy_xhat = (grad * xhat).sum(dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])
            all_reduce(sums, ctx.axis, tag="batchnorm")
            g_dy, g_dy_xhat = sums[:c] / ctx.total, sums[c:] / ctx.total
            scale = invstd if weight is None else invstd * weight
            grad_x = (grad - g_dy.view(shape) - xhat * g_dy_xhat.view(shape)) * scale.view(shape)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat
        if ctx.needs_input_grad[2]:
            grad_b = sum_dy
        return grad_x, grad_w, grad_b, None, None


def shared_mask(shape, keep: float, axis: Axis, like: torch.Tensor) -> torch.Tensor:
    """A dropout mask (values 0 or 1/keep) drawn on the axis's first rank and broadcast to all."""
    mask = torch.empty(shape, dtype=like.dtype, device=like.device)
    if axis.rank == 0:
        mask.bernoulli_(keep)
    broadcast(mask, axis, src=0, tag="dropout")
    return mask.div_(keep)


class ScaleGrad:
    """A tensor hook multiplying a gradient by a constant (1/S for parameters run redundantly)."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.factor

    def __repr__(self) -> str:
        return f"ScaleGrad({self.factor:g})"

