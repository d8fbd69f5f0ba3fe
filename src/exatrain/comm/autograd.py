"""Differentiable collectives over one mesh Axis, each a small autograd Function.

Every collective goes through `exatrain.comm`, so the ledger counts it (forward and backward). On an
axis of size 1 each function is the identity and records nothing.

Notation: `P` = the axis size, `x` the local input, `s(t)` its bytes. Bytes follow the ledger's
payload convention (`comm.ledger`): all_reduce = the tensor, all_gather = the gathered output,
reduce_scatter = the full input.

| function              | forward                   | backward                      | bytes fwd / bwd |
|-----------------------|---------------------------|-------------------------------|-----------------|
| copy_to(x)            | identity                  | all-reduce (sum) of the grad  | 0 / s(x)        |
| reduce_from(x)        | all-reduce (sum)          | identity                      | s(x) / 0        |
| gather(x, dim)        | all-gather along dim      | own chunk (grad replicated)   | P·s(x) / 0      |
| scatter(x, dim)       | own chunk                 | all-gather along dim          | 0 / s(x)        |

`copy_to`/`reduce_from` are Megatron's f and g; `scatter`/`gather` move replicated activations into and out of a split layout. `gather` and
`scatter` assume that the tensor they see in backward (the gradient of a gathered output, or of a
replicated input) is identical on every member, which holds when the computation downstream is
replicated over the axis; that is how the strategies use them.

Each backward is its dual's forward (`copy_to` <-> `reduce_from`, `gather` <-> `scatter`), called
as that Function when gradients are enabled in the backward: under `create_graph=True` (a model
whose forward differentiates, forces as -dE/dx) the backward is itself differentiable, so the
second derivative crosses the split layers as it does one process's; otherwise it runs as a
plain collective, at the same bytes. Such a step moves about twice the table's bytes (the
derivative's backward inside the forward, and the duals in the loss's backward), which the
layers' `bytes_per_step` formulas do not count.

`scatter` and `gather` need the dim divisible by P (`scatter` raises a ValueError naming the sizes
otherwise); the strategies pad ragged batches before calling them.
"""

from __future__ import annotations

import torch

from .collectives import Axis, all_gather_into, all_reduce, reduce_scatter_into


# ------------------------------------------------------------------ plain (non-autograd) helpers
def all_gather_dim(x: torch.Tensor, axis: Axis, dim: int, tag: str = "act") -> torch.Tensor:
    """Concatenate every member's `x` along `dim` (all members pass equal shapes)."""
    if axis.size == 1:
        return x
    dim = dim % x.dim()
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((axis.size * front.shape[0], *front.shape[1:]))
    all_gather_into(out, front, axis, tag=tag)
    return out if dim == 0 else out.movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, axis: Axis, dim: int, tag: str = "act") -> torch.Tensor:
    """Sum `x` over the members and keep this member's chunk along `dim`."""
    if axis.size == 1:
        return x
    dim = dim % x.dim()
    _check_divisible(x, axis, dim)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // axis.size, *front.shape[1:]))
    reduce_scatter_into(out, front, axis, tag=tag)
    return out.movedim(0, dim)


def chunk_dim(x: torch.Tensor, axis: Axis, dim: int) -> torch.Tensor:
    """This member's chunk of `x` along `dim` (a view; no communication)."""
    if axis.size == 1:
        return x
    _check_divisible(x, axis, dim)
    return x.chunk(axis.size, dim)[axis.rank]


def _check_divisible(x: torch.Tensor, axis: Axis, dim: int) -> None:
    if x.shape[dim] % axis.size:
        raise ValueError(
            f"cannot split dim {dim} of size {x.shape[dim]} (tensor {tuple(x.shape)}) evenly over "
            f"the {axis.size} ranks of axis {axis.name!r} (rank {axis.rank} of it); use sizes that "
            f"are multiples of {axis.size} or a smaller degree on that axis.")


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` as a tensor of its own, for an autograd Function to return: a Function's output that
    is a view may not be modified in place (a `nn.ReLU(inplace=True)` right after a gathered
    layer raises "Output 0 of _Gather is a view and is being modified inplace"), so a view is
    copied, in contiguous layout (where the layer after it would copy it anyway)."""
    return t if t._base is None else t.contiguous() if not t.is_contiguous() else t.clone()


# ------------------------------------------------------------------ autograd Functions
class _CopyTo(torch.autograd.Function):
    """Forward identity; backward all-reduce (sum) of the gradient. Bytes: 0 / s(x)."""

    @staticmethod
    def forward(ctx, x, axis, tag):
        ctx.axis, ctx.tag = axis, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_from(grad, ctx.axis, ctx.tag), None, None


class _ReduceFrom(torch.autograd.Function):
    """Forward all-reduce (sum); backward identity. Bytes: s(x) / 0."""

    @staticmethod
    def forward(ctx, x, axis, tag):
        ctx.axis, ctx.tag = axis, tag
        out = x.clone(memory_format=torch.contiguous_format)  # never reduce the caller's x
        all_reduce(out, axis, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad):
        return copy_to(grad, ctx.axis, ctx.tag), None, None


class _Gather(torch.autograd.Function):
    """Forward all-gather along dim; backward keeps this member's chunk. Bytes: P·s(x) / 0."""

    @staticmethod
    def forward(ctx, x, axis, dim, tag):
        ctx.axis, ctx.dim, ctx.tag = axis, dim, tag
        return _own(all_gather_dim(x, axis, dim, tag))

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():   # create_graph=True: the backward's own graph, via scatter
            return scatter(grad, ctx.axis, ctx.dim, ctx.tag), None, None, None
        return chunk_dim(grad, ctx.axis, ctx.dim), None, None, None


class _Scatter(torch.autograd.Function):
    """Forward keeps this member's chunk along dim; backward all-gathers. Bytes: 0 / s(x)."""

    @staticmethod
    def forward(ctx, x, axis, dim, tag):
        ctx.axis, ctx.dim, ctx.tag = axis, dim, tag
        return _own(chunk_dim(x, axis, dim))

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():   # create_graph=True: the backward's own graph, via gather
            return gather(grad, ctx.axis, ctx.dim, ctx.tag), None, None, None
        return all_gather_dim(grad, ctx.axis, ctx.dim, ctx.tag), None, None, None


# ------------------------------------------------------------------ public face
def copy_to(x: torch.Tensor, axis: Axis, tag: str = "act") -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    return x if axis.size == 1 else _CopyTo.apply(x, axis, tag)


def reduce_from(x: torch.Tensor, axis: Axis, tag: str = "act") -> torch.Tensor:
    """Megatron's g: all-reduce (sum) forward, identity backward."""
    return x if axis.size == 1 else _ReduceFrom.apply(x, axis, tag)


def gather(x: torch.Tensor, axis: Axis, dim: int, tag: str = "act") -> torch.Tensor:
    """All-gather along `dim`; the backward keeps this member's chunk of the (replicated) grad."""
    return x if axis.size == 1 else _Gather.apply(x, axis, dim, tag)


def scatter(x: torch.Tensor, axis: Axis, dim: int, tag: str = "act") -> torch.Tensor:
    """This member's chunk along `dim` of a replicated tensor; backward all-gathers the grads."""
    return x if axis.size == 1 else _Scatter.apply(x, axis, dim, tag)


__all__ = ["all_gather_dim", "chunk_dim", "copy_to", "gather", "reduce_from",
           "reduce_scatter_dim", "scatter"]
