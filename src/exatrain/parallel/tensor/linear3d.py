"""3D parallel matrix multiply (AxoNN's algorithm) on the grid tensor_x × tensor_y × tensor_z.

A Linear y = x Wᵀ + b with W of shape (out, in) on a grid of X·Y·Z ranks, rank (i, j, k):

    activations  the batch is split over z (at the model's boundary, see tensor.py), the
                 features of a layer's input over its `in_axis`, of its output over `out_axis`
    weight       W is cut into blocks over (out_axis, in_axis); each block is sharded once more,
                 by rows, over z: rank (i, j, k) stores W[o-block][k-th sub-block, i-block]
    bias         split with the output features over out_axis, replicated over in_axis and z

A plain layer has out_axis = x and in_axis = y; a transposed one swaps them. The output of a
plain layer (features split over x) is exactly the input layout of a transposed one, so a plain
layer followed by a transposed one (an MLP's two Linears, or q/k/v and the attention output
projection, heads split over x) chains with no re-layout in between.

One layer, written for the plain orientation (`_Matmul3D`):

    forward   W_blk = all-gather_z(W_shard)                  (prefetched one layer ahead)
              y_blk = all-reduce_y(x_blk W_blkᵀ)             partial sums over the in-features
    backward  W_blk = all-gather_z(W_shard)                  (prefetched one layer behind)
              dx_blk = dy_blk W_blk → all-reduce_x, asynchronous, overlapped with
              dW_blk = dy_blkᵀ x_blk → reduce-scatter_z → dW_shard

Bytes per step per rank (ledger convention), n = local rows (tokens of this z-shard of the batch),
s bytes per element, o = out/|out_axis|, i = in/|in_axis|:

    z         3·o·i·s      two weight all-gathers (forward, backward) and one reduce-scatter
    in_axis   n·o·s        forward all-reduce of the partial outputs
    out_axis  n·i·s        backward all-reduce of the input gradient (when the input needs one)

Outside a chain (easy mode) a layer also converts replicated activations into and out of its
layout: `scatter_input` keeps this rank's in-feature chunk (backward: all-gather, n·in·s on
in_axis) and `gather_output` all-gathers the out-features (forward: n·out·s on out_axis).

Prefetch: the `Grid3D` records the order in which its layers first run; when a layer gathers its
weight it starts the asynchronous all-gather of the next layer's weight (the previous one in
backward). A prefetched weight is used only if the parameter has not changed since (its version
counter), so an optimizer step in between can never feed a stale weight.
"""

from __future__ import annotations

import torch
from torch import nn

from ...comm import Axis, all_gather_into, all_reduce, reduce_scatter_into
from ...comm.autograd import gather, scatter
from .linear1d import SharedInput, keep_frozen
from .state import shard_of
from ...errors import TensorSplitError


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


class Grid3D:
    """The axes of one 3D grid and the weight-prefetch state its layers share.

    `grid` is the whole tensor group (mesh.axis("tensor")), over which the squares of a weight's
    gradient norm are summed. `overlap`: overlap the input-gradient all-reduce with the weight-
    gradient GEMM. `prefetch`: prefetch the next layer's weight all-gather.
    """

    def __init__(self, x: Axis, y: Axis, z: Axis, grid: Axis, overlap: bool = True,
                 prefetch: bool = True):
        self.x, self.y, self.z, self.grid = x, y, z, grid
        self.overlap, self.prefetch = overlap, prefetch
        self.order: list[Linear3D] = []
        self._index: dict[int, int] = {}

    def weight(self, layer: "Linear3D", backward: bool) -> torch.Tensor:
        """The layer's weight block (o, i), gathered over z; prefetches its neighbour's."""
        w = layer._take_prefetched()
        if w is None:
            w = layer._gather_weight(async_op=False)[0]
        if self.prefetch and self.z.size > 1:
            neighbour = self._neighbour(layer, -1 if backward else 1)
            if neighbour is not None:
                neighbour._prefetch()
        return w

    def _neighbour(self, layer: "Linear3D", step: int) -> "Linear3D | None":
        i = self._index.get(id(layer))
        if i is None:
            if step < 0:
                return None
            i = self._index[id(layer)] = len(self.order)
            self.order.append(layer)
        j = i + step
        return self.order[j] if 0 <= j < len(self.order) else None


