"""1D (Megatron) tensor parallelism: column- and row-parallel Linear over the `tensor` axis.

With P ranks on the axis, n local rows (tokens) entering a layer, s bytes per element:

ColumnParallelLinear (weight rows = output features split: W_r is (out/P, in), bias (out/P)):
    y_r = f(x) W_rᵀ + b_r                     f = copy_to: identity fwd, all-reduce of dx bwd
    [gather_output] y = all-gather_r(y_r)     along the last dim; bwd keeps own chunk
  bytes:  fwd  n·out·s (only with gather_output)       bwd  n·in·s (only when x needs a grad)

RowParallelLinear (weight columns = input features split: W_r is (out, in/P), bias replicated):
    [scatter_input] x_r = own chunk of x      bwd all-gathers dx
    y = g(x_r W_rᵀ) + b                       g = reduce_from: all-reduce fwd, identity bwd
  bytes:  fwd  n·out·s                                 bwd  n·in·s (only with scatter_input)

A column layer feeding a row layer through feature-local operations (an activation, or attention
whose heads are split with the features) needs neither gather nor scatter in between: one
all-reduce forward (g, after the row layer) and one backward (f, before the column layers) per
pair. Column layers that read the same input (q, k and v) share one f through a `SharedInput`, so
the pair costs n·E·s each way whatever the number of column layers.

Sequence parallelism (after Korthikanti et al. 2022) is arranged by tensor.py around these layers:
between pairs the activations are split along the sequence (dim -2), so norms, dropout and residual
adds touch 1/P of the tokens; the module holding a pair all-gathers the sequence on entry
(backward: keep own chunk) and keeps its own chunk on exit (backward: all-gather), while f and g
stay as they are. Ledger bytes per pair: 2·n·E·s each way, against n·E·s without it; on the wire
(ring) 3(P-1)/P·n·E·s each way against 2(P-1)/P. Megatron's fused variant (a reduce-scatter in
place of g) saves that third, but needs everything after the row layer inside the module (bias,
dropout) to be rewritten for partial sums; this one works on unmodified modules.

Parameters carry the metadata the rest of exatrain reads: `exatrain_layout` (how the full tensor
is split, for full-weight state dicts), `exatrain_norm_axes` (over which the gradient norm's
squares are summed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm import Axis
from ...comm.autograd import copy_to, gather, reduce_from, scatter
from .state import shard_of
from ...errors import TensorSplitError

SEQ_DIM = -2  # the token dimension of (..., tokens, features) activations


def _mark(param: nn.Parameter, layout, norm_axes) -> nn.Parameter:
    param.exatrain_layout = tuple(layout)
    param.exatrain_norm_axes = tuple(norm_axes)
    return param


def _check(features: int, axis: Axis, what: str) -> None:
    if features % axis.size:
        raise TensorSplitError(
            f"{what}={features} does not split over the {axis.size} ranks of the "
            f"{axis.name!r} axis; use a degree that divides {features}.")


def shared_input_bytes(rows: int, features: int, element_size: int, input_grad: bool = True) -> int:
    """f shared by a pair's column layers: backward all-reduce of dx, n·in·s (when x needs a grad)."""
    return rows * features * element_size if input_grad else 0


def column_bytes(rows: int, in_features: int, out_features: int, element_size: int,
                 gather_output: bool, own_f: bool, input_grad: bool = True) -> int:
    """ColumnParallelLinear per step: forward n·out·s with gather_output; backward n·in·s for
    its own f (not shared) when the input needs a gradient."""
    total = rows * out_features * element_size if gather_output else 0
    if own_f and input_grad:
        total += rows * in_features * element_size
    return total


def row_bytes(rows: int, in_features: int, out_features: int, element_size: int,
              scatter_input: bool, input_grad: bool = True) -> int:
    """RowParallelLinear per step: forward n·out·s (the all-reduce); backward n·in·s with
    scatter_input. `rows` counts the full input's rows."""
    total = rows * out_features * element_size
    if scatter_input and input_grad:
        total += rows * in_features * element_size
    return total


