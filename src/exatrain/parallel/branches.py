"""Sub-graph parallelism: the branches of an `et.Branches` run side by side on the data ranks.

With `parallel.branches = "data"`, each `Branches` container of the model is replaced by a
`SplitBranches` holding the same branches (same parameter names). Its P = `data` ranks hold
different samples (b each), so the container redistributes work from samples to branches:

  1. all-gather the input along the batch over `data`            every rank: the P·b samples
  2. rank r runs only its branches (greedy longest-processing-time on parameter count), on all
     P·b samples; a rank without branches computes nothing
  3. ONE reduce-scatter along the batch returns each rank its own b samples of the combination:
     "sum" reduces the ranks' partial sums; "concat" writes each branch's output into its own
     channel slot of a zero tensor, so the sum over ranks is the concatenation

Backward is the adjoint: the reduce-scatter's backward all-gathers the output gradient, and the
all-gather's backward reduce-scatters the input gradient (every rank's branches contributed to
every sample's input gradient). A branch's weight gradient is complete on its owner (it saw all
P·b samples) and zero elsewhere, so the data-parallel mean over P gives exactly the serial
gradient; non-owners add a zero-weighted term so DDP sees every parameter used. BatchNorm inside
a branch sees the whole global batch, so its statistics are the serial ones without a collective
(`keeps_local_batchnorm` tells `globalise_batchnorm` to leave it), and the owner broadcasts the
branch's buffers (running statistics) after each training forward so every rank holds them.

Ordering with DDP: the gradient buckets' all-reduces share the data group with the collectives
above. Every rank issues them in the same order, because the graph outside the block is the same
on every rank and inside it every branch parameter's gradient (real on the owner, the zero term
elsewhere) is ready between the two backward collectives of the block.

Bytes per rank and call (ledger convention, 4-byte floats; x: the input, y: the combined output,
b samples per rank, P ranks; tag "branch"):

  forward    all-gather  P·s(x)        reduce-scatter  P·s(y)
  backward   all-gather  P·s(y)        reduce-scatter  P·s(x)     (when the input needs a grad)
  buffers    8 · Σ_branches (buffer elements)  broadcast (as float64), training forward only

against no communication at all for data parallelism in this block. Compute per rank is the
branches' total on b samples when they balance (the same as data parallelism); what it buys is
that each branch's work runs at batch P·b (better device efficiency at small b) and only its
owner stores its activations. It pays when the per-rank batch is too small to keep a device
busy and the block's activations, not its input, dominate: see docs/how-to/branches.md.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import Axis, broadcast
from ..comm.autograd import all_gather_dim, reduce_scatter_dim
from ..models.branches import Branches
from ..errors import ConfigError


class _GatherBatch(torch.autograd.Function):
    """All-gather along dim 0; backward reduce-scatters the gradient (the adjoint)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return all_gather_dim(x.contiguous(), axis, 0, tag="branch")

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad.contiguous(), ctx.axis, 0, tag="branch"), None


