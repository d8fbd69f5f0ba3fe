"""Channel and filter parallelism for convolutions over the `tensor` axis (Dryden et al., SC19).

With P ranks on the axis, a convolution with C_in input and C_out output channels, N samples,
input volume V_in and output volume V_out (spatial elements per channel), s bytes per element:

FilterParallelConv (output channels, "filters", split: the rank holds C_out/P filters):
    y_r = conv(f(x), W_r) + b_r            f = copy_to: identity fwd, all-reduce of dx bwd
    [gather_output] y = all-gather_r(y_r)  along the channels; bwd keeps own chunk
  bytes:  fwd  N·C_out·V_out·s (only with gather_output)   bwd  N·C_in·V_in·s (when x needs a grad)

ChannelParallelConv (input channels split: the rank holds the C_in/P input slice of every filter):
    [scatter_input] x_r = own channels of x       bwd all-gathers dx
    y = g(conv(x_r, W_r)) + b                      g = reduce_from: all-reduce fwd, identity bwd
  bytes:  fwd  N·C_out·V_out·s                              bwd  N·C_in·V_in·s (scatter_input only)

A filter-parallel convolution feeding a channel-parallel one through per-channel layers
(BatchNorm on the local channels, bias, pointwise activations, pooling, dropout, nearest
upsampling) is Megatron's column → row pair: nothing moves between the two, one all-reduce of the
channel conv's output forward and one of the filter conv's input gradient backward.

Weights: Conv stores (C_out, C_in/groups, *k), ConvTranspose (C_in, C_out/groups, *k), so filters
are dim 0 of a Conv weight and dim 1 of a ConvTranspose weight, input channels the other one.
Split tensors carry `exatrain_layout` (state.py) so checkpoints hold full weights. Each rank
computes the whole gradient of its weight slice from the whole batch of its replica, so a split
weight's gradient is only averaged over the replica axes (by GradSync): its all-reduce bytes per
rank fall by P. groups must be 1 (grouped and depthwise convolutions stay whole).

BatchNorm between a pair: it sees C/P whole channels over the whole batch
of its replica, so its statistics are exact; its weight, bias and running statistics are split
like the channels (`split_batchnorm`), and `parallel.batchnorm = "global"` still combines them over
the replica axes (parallel/batchnorm.py) as for any BatchNorm.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ...comm import Axis
from ...comm.autograd import copy_to, gather, reduce_from, scatter
from .state import shard_of
from ...errors import TensorSplitError

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_TRANSPOSE_FN = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def is_conv(module: nn.Module) -> bool:
    return type(module) in CONVS + TRANSPOSED


def splittable(conv: nn.Module, axis_size: int, side: str) -> bool:
    """Can `conv` be split over `axis_size` ranks on `side` ("filter" or "channel")?"""
    channels = conv.out_channels if side == "filter" else conv.in_channels
    return is_conv(conv) and conv.groups == 1 and channels % axis_size == 0


def filter_bytes(n: int, c_in: int, v_in: int, c_out: int, v_out: int, s: int,
                 gather_output: bool, input_grad: bool) -> int:
    """FilterParallelConv per step: fwd N·C_out·V_out·s with gather_output; bwd N·C_in·V_in·s."""
    return (n * c_out * v_out * s if gather_output else 0) + (n * c_in * v_in * s if input_grad else 0)


def channel_bytes(n: int, c_in: int, v_in: int, c_out: int, v_out: int, s: int,
                  scatter_input: bool, input_grad: bool) -> int:
    """ChannelParallelConv per step: fwd N·C_out·V_out·s; bwd N·C_in·V_in·s with scatter_input."""
    return n * c_out * v_out * s + (n * c_in * v_in * s if scatter_input and input_grad else 0)


def _mark(param, layout, axis: Axis):
    param.exatrain_layout = tuple(layout)
    param.exatrain_norm_axes = (axis,)
    return param


class _SplitConv(nn.Module):
    """What both sides share: the conv's hyperparameters (a parameter-less copy of it), the local
    weight slice, and the shapes of the last forward for the byte formula."""

    side = ""
    needs_whole_input = True   # under space, the spatial step gathers the blocks before it

    def __init__(self, conv: nn.Module, axis: Axis):
        super().__init__()
        if not splittable(conv, axis.size, self.side):
            what = "out_channels" if self.side == "filter" else "in_channels"
            raise TensorSplitError(
                f"{type(conv).__name__} with {what}="
                f"{getattr(conv, what)} and groups={conv.groups} cannot be split "
                f"{self.side}-wise over the {axis.size} ranks of {axis.name!r}: it "
                f"needs groups=1 and {what} divisible by {axis.size}.")
        shell = copy.copy(conv)
        shell.__dict__["_parameters"] = {}
        shell.__dict__["_forward_hooks"] = {}
        shell.__dict__["_forward_pre_hooks"] = {}
        object.__setattr__(self, "_shell", shell)     # hyperparameters only; not a child module
        self.axis, self.source_type = axis, type(conv).__name__
        self.transposed = isinstance(conv, TRANSPOSED)
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self._shape = (0, 0, 0)   # (N, V_in, V_out) of the last forward
        self._input_grad = False

    def _conv(self, x: torch.Tensor, weight, bias) -> torch.Tensor:
        shell = self._shell
        if not self.transposed:
            return shell._conv_forward(x, weight, bias)
        k = x.dim() - 2
        return _TRANSPOSE_FN[k](x, weight, bias, shell.stride, shell.padding, shell.output_padding,
                                shell.groups, shell.dilation)

    def _note(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._input_grad = x.requires_grad and torch.is_grad_enabled()
        self._shape = (x.shape[0], x[0, 0].numel(), y[0, 0].numel())

    def extra_repr(self) -> str:
        return (f"{self.source_type}({self.in_channels}, {self.out_channels}), {self.side}s split "
                f"over {self.axis.name} ({self.axis.size})")


class FilterParallelConv(_SplitConv):
    """A Conv/ConvTranspose with its output channels split over `axis` (module docstring)."""

    side = "filter"

    def __init__(self, conv: nn.Module, axis: Axis, gather_output: bool = False):
        super().__init__(conv, axis)
        self.gather_output = gather_output
        dim = 1 if self.transposed else 0
        self.weight = _mark(nn.Parameter(shard_of(conv.weight.detach(), ((dim, axis),)).clone(),
                                         requires_grad=conv.weight.requires_grad),
                            ((dim, axis),), axis)
        self.bias = None if conv.bias is None else _mark(
            nn.Parameter(shard_of(conv.bias.detach(), ((0, axis),)).clone(),
                         requires_grad=conv.bias.requires_grad), ((0, axis),), axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._conv(copy_to(x, self.axis), self.weight, self.bias)
        self._note(x, y)
        return gather(y, self.axis, 1) if self.gather_output else y

    def bytes_per_step(self) -> dict[str, int]:
        n, v_in, v_out = self._shape
        total = filter_bytes(n, self.in_channels, v_in, self.out_channels, v_out,
                             self.weight.element_size(), self.gather_output, self._input_grad)
        return {self.axis.name: total} if total and self.axis.size > 1 else {}


class ChannelParallelConv(_SplitConv):
    """A Conv/ConvTranspose with its input channels split over `axis` (module docstring)."""

    side = "channel"

    def __init__(self, conv: nn.Module, axis: Axis, scatter_input: bool = False):
        super().__init__(conv, axis)
        self.scatter_input = scatter_input
        dim = 0 if self.transposed else 1
        self.weight = _mark(nn.Parameter(shard_of(conv.weight.detach(), ((dim, axis),)).clone(),
                                         requires_grad=conv.weight.requires_grad),
                            ((dim, axis),), axis)
        self.bias = None
        if conv.bias is not None:  # added after the all-reduce: whole, identical on every rank
            self.bias = nn.Parameter(conv.bias.detach().clone(),
                                     requires_grad=conv.bias.requires_grad)
            self.bias.exatrain_grad_sum_axes = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = x
        if self.scatter_input:
            x = scatter(x, self.axis, 1)
        y = reduce_from(self._conv(x, self.weight, None), self.axis)
        self._note(whole, y)
        if self.bias is not None:
            y = y + self.bias.view((1, -1) + (1,) * (y.dim() - 2))
        return y

    def bytes_per_step(self) -> dict[str, int]:
        if self.axis.size == 1:
            return {}
        n, v_in, v_out = self._shape
        return {self.axis.name: channel_bytes(n, self.in_channels, v_in, self.out_channels, v_out,
                                              self.weight.element_size(), self.scatter_input,
                                              self._input_grad)}


@torch.no_grad()
def split_batchnorm(bn: nn.modules.batchnorm._BatchNorm, axis: Axis) -> nn.Module:
    """A copy of `bn` holding this rank's channels (weight, bias, running statistics), each
    marked with its layout so full state dicts hold the whole layer."""
    if bn.num_features % axis.size:
        raise TensorSplitError(f"{type(bn).__name__}({bn.num_features}) does not split over the "
                               f"{axis.size} ranks of {axis.name!r}.")
    local = copy.copy(bn)
    for table in ("_parameters", "_buffers"):
        local.__dict__[table] = dict(bn.__dict__[table])
    local.num_features = bn.num_features // axis.size
    layout = ((0, axis),)
    for name in ("weight", "bias"):
        p = getattr(bn, name)
        if p is not None:
            local._parameters[name] = _mark(nn.Parameter(shard_of(p.detach(), layout).clone(),
                                                         requires_grad=p.requires_grad),
                                            layout, axis)
    for name in ("running_mean", "running_var"):
        b = getattr(bn, name)
        if b is not None:
            part = shard_of(b, layout).clone()
            part.exatrain_layout = layout
            local._buffers[name] = part
    if bn.num_batches_tracked is not None:
        local._buffers["num_batches_tracked"] = bn.num_batches_tracked.clone()
    return local


__all__ = ["CONVS", "TRANSPOSED", "ChannelParallelConv", "FilterParallelConv", "channel_bytes",
           "filter_bytes", "is_conv", "split_batchnorm", "splittable"]
