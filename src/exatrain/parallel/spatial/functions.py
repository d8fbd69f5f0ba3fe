"""Autograd Functions of spatial parallelism (besides the halo exchange in `comm.halo`).

Every Function here is one communication pattern over a `comm.Axis`; the byte counts follow the
ledger's payload convention (per rank). S is the number of spatial ranks of one sample, B×C the
batch and channels, `block` the local spatial extent, C the channels of a norm layer.

  GatherBlocks     blocks -> whole tensor on every spatial rank      all-gather, S × block bytes
                   (tag "gather"; "output" for a whole-sample model's output)
                   backward: own block's slice (no communication)
  SplitBlocks      whole tensor -> own block (no communication)
                   backward: all-gather of the block gradients, S × block bytes (tag "gather";
                   "output" at a segmentation model's output after a tensor switch: the whole
                   output gradient, N × C_out × V_out × s bytes)
  SumOverAxis      forward all-reduce (sum), backward identity       all-reduce, tensor bytes
  AllReduceSum     forward all-reduce (sum), backward all-reduce     2 × tensor bytes (norms)
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


def gather_blocks_(x: torch.Tensor, axis: Axis, parts: tuple[int, ...],
                   tag: str = "gather") -> torch.Tensor:
    """All-gather the blocks of the last len(parts) dims (row-major rank order) into one tensor."""
    k = len(parts)
    x = x.contiguous()
    out = x.new_empty((axis.size * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_into(out, x, axis, tag=tag)
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

    Communication: one all-gather over the space axis, S × block bytes per rank, under `tag`
    ("gather"; "output" where a model on whole samples hands its split output back whole);
    none backward.
    """

    @staticmethod
    def forward(ctx, x, axis: Axis, parts: tuple[int, ...], coords: tuple[int, ...],
                tag: str = "gather"):
        ctx.parts, ctx.coords = parts, coords
        return gather_blocks_(x, axis, parts, tag)

    @staticmethod
    def backward(ctx, grad):
        own = grad[_block_slices(grad.shape, ctx.parts, ctx.coords)]
        return own.contiguous(), None, None, None, None


class SplitBlocks(torch.autograd.Function):
    """The whole tensor -> this rank's block; backward all-gathers the block gradients.

    Communication: none forward; one all-gather over the space axis backward, S × block bytes,
    under `tag` ("gather"; "output" where it cuts a segmentation model's output back into blocks
    after a switch to channel/filter parallelism).
    """

    @staticmethod
    def forward(ctx, x, axis: Axis, parts: tuple[int, ...], coords: tuple[int, ...],
                tag: str = "gather"):
        ctx.axis, ctx.parts, ctx.tag = axis, parts, tag
        return x[_block_slices(x.shape, parts, coords)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_blocks_(grad, ctx.axis, ctx.parts, ctx.tag), None, None, None, None


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


class AllReduceSum(torch.autograd.Function):
    """Sum of per-rank partial values, on every rank, where every rank's block then uses the sum
    (the statistics of a norm over the whole sample): backward sums the gradients too, since the
    sum's gradient is the total of every block's use of it.
    Communication: one all-reduce of the tensor forward and one backward (tensor bytes each).
    """

    @staticmethod
    def forward(ctx, x, axis: Axis, tag: str = "norm"):
        ctx.axis, ctx.tag = axis, tag
        out = x.clone()
        all_reduce(out, axis, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.axis, tag=ctx.tag)
        return grad, None, None


def sum_over_axis(x: torch.Tensor, axis: Axis, tag: str = "loss") -> torch.Tensor:
    return x if axis.size == 1 else SumOverAxis.apply(x, axis, tag)


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