class _ReduceScatterBatch(torch.autograd.Function):
    """Sum over ranks and keep this rank's chunk of dim 0; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, y, axis):
        ctx.axis = axis
        return reduce_scatter_dim(y.contiguous(), axis, 0, tag="branch")

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad.contiguous(), ctx.axis, 0, tag="branch"), None


def assign_branches(costs: list[int], ranks: int) -> list[int]:
    """Owner rank of each branch: greedy longest-processing-time (largest first, ties low)."""
    load, owner = [0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda j: (load[j], j))
        owner[i], load[r] = r, load[r] + costs[i]
    return owner


class SplitBranches(nn.ModuleList):
    """A `Branches` whose branches run on their owner ranks of `axis` (see the module doc)."""

    keeps_local_batchnorm = True
    keeps_buffers_equal = True   # its branches' buffers come from their owner ranks

    def __init__(self, source: Branches, axis: Axis):
        super().__init__(list(source))
        self.combine, self.axis = source.combine, axis
        costs = [sum(p.numel() for p in b.parameters()) or 1 for b in self]
        self.owner = assign_branches(costs, axis.size)
        self.mine = [i for i, r in enumerate(self.owner) if r == axis.rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        axis = self.axis
        full = _GatherBatch.apply(x, axis)
        outs = {i: self[i](full) for i in self.mine}
        if self.combine == "sum":
            y = sum(outs.values()) if outs else None
            if y is None:  # no branch here: zeros of the output's shape
                y = self._zeros_like_output(full)
        else:
            y = self._concat_slots(full, outs)
        y = y + self._unused_params_zero()
        if not self.mine:  # keep the input in the graph: its backward collective must run here too
            y = y + full.reshape(-1)[0] * 0.0
        out = _ReduceScatterBatch.apply(y, axis)
        if self.training:
            self._share_buffers()
        return out

    def _output_shapes(self, full: torch.Tensor) -> list[tuple[int, ...]]:
        """Every branch's output shape, from a meta-device run (no compute, no communication)."""
        shapes = getattr(self, "_shapes", None)
        key = tuple(full.shape)
        if shapes is None or shapes[0] != key:
            meta = torch.empty(key, device="meta", dtype=full.dtype)
            with torch.no_grad():
                outs = [torch.func.functional_call(b, {k: v.to("meta") for k, v in
                        list(b.named_parameters()) + list(b.named_buffers())}, (meta,))
                        for b in self]
            self._shapes = shapes = (key, [tuple(o.shape) for o in outs])
        return shapes[1]

    def _zeros_like_output(self, full):
        return full.new_zeros(self._output_shapes(full)[0])

    def _concat_slots(self, full, outs: dict) -> torch.Tensor:
        shapes = self._output_shapes(full)
        parts = [outs[i] if i in outs else full.new_zeros(s) for i, s in enumerate(shapes)]
        return torch.cat(parts, dim=1)

    def _unused_params_zero(self) -> torch.Tensor:
        """0 · (one element of each parameter this rank does not use): DDP then sees every
        parameter take part, and their (zero) gradients average to the owner's / P."""
        terms = [p[(0,) * p.dim()] * 0.0 for i, b in enumerate(self) if i not in self.mine
                 for p in b.parameters() if p.requires_grad]
        return sum(terms) if terms else 0.0

    @torch.no_grad()
    def _share_buffers(self) -> None:
        for i, branch in enumerate(self):
            buffers = list(branch.buffers())  # running statistics and batch counts
            if not buffers:
                continue
            flat = torch.cat([b.reshape(-1).double() for b in buffers])  # exact for both
            broadcast(flat, self.axis, src=self.owner[i], tag="buffers")
            if self.owner[i] == self.axis.rank:
                continue  # (its buffers may be saved for backward: never touch them)
            at = 0
            for b in buffers:
                b.copy_(flat[at:at + b.numel()].view_as(b))
                at += b.numel()

    def extra_repr(self) -> str:
        return f"combine={self.combine!r}, owners={self.owner}, axis={self.axis.name!r}"


def check_plan(plan, mode: str = "data") -> None:
    """Refuse, by name, what sub-graph parallelism does not support yet (before training)."""
    if mode != "data":
        raise ConfigError(f"parallel.branches={mode!r}: use 'none' or 'data'.")
    bad = {"pipe": plan.pipe, "shard": plan.shard, "space": plan.space_degree,
           "tensor": plan.tensor_degree}
    bad = {k: v for k, v in bad.items() if v > 1}
    if bad:
        names = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ConfigError(f"parallel.branches='data' runs under the data axis only; the plan has "
                          f"{names}. Set parallel.branches='none' or those axes to 1.")


def split_branches(model: nn.Module, axis: Axis) -> nn.Module:
    """Replace every `Branches` in `model` (in place; returned) by a `SplitBranches` over `axis`."""
    if axis.size == 1:
        return model
    if isinstance(model, Branches):
        return SplitBranches(model, axis)
    for name, child in list(model.named_children()):
        setattr(model, name, split_branches(child, axis))
    return model