class _Matmul3D(torch.autograd.Function):
    """y_blk = all-reduce_in(x_blk · all-gather_z(W_shard)ᵀ); see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, layer):
        dtype = _compute_dtype(x)
        w = layer.grid.weight(layer, backward=False)
        with torch.autocast(x.device.type, enabled=False):
            y = torch.matmul(x.to(dtype), w.to(dtype).t())
        all_reduce(y, layer.in_axis, tag="act")
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.dtype = layer, dtype
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        layer, dtype = ctx.layer, ctx.dtype
        grid = layer.grid
        w = layer.grid.weight(layer, backward=True).to(dtype)
        grad_y = grad_y.to(dtype)
        grad_x = work = grad_w = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = torch.matmul(grad_y, w)
                work = all_reduce(grad_x, layer.out_axis, tag="act", async_op=grid.overlap)
            if ctx.needs_input_grad[1]:
                block = grad_y.reshape(-1, grad_y.shape[-1]).t().matmul(
                    x.to(dtype).reshape(-1, x.shape[-1])).to(weight.dtype)
                if grid.z.size > 1:
                    grad_w = torch.empty_like(weight)
                    reduce_scatter_into(grad_w, block, grid.z, tag="weight")
                else:
                    grad_w = block
        if work is not None and grid.overlap:
            work.wait()
        if grad_x is not None:
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_w, None


class SharedScatter(SharedInput):
    """The input chunking shared by the plain layers of one chain that read the same tensor
    (q, k, v): the chunk is taken once, so its backward all-gathers once (n·in·s on in_axis)."""

    def _communicate(self, x: torch.Tensor) -> torch.Tensor:
        return scatter(x, self.axis, -1)


class Linear3D(nn.Module):
    """A Linear laid out on a 3D grid; plain (out on x, in on y) or `transpose`d (out on y, in
    on x). Shapes must divide: out by |out_axis|·Z, in by |in_axis|."""

    def __init__(self, in_features: int, out_features: int, grid: Grid3D, bias: bool = True,
                 transpose: bool = False, scatter_input: bool = True, gather_output: bool = True,
                 shared_input: SharedScatter | None = None, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.grid, self.transpose = grid, transpose
        self.in_axis = grid.x if transpose else grid.y
        self.out_axis = grid.y if transpose else grid.x
        self.scatter_input, self.gather_output = scatter_input, gather_output
        self.shared_input = shared_input
        z = grid.z
        if out_features % (self.out_axis.size * z.size) or in_features % self.in_axis.size:
            raise TensorSplitError(
                f"Linear({in_features}, {out_features}) does not fit the 3D grid "
                f"{self.out_axis.name}={self.out_axis.size} (output), {self.in_axis.name}="
                f"{self.in_axis.size} (input), tensor_z={z.size}: out_features must be a multiple "
                f"of {self.out_axis.size * z.size} and in_features of {self.in_axis.size}.")
        self.local_out = out_features // self.out_axis.size
        self.local_in = in_features // self.in_axis.size
        self.weight = nn.Parameter(torch.empty(self.local_out // z.size, self.local_in,
                                               device=device, dtype=dtype))
        self.weight.exatrain_layout = ((0, self.out_axis), (0, z), (1, self.in_axis))
        self.weight.exatrain_norm_axes = (grid.grid,)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.local_out, device=device, dtype=dtype))
            self.bias.exatrain_layout = ((0, self.out_axis),)
            self.bias.exatrain_norm_axes = (self.out_axis,)
            # computed from this z-shard of the batch: partial over z
            self.bias.exatrain_grad_sum_axes = (z.name,) if z.size > 1 else ()
        else:
            self.bias = None
        self._pending = None
        self._rows, self._input_grad = 0, False

    @classmethod
    def from_linear(cls, linear: nn.Linear, grid: Grid3D, **kwargs) -> "Linear3D":
        layer = cls(linear.in_features, linear.out_features, grid, linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            for ours, full in ((layer.weight, linear.weight), (layer.bias, linear.bias)):
                if ours is not None:
                    ours.data = shard_of(full.detach(), ours.exatrain_layout).clone()
        keep_frozen(layer, linear)
        return layer

    # ------------------------------------------------------------------ weight all-gather over z
    def _gather_weight(self, async_op: bool):
        z = self.grid.z
        if z.size == 1:
            return self.weight.detach(), None
        block = self.weight.new_empty((self.local_out, self.local_in))
        work = all_gather_into(block, self.weight.detach(), z, tag="weight", async_op=async_op)
        return block, work

    def _prefetch(self) -> None:
        if self._pending is None:
            block, work = self._gather_weight(async_op=True)
            self._pending = (block, work, self.weight._version)

    def _take_prefetched(self) -> torch.Tensor | None:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        block, work, version = pending
        if work is not None:
            work.wait()
        return block if version == self.weight._version else None

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._input_grad = x.requires_grad
        if self.shared_input is not None:
            x = self.shared_input(x)
        elif self.scatter_input:
            x = scatter(x, self.in_axis, -1)
        self._rows = x.numel() // x.shape[-1]
        y = _Matmul3D.apply(x, self.weight, self)
        if self.bias is not None:
            y = y + self.bias
        return gather(y, self.out_axis, -1) if self.gather_output else y

    def bytes_per_step(self) -> dict[str, int]:
        """The docstring's formula for one training step (forward and backward)."""
        s, n, z = self.weight.element_size(), self._rows, self.grid.z
        out: dict[str, int] = {}

        def add(axis: Axis, nbytes: int) -> None:
            if axis.size > 1 and nbytes:
                out[axis.name] = out.get(axis.name, 0) + nbytes

        add(z, 3 * self.local_out * self.local_in * s)
        add(self.in_axis, n * self.local_out * s)
        if self._input_grad:
            add(self.out_axis, n * self.local_in * s)
            if self.shared_input is None and self.scatter_input:
                add(self.in_axis, n * self.in_features * s)
        if self.gather_output:
            add(self.out_axis, n * self.out_features * s)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"out on {self.out_axis.name}, in on {self.in_axis.name}, rows sharded on "
                f"{self.grid.z.name}: local weight {tuple(self.weight.shape)}")


# ------------------------------------------------------------------ the batch over z
def scatter_batch(x: torch.Tensor, z: Axis) -> torch.Tensor:
    """This z-rank's rows of the batch (dim 0), zero-padded to a multiple of |z| first.
    Backward: all-gather of the gradient (n_pad·rest·s on z, only when x needs a grad)."""
    if z.size == 1:
        return x
    pad = -x.shape[0] % z.size
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    return scatter(x, z, 0)


def gather_batch(y: torch.Tensor, z: Axis, batch: int) -> torch.Tensor:
    """All z-ranks' rows, concatenated and trimmed to `batch` (n_pad·rest·s forward on z)."""
    if z.size == 1:
        return y
    return gather(y, z, 0)[:batch]