class SharedInput:
    """Megatron's f shared by the column layers of one pair that read the same tensor: q, k and
    v call it with the same `x`, which passes f once, so its backward all-reduces once (n·in·s).
    `reset()` (a forward hook of the pair's parent module) drops the cached tensors after each
    forward."""

    def __init__(self, axis: Axis):
        self.axis = axis
        self._x = self._y = None
        self.rows = self.features = 0
        self.requires_grad = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._x is not x:
            self.rows, self.features = x.numel() // x.shape[-1], x.shape[-1]
            self.requires_grad = x.requires_grad
            self._x, self._y = x, self._communicate(x)
        return self._y

    def _communicate(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to(x, self.axis)

    def reset(self, *_args) -> None:
        self._x = self._y = None

    def bytes_per_step(self, element_size: int) -> dict[str, int]:
        if self.axis.size == 1 or not self.requires_grad:
            return {}
        return {self.axis.name: shared_input_bytes(self.rows, self.features, element_size)}


class _SplitLinear(nn.Module):
    """What column and row layers share: construction from a plain Linear's full weights."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, axis: Axis, **kwargs):
        layer = cls(linear.in_features, linear.out_features, axis, linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        layer.load_full(linear.weight, linear.bias)
        keep_frozen(layer, linear)
        return layer


def keep_frozen(layer: nn.Module, linear: nn.Linear) -> None:
    """The split layer's weight and bias train as the Linear's did: a frozen one (a pretrained
    trunk) stays frozen."""
    for ours, full in ((layer.weight, linear.weight), (layer.bias, linear.bias)):
        if ours is not None:
            ours.requires_grad_(full.requires_grad)


class ColumnParallelLinear(_SplitLinear):
    """Linear with its output features split over `axis`; see the module docstring."""

    def __init__(self, in_features: int, out_features: int, axis: Axis, bias: bool = True,
                 gather_output: bool = False, shared_input: SharedInput | None = None,
                 device=None, dtype=None):
        super().__init__()
        _check(out_features, axis, "out_features")
        self.in_features, self.out_features, self.axis = in_features, out_features, axis
        self.gather_output = gather_output
        self.shared_input = shared_input
        layout = ((0, axis),)
        self.weight = _mark(nn.Parameter(torch.empty(out_features // axis.size, in_features,
                                                     device=device, dtype=dtype)), layout, (axis,))
        self.bias = _mark(nn.Parameter(torch.empty(out_features // axis.size, device=device,
                                                   dtype=dtype)), layout, (axis,)) if bias else None
        self._rows, self._input_grad = 0, False

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight.data = shard_of(weight.detach(), self.weight.exatrain_layout).clone()
        if self.bias is not None:
            self.bias.data = shard_of(bias.detach(), self.bias.exatrain_layout).clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._input_grad = x.requires_grad
        x = self.shared_input(x) if self.shared_input is not None else copy_to(x, self.axis)
        self._rows = x.numel() // x.shape[-1]
        y = F.linear(x, self.weight, self.bias)
        return gather(y, self.axis, -1) if self.gather_output else y

    def bytes_per_step(self) -> dict[str, int]:
        """Forward n·out·s with gather_output; backward n·in·s for its own f (when not shared)."""
        total = column_bytes(self._rows, self.in_features, self.out_features,
                             self.weight.element_size(), self.gather_output,
                             own_f=self.shared_input is None, input_grad=self._input_grad)
        return {self.axis.name: total} if total and self.axis.size > 1 else {}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(local {self.out_features // self.axis.size}), axis={self.axis.name}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(_SplitLinear):
    """Linear with its input features split over `axis`; see the module docstring."""

    def __init__(self, in_features: int, out_features: int, axis: Axis, bias: bool = True,
                 scatter_input: bool = False, device=None, dtype=None):
        super().__init__()
        _check(in_features, axis, "in_features")
        self.in_features, self.out_features, self.axis = in_features, out_features, axis
        self.scatter_input = scatter_input
        self.weight = _mark(nn.Parameter(torch.empty(out_features, in_features // axis.size,
                                                     device=device, dtype=dtype)),
                            ((1, axis),), (axis,))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) \
            if bias else None
        if self.bias is not None:
            # added after the all-reduce: whole and identical on every rank of the axis
            self.bias.exatrain_grad_sum_axes = ()
        self._rows, self._input_grad = 0, False

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight.data = shard_of(weight.detach(), self.weight.exatrain_layout).clone()
        if self.bias is not None:
            self.bias.data = bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._input_grad = x.requires_grad
        if self.scatter_input:
            x = scatter(x, self.axis, -1)
        self._rows = x.numel() // x.shape[-1]
        y = F.linear(x, self.weight)
        y = reduce_from(y, self.axis)
        return y + self.bias if self.bias is not None else y

    def bytes_per_step(self) -> dict[str, int]:
        """Forward n·out·s (the all-reduce); backward n·in·s with scatter_input."""
        if self.axis.size == 1:
            return {}
        return {self.axis.name: row_bytes(self._rows, self.in_features, self.out_features,
                                          self.weight.element_size(), self.scatter_input,
                                          self._input_grad)}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.in_features // self.axis.size}), "
                f"out_features={self.out_features}, axis={self.axis.name}")
