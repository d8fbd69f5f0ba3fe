"""Distributed versions of the layers of convolutional science models, for the `space` axis.

Each layer here replaces one `torch.nn` layer, keeps its parameters and buffers under the same
names (so state dicts and checkpoints are the serial model's), and runs in one of two modes:

  split        its input is this rank's spatial block; it computes its output block, exchanging
               halos with its neighbours where its windows cross block borders (`comm.halo`)
  replicated   its input is the whole (gathered) tensor, identical on every spatial rank; it runs
               the plain PyTorch op, and its parameters' gradients are scaled by 1/S

A layer runs replicated when an earlier layer of the same forward pass gathered the blocks: an
`nn.Flatten` or global average pool (the transition to dense layers), or a layer whose input blocks
are too small to split that sits in an `nn.Sequential` of a model that gathers anyway (the deepest
layers of CosmoFlow at small inputs); otherwise a layer that cannot be split raises an error that
names it and the splits that would work.

Halo widths along one dim. A window layer (kernel k, stride s, dilation d, padding lo/hi) on a
global input of length N split into P blocks of b = N/P has M = (N + lo + hi - d(k-1) - 1)//s + 1
outputs, which must split into P blocks of m = M/P. Block r's outputs [rm, (r+1)m) read the inputs
[rms - lo, ((r+1)m - 1)s - lo + d(k-1)], so it needs

    left[r]  = rb - (rms - lo)                              inputs below its block
    right[r] = ((r+1)m - 1)s - lo + d(k-1) - ((r+1)b - 1)   inputs above it

(negative: that many of its own edge inputs are unused and cropped). Only nearest neighbours
exchange, so every halo must be at most b wide. A transposed convolution's output j receives input
i when j = is - p + dt for a tap t, so block r needs inputs ceil((rm + p - d(k-1))/s) ..
floor(((r+1)m - 1 + p)/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import torch.distributed as dist

from ...comm import all_reduce
from ...comm.halo import Halo, SplitDim, halo_exchange
from ..batchnorm import BatchNormStats, take_over_batchnorm, update_running_stats
from .functions import AllReduceSum, shared_mask, sum_over_axis
from ...errors import SpatialSplitError

GATHER = "gather"  # a layer plan meaning: gather the blocks and run replicated


# --------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Window:
    k: int
    s: int
    d: int
    lo: int
    hi: int


def window_geometry(n: int, parts: int, w: Window):
    """(left widths, right widths, output block) of a window layer, or a reason it cannot split."""
    span = w.d * (w.k - 1)
    total = (n + w.lo + w.hi - span - 1) // w.s + 1
    if total < 1:
        return f"its output would be empty (input {n})"
    if total % parts:
        return f"its output length {total} does not divide into {parts} equal blocks"
    m, b = total // parts, n // parts
    lefts = tuple(r * b - (r * m * w.s - w.lo) for r in range(parts))
    rights = tuple(((r + 1) * m - 1) * w.s - w.lo + span - ((r + 1) * b - 1) for r in range(parts))
    return _check_widths(lefts, rights, b) or (lefts, rights, m)


def transpose_geometry(n: int, parts: int, k: int, s: int, d: int, p: int, op: int):
    """(lefts, rights, output block, output offsets) of a transposed convolution, or a reason."""
    span = d * (k - 1)
    total = (n - 1) * s - 2 * p + span + op + 1
    if total % parts:
        return f"its output length {total} does not divide into {parts} equal blocks"
    m, b = total // parts, n // parts
    first = [-((-(r * m + p - span)) // s) for r in range(parts)]   # ceil
    last = [((r + 1) * m - 1 + p) // s for r in range(parts)]
    if any(f > l for f, l in zip(first, last)):
        return "some output blocks receive no input"
    lefts = tuple(r * b - first[r] for r in range(parts))
    rights = tuple(last[r] - ((r + 1) * b - 1) for r in range(parts))
    offsets = tuple(r * m + p - first[r] * s for r in range(parts))
    return _check_widths(lefts, rights, b) or (lefts, rights, m, offsets)


def _check_widths(lefts, rights, b):
    parts = len(lefts)
    for r in range(parts):
        if r > 0 and lefts[r] > b:
            return f"it needs a halo of {lefts[r]} but the blocks are only {b} wide"
        if r < parts - 1 and rights[r] > b:
            return f"it needs a halo of {rights[r]} but the blocks are only {b} wide"
        if b - max(-lefts[r], 0) - max(-rights[r], 0) <= 0:
            return f"its blocks of {b} are smaller than the inputs it skips"
    return None


def _ntuple(value, n: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


# --------------------------------------------------------------------------- base
class SpatialLayer(nn.Module):
    """Common machinery: per input shape, decide the mode (and plan the split) once, then run.

    The decision is made at the first call with a given input shape and then kept, so that a
    block recomputed during backward (activation checkpointing) runs exactly as it did forward.
    """

    def __init__(self, source: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__()
        self.qualname = name
        self.source_type = type(source).__name__
        self.runtime = runtime
        self.may_gather = may_gather
        self.gather_reason = ""
        self._plans: dict = {}
        self.train(source.training)

    def forward(self, x):
        mode, plan = self.enter(x)
        if mode == "split":
            return self.split_forward(x, plan)
        if mode == GATHER:
            x = self.runtime.gather(x)
        return self.replicated_forward(x)

    def enter(self, x) -> tuple[str, object]:
        """(mode, plan) for input `x`: "split", GATHER (gather it, then replicated) or "replicated"."""
        key = tuple(x.shape)
        entry = self._plans.get(key)
        if entry is None:
            entry = self._plans[key] = self._decide(key)
        self.runtime.note_mode(self, replicated=entry[0] != "split")
        return entry

    def _decide(self, shape) -> tuple[str, object]:
        if self.runtime.gathered:
            return "replicated", None
        try:
            return "split", self.plan(shape)
        except SpatialSplitError as err:
            if self.may_gather:
                self.gather_reason = str(err)
                return GATHER, None
            raise

    # subclasses
    def plan(self, shape):
        return ()  # block-local: nothing to plan

    def split_forward(self, x, plan):
        return self.replicated_forward(x)

    def replicated_forward(self, x):  # the serial computation; every concrete layer defines it
        raise NotImplementedError(f"{type(self).__name__} defines no replicated_forward")

    def describe(self) -> str:
        return ""

    def extra_repr(self) -> str:
        return f"{self.source_type} '{self.qualname}'" + (f", {self.describe()}" if self.describe() else "")

    def _cannot_split(self, i: int, k: int, n: int, parts: int, reason: str, works) -> None:
        """Raise the error for spatial dim i (of k) with global length n split `parts` ways."""
        dim = "dhw"[3 - k + i]
        valid = [p for p in range(1, min(n, 64) + 1) if n % p == 0 and works(p)]
        space = list(self.runtime.parts)
        space[3 - k + i] = max([p for p in valid if p <= parts] or [1])
        hint = "" if self.may_gather else (
            " (In a model that gathers at an nn.Flatten or global pooling, a layer of an "
            "nn.Sequential whose blocks get too small gathers them instead of failing.)")
        raise SpatialSplitError(
            f"{self.source_type} '{self.qualname}' ({self.describe()}) cannot be split {parts} ways "
            f"along {dim} (space_{dim}) of its input of length {n}: {reason}. At this input size "
            f"space_{dim} can be one of {valid} for this layer, e.g. space={tuple(space)}; or use "
            f"a larger input.{hint}")


# --------------------------------------------------------------------------- convolution
@dataclass
class _ConvPlan:
    halo: Halo | None              # None: nothing to exchange, fill or crop
    local_pad: tuple[int, ...]     # padding the local op applies (0 on dims the halo handles)
    out_shape: tuple[int, ...]
    interior: tuple | None = None  # (out slices, block slices) computable before halos arrive
    shells: tuple = ()             # ((out slices, ext slices), ...) computed after
    mode_pad: tuple = ()           # F.pad amounts (last dim first) in the layer's padding_mode


class SpatialConv(SpatialLayer):
    """Conv1d/2d/3d over spatial blocks: halo exchange, then the local convolution.

    With `runtime.overlap`, the outputs that read only the own block are computed while the halo
    messages are in flight, and the boundary shells after they arrive; in backward, the weight
    gradient is computed while the input-gradient halos travel back.

    Padding modes (`padding_mode=`), the serial layer being F.pad(x, mode) then an unpadded conv:
      zeros      the global boundary's halo is filled with 0 locally (above)
      circular   along a split dim the halo wraps: the first block's left halo is the last
                 block's right edge and back (`SplitDim.periodic`), the same bytes as an interior
                 face; along an unsplit dim F.pad(mode='circular') on the block
      reflect,   interior faces exchange ordinary halos; at the global boundary the block pads
      replicate  itself with F.pad(mode) from its own edge (no communication), after the
                 exchange so that the corners reflect the neighbours' halos too (padding along
                 different dims commutes). Reflect needs the padding below the boundary block's
                 extended length, as torch needs it below the sample's.
    These run without overlap (halo exchange, F.pad, convolution, each differentiable).
    """

    def __init__(self, conv: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(conv, name, runtime, may_gather)
        self.padding_mode = conv.padding_mode
        self.weight = conv.weight
        self.bias = conv.bias
        self.nd = conv.weight.dim() - 2
        self.kernel_size, self.stride = tuple(conv.kernel_size), tuple(conv.stride)
        self.dilation, self.groups = tuple(conv.dilation), conv.groups
        if conv.padding == "valid":
            lo = hi = (0,) * self.nd
        elif conv.padding == "same":
            tot = [d * (k - 1) for k, d in zip(self.kernel_size, self.dilation)]
            lo, hi = tuple(t // 2 for t in tot), tuple(t - t // 2 for t in tot)
        else:
            lo = hi = _ntuple(conv.padding, self.nd)
        self.pad_lo, self.pad_hi = lo, hi
        self._conv = (F.conv1d, F.conv2d, F.conv3d)[self.nd - 1]

    def windows(self):
        return [Window(k, s, d, lo, hi) for k, s, d, lo, hi in
                zip(self.kernel_size, self.stride, self.dilation, self.pad_lo, self.pad_hi)]

    def describe(self) -> str:
        return (f"kernel {self.kernel_size}, stride {self.stride}, padding {self.pad_lo}"
                + (f"/{self.pad_hi}" if self.pad_hi != self.pad_lo else "")
                + f", dilation {self.dilation}")

    def plan(self, shape):
        rt, k = self.runtime, self.nd
        parts, coords, strides = rt.layout(k, self)
        zeros = self.padding_mode == "zeros"
        dims, local_pad, out_shape = [], [], [shape[0], self.weight.shape[0]]
        mode_pad = [0] * (2 * k)  # F.pad order: last dim's (lo, hi) first
        for i, w in enumerate(self.windows()):
            p, b = parts[i], shape[2 + i]
            n = b * p
            if p == 1 and (w.lo == w.hi or not zeros):
                local_pad.append(w.lo if zeros else 0)
                if not zeros:
                    mode_pad[2 * (k - 1 - i):2 * (k - i)] = [w.lo, w.hi]
                out_shape.append((n + w.lo + w.hi - w.d * (w.k - 1) - 1) // w.s + 1)
                continue
            geo = window_geometry(n, p, w)
            if isinstance(geo, str):
                self._cannot_split(i, k, n, p, geo,
                                   lambda q, n=n, w=w: not isinstance(window_geometry(n, q, w), str))
            lefts, rights, m = geo
            if self.padding_mode == "circular" and (lefts[0] > b or rights[-1] > b):
                self._cannot_split(i, k, n, p, f"its circular halo of {max(lefts[0], rights[-1])} "
                                   f"wraps from a block only {b} wide",
                                   lambda q, n=n, w=w: not isinstance(window_geometry(n, q, w), str)
                                   and max(w.lo, w.hi) <= n // q)
            if self.padding_mode in ("reflect", "replicate"):
                # the boundary blocks pad themselves after the exchange: no halo there
                c, pad = coords[i], mode_pad[2 * (k - 1 - i):2 * (k - i)]
                if c == 0:
                    pad[0], lefts = max(lefts[0], 0), (min(lefts[0], 0),) + lefts[1:]
                if c == p - 1:
                    pad[1], rights = max(rights[-1], 0), rights[:-1] + (min(rights[-1], 0),)
                mode_pad[2 * (k - 1 - i):2 * (k - i)] = pad
                ext = b + lefts[c] + rights[c]
                if self.padding_mode == "reflect" and max(pad) >= ext:
                    self._cannot_split(i, k, n, p, f"its reflect padding of {max(pad)} needs a "
                                       f"boundary block longer than {max(pad)}, but it holds {ext}",
                                       lambda q, n=n, w=w: max(w.lo, w.hi) < n // q)
            dims.append(SplitDim(2 + i, p, coords[i], strides[i], lefts, rights,
                                 periodic=self.padding_mode == "circular"))
            local_pad.append(0)
            out_shape.append(m)
        halo = Halo(rt.space, dims, shape, fill=0.0) if dims else None
        plan = _ConvPlan(None if halo is None or halo.trivial else halo, tuple(local_pad),
                         tuple(out_shape), mode_pad=tuple(mode_pad) if any(mode_pad) else ())
        if plan.halo is not None and zeros:
            self._overlap_geometry(plan, dims, shape)
        return plan

    def _overlap_geometry(self, plan: _ConvPlan, dims: list[SplitDim], shape) -> None:
        """Interior (own inputs only) and boundary shells of the output, for overlapped compute."""
        ndim = len(shape)
        per_dim = []
        for sd in dims:
            i = sd.dim - 2
            s, span = self.stride[i], self.dilation[i] * (self.kernel_size[i] - 1) + 1
            lo, hi = sd.left[sd.coord], sd.right[sd.coord]
            hl, cl = max(lo, 0), max(-lo, 0)
            center = shape[sd.dim] - cl - max(-hi, 0)
            j_lo, j_hi = -(-hl // s), (hl + center - span) // s
            if j_hi < j_lo:
                return  # no output reads only own inputs: nothing to overlap
            m = plan.out_shape[sd.dim]
            per_dim.append((sd.dim, s, span, hl, cl, j_lo, j_hi, m))
        out_int = [slice(None)] * ndim
        in_int = [slice(None)] * ndim
        for dim, s, span, hl, cl, j_lo, j_hi, _m in per_dim:
            out_int[dim] = slice(j_lo, j_hi + 1)
            in_int[dim] = slice(j_lo * s - hl + cl, j_hi * s + span - hl + cl)
        shells = []
        for t, (dim, s, span, _hl, _cl, j_lo, j_hi, m) in enumerate(per_dim):
            for a, e in ((0, j_lo), (j_hi + 1, m)):
                if e <= a:
                    continue
                out_sl = [slice(None)] * ndim
                in_sl = [slice(None)] * ndim
                for u, (dim_u, s_u, span_u, _, _, lo_u, hi_u, _) in enumerate(per_dim):
                    if u < t:
                        out_sl[dim_u] = slice(lo_u, hi_u + 1)
                        in_sl[dim_u] = slice(lo_u * s_u, hi_u * s_u + span_u)
                out_sl[dim] = slice(a, e)
                in_sl[dim] = slice(a * s, (e - 1) * s + span)
                shells.append((tuple(out_sl), tuple(in_sl)))
        plan.interior = (tuple(out_int), tuple(in_int))
        plan.shells = tuple(shells)

    def conv(self, x, weight, bias, padding):
        return self._conv(x, weight, bias, self.stride, padding, self.dilation, self.groups)

    @torch.no_grad()
    def conv_input(self, x):
        """(tensor, pad_lo, pad_hi, replicated) that this layer's local convolution read for the
        input `x` it was called with: the halo-extended block (one more halo exchange, tag
        "halo") or, when the layer ran replicated, the whole tensor (gathered again if this layer
        gathered it: one all-gather, tag "gather"). For statistics of the convolution's input
        patches (K-FAC); call it after the layer's forward, on every spatial rank."""
        mode, plan = self.enter(x)
        if mode == "split":
            ext = x if plan.halo is None else plan.halo.exchange(x)
            if plan.mode_pad:
                ext = F.pad(ext, plan.mode_pad, mode=self.padding_mode)
            return ext, plan.local_pad, plan.local_pad, False
        if mode == GATHER:
            from .functions import gather_blocks_
            parts, _, _ = self.runtime.layout(x.dim() - 2, None)
            x = gather_blocks_(x, self.runtime.space, parts)
        if self.padding_mode != "zeros":
            return F.pad(x, self._pads(), mode=self.padding_mode), (0,) * self.nd, (0,) * self.nd, True
        return x, self.pad_lo, self.pad_hi, True

    def _pads(self) -> list[int]:
        """The serial padding in F.pad's order (last dim first)."""
        return [p for lo, hi in zip(reversed(self.pad_lo), reversed(self.pad_hi)) for p in (lo, hi)]

    def split_forward(self, x, plan: _ConvPlan):
        if self.padding_mode != "zeros":  # exchange (wrapping if circular), pad, convolve
            if plan.halo is not None:
                x = halo_exchange(x, plan.halo)
            if plan.mode_pad:
                x = F.pad(x, plan.mode_pad, mode=self.padding_mode)
            return self.conv(x, self.weight, self.bias, plan.local_pad)
        if plan.halo is None:
            return self.conv(x, self.weight, self.bias, plan.local_pad)
        return HaloConv.apply(x, self.weight, self.bias, self, plan)

    def replicated_forward(self, x):
        if self.padding_mode != "zeros":
            return self.conv(F.pad(x, self._pads(), mode=self.padding_mode), self.weight,
                             self.bias, (0,) * self.nd)
        x = F.pad(x, self._pads()) if self.pad_lo != self.pad_hi else x
        return self.conv(x, self.weight, self.bias, self.pad_lo if self.pad_lo == self.pad_hi
                         else (0,) * self.nd)


class HaloConv(torch.autograd.Function):
    """A convolution on a spatial block: halo exchange + local convolution, one Function.

    Saves only the extended block (own block + halos), as a serial convolution saves its input, so
    activation memory per rank is the serial memory / S plus the halos.
    Communication: the `comm.halo` exchange forward, and its adjoint backward (skipped when the
    input needs no gradient, e.g. the first layer).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, layer: SpatialConv, plan: _ConvPlan):
        halo = plan.halo
        pending = halo.start(x)
        if layer.runtime.overlap and plan.interior is not None:
            out = x.new_empty(plan.out_shape)
            out_int, in_int = plan.interior
            out[out_int] = layer.conv(x[in_int], weight, bias, plan.local_pad)
            ext = halo.finish(x, pending)
            for out_sl, in_sl in plan.shells:
                out[out_sl] = layer.conv(ext[in_sl], weight, bias, plan.local_pad)
        else:
            ext = halo.finish(x, pending)
            out = layer.conv(ext, weight, bias, plan.local_pad)
        ctx.save_for_backward(ext, weight)
        ctx.layer, ctx.plan, ctx.has_bias = layer, plan, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        ext, weight = ctx.saved_tensors
        layer, plan = ctx.layer, ctx.plan
        grad = grad.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias

        def conv_backward(mask):
            return torch.ops.aten.convolution_backward(
                grad, ext, weight, [weight.shape[0]] if ctx.has_bias else None, layer.stride,
                plan.local_pad, layer.dilation, False, [0] * layer.nd, layer.groups, mask)

        grad_x = grad_w = grad_b = None
        if need_x and layer.runtime.overlap:
            grad_ext = conv_backward([True, False, False])[0]
            pending = plan.halo.start_backward(grad_ext)
            if need_w or need_b:
                _, grad_w, grad_b = conv_backward([False, need_w, need_b])
            grad_x = plan.halo.finish_backward(grad_ext, pending)
        else:
            grad_ext, grad_w, grad_b = conv_backward([need_x, need_w, need_b])
            if need_x:
                grad_x = plan.halo.finish_backward(grad_ext, plan.halo.start_backward(grad_ext))
        return grad_x, grad_w, grad_b, None, None


# --------------------------------------------------------------------------- transposed conv
@dataclass
class _TransposePlan:
    halo: Halo | None
    local_pad: tuple[int, ...]
    local_out_pad: tuple[int, ...]
    crops: tuple            # per spatial dim: None or (offset, m)


class SpatialConvTranspose(SpatialLayer):
    """ConvTranspose1d/2d/3d over spatial blocks: input halo, local transposed conv, crop."""

    def __init__(self, conv: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(conv, name, runtime, may_gather)
        if conv.padding_mode != "zeros":
            raise SpatialSplitError(f"{type(conv).__name__} '{name}': only padding_mode='zeros' "
                                    "is supported under a space split.")
        self.weight, self.bias = conv.weight, conv.bias
        self.nd = conv.weight.dim() - 2
        self.kernel_size, self.stride = tuple(conv.kernel_size), tuple(conv.stride)
        self.padding, self.output_padding = tuple(conv.padding), tuple(conv.output_padding)
        self.dilation, self.groups = tuple(conv.dilation), conv.groups
        self._fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[self.nd - 1]

    def describe(self) -> str:
        return (f"kernel {self.kernel_size}, stride {self.stride}, padding {self.padding}, "
                f"output_padding {self.output_padding}, dilation {self.dilation}")

    def plan(self, shape):
        rt, k = self.runtime, self.nd
        parts, coords, strides = rt.layout(k, self)
        dims, pad, out_pad, crops = [], [], [], []
        for i in range(k):
            p, b = parts[i], shape[2 + i]
            n = b * p
            args = (self.kernel_size[i], self.stride[i], self.dilation[i], self.padding[i],
                    self.output_padding[i])
            if p == 1:
                pad.append(self.padding[i])
                out_pad.append(self.output_padding[i])
                crops.append(None)
                continue
            geo = transpose_geometry(n, p, *args)
            if isinstance(geo, str):
                self._cannot_split(i, k, n, p, geo, lambda q, n=n, a=args:
                                   not isinstance(transpose_geometry(n, q, *a), str))
            lefts, rights, m, offsets = geo
            dims.append(SplitDim(2 + i, p, coords[i], strides[i], lefts, rights))
            pad.append(0)
            out_pad.append(0)
            crops.append((offsets[coords[i]], m))
        halo = Halo(rt.space, dims, shape, fill=0.0) if dims else None
        return _TransposePlan(None if halo is None or halo.trivial else halo, tuple(pad),
                              tuple(out_pad), tuple(crops))

    def split_forward(self, x, plan: _TransposePlan):
        if plan.halo is not None:
            x = halo_exchange(x, plan.halo)
        y = self._fn(x, self.weight, None, self.stride, plan.local_pad, plan.local_out_pad,
                     self.groups, self.dilation)
        pads = []
        for i in reversed(range(self.nd)):
            crop = plan.crops[i]
            if crop is None:
                pads += [0, 0]
            else:
                offset, m = crop
                pads += [-offset, offset + m - y.shape[2 + i]]
        if any(pads):
            y = F.pad(y, pads)
        if self.bias is not None:
            y = y + self.bias.view((1, -1) + (1,) * self.nd)
        return y

    def replicated_forward(self, x):
        return self._fn(x, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                        self.groups, self.dilation)


# --------------------------------------------------------------------------- pooling
@dataclass
class _PoolPlan:
    halo: Halo | None
    local_pad: tuple[int, ...]


class SpatialPool(SpatialLayer):
    """MaxPool/AvgPool 1d/2d/3d: halo (-inf or zero fill at the global boundary) + local pool.

    Non-overlapping windows that tile the blocks (CosmoFlow's MaxPool3d(2)) need no halo at all.
    """

    def __init__(self, pool: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(pool, name, runtime, may_gather)
        self.kind = "max" if "Max" in type(pool).__name__ else "avg"
        self.nd = int(type(pool).__name__[-2])
        nd = self.nd
        self.kernel_size = _ntuple(pool.kernel_size, nd)
        self.stride = _ntuple(pool.stride if pool.stride not in (None, ()) else pool.kernel_size, nd)
        self.padding = _ntuple(pool.padding, nd)
        self.dilation = _ntuple(getattr(pool, "dilation", 1), nd)
        self.ceil_mode = pool.ceil_mode
        self.count_include_pad = getattr(pool, "count_include_pad", True)
        self.divisor_override = getattr(pool, "divisor_override", None)
        if getattr(pool, "return_indices", False):
            raise SpatialSplitError(f"{type(pool).__name__} '{name}' returns indices, which would "
                                    "be block-local under a space split; set return_indices=False.")
        if self.kind == "max":
            self._fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
        else:
            self._fn = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[nd - 1]

    def describe(self) -> str:
        return f"kernel {self.kernel_size}, stride {self.stride}, padding {self.padding}"

    def _pool(self, x, padding, ceil_mode):
        if self.kind == "max":
            return self._fn(x, self.kernel_size, self.stride, padding, self.dilation, ceil_mode)
        if self.nd == 1:
            return self._fn(x, self.kernel_size, self.stride, padding, ceil_mode,
                            self.count_include_pad)
        return self._fn(x, self.kernel_size, self.stride, padding, ceil_mode,
                        self.count_include_pad, self.divisor_override)

    def plan(self, shape):
        rt, k = self.runtime, self.nd
        parts, coords, strides = rt.layout(k, self)
        dims, pad = [], []
        for i in range(k):
            p, b = parts[i], shape[2 + i]
            n = b * p
            w = Window(self.kernel_size[i], self.stride[i], self.dilation[i], self.padding[i],
                       self.padding[i])
            if p == 1:
                pad.append(self.padding[i])
                continue

            def works(q, n=n, w=w):
                return not isinstance(window_geometry(n, q, w), str)
            if self.kind == "avg" and not self.count_include_pad and w.lo:
                self._cannot_split(i, k, n, p, "count_include_pad=False with padding counts a "
                                   "different divisor at block borders; use count_include_pad=True",
                                   lambda q: q == 1)
            geo = window_geometry(n, p, w)
            if isinstance(geo, str):
                self._cannot_split(i, k, n, p, geo, works)
            lefts, rights, m = geo
            dims.append(SplitDim(2 + i, p, coords[i], strides[i], lefts, rights))
            pad.append(0)
        if self.ceil_mode and dims:
            full = torch.empty((1, 1) + tuple(shape[2 + i] * parts[i] for i in range(k)),
                               device="meta")
            if self._pool(full, self.padding, True).shape != self._pool(full, self.padding, False).shape:
                raise SpatialSplitError(
                    f"{self.source_type} '{self.qualname}' uses ceil_mode=True, which adds a "
                    f"partial window at this input size; under a space split use ceil_mode=False "
                    f"or an input size divisible by the stride.")
        halo = Halo(rt.space, dims, shape,
                    fill=float("-inf") if self.kind == "max" else 0.0) if dims else None
        return _PoolPlan(None if halo is None or halo.trivial else halo, tuple(pad))

    def split_forward(self, x, plan: _PoolPlan):
        if plan.halo is not None:
            x = halo_exchange(x, plan.halo)
        return self._pool(x, plan.local_pad, self.ceil_mode if plan.halo is None else False)

    def replicated_forward(self, x):
        return self._pool(x, self.padding, self.ceil_mode)


# --------------------------------------------------------------------------- upsampling
class SpatialUpsample(SpatialLayer):
    """Nearest-neighbour upsampling by integer factors: block-local, no communication."""

    def __init__(self, up: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(up, name, runtime, may_gather)
        scale = up.scale_factor
        scales = scale if isinstance(scale, tuple) else (scale,)
        if up.size is not None or up.mode not in ("nearest", "nearest-exact") or scale is None \
                or any(float(s) != int(s) for s in scales):
            raise SpatialSplitError(
                f"{type(up).__name__} '{name}' (mode={up.mode!r}, size={up.size}, "
                f"scale_factor={scale}) is not block-local; under a space split use "
                f"nn.Upsample(scale_factor=<integer>, mode='nearest'), mode='bilinear' / "
                f"'trilinear', or a ConvTranspose.")
        self.scale_factor = tuple(int(s) for s in scales) if isinstance(scale, tuple) else int(scale)
        self.mode = up.mode

    def describe(self) -> str:
        return f"scale {self.scale_factor}, {self.mode}"

    def replicated_forward(self, x):
        return F.interpolate(x, scale_factor=self.scale_factor, mode=self.mode)


# --------------------------------------------------------------------------- normalisation
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
        mode, _ = self.enter(x)
        if mode == GATHER:
            x = rt.gather(x)
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
        mode, _ = self.enter(x)
        if mode == GATHER:
            x = rt.gather(x)
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


# --------------------------------------------------------------------------- dropout
class SpatialDropout(SpatialLayer):
    """Dropout under a space split.

    Element-wise dropout on a block draws its own mask (the blocks' masks together are distributed
    as a serial mask). Channel dropout (Dropout1d/2d/3d) must drop the same channels in every block
    of a sample, and any dropout after a gather must drop the same elements on every spatial rank:
    those masks are drawn on one rank and broadcast over `space` (mask bytes, tag "dropout").
    """

    def __init__(self, drop: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(drop, name, runtime, may_gather)
        self.p = float(drop.p)
        self.channelwise = type(drop).__name__ in ("Dropout1d", "Dropout2d", "Dropout3d")

    def describe(self) -> str:
        return f"p={self.p}" + (", channels" if self.channelwise else "")

    def forward(self, x):
        mode, _ = self.enter(x)
        if mode == GATHER:
            x = self.runtime.gather(x)
        if not self.training or self.p == 0.0:
            return x
        if self.channelwise:
            shape = tuple(x.shape[:2]) + (1,) * (x.dim() - 2)
        elif mode == "split":
            return F.dropout(x, self.p, True)
        else:
            shape = tuple(x.shape)
        return x * shared_mask(shape, 1.0 - self.p, self.runtime.space, x)


# --------------------------------------------------------------------------- transitions
class SpatialFlatten(SpatialLayer):
    """nn.Flatten after the spatial layers: all-gather the blocks, then flatten (tag "gather")."""

    def __init__(self, flat: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(flat, name, runtime, may_gather)
        self.start_dim, self.end_dim = flat.start_dim, flat.end_dim

    def forward(self, x):
        mode, _ = self.enter(x)
        if mode != "replicated":
            x = self.runtime.gather(x)
        return torch.flatten(x, self.start_dim, self.end_dim)


class SpatialGlobalAvgPool(SpatialLayer):
    """AdaptiveAvgPoolNd(1): local sums / global count, summed over `space` (all-reduce, tag "pool")."""

    def forward(self, x):
        rt = self.runtime
        k = x.dim() - 2
        mode, _ = self.enter(x)
        if mode == "replicated":
            return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)
        parts, _, _ = rt.layout(k, self)
        count = math.prod(x.shape[2:]) * math.prod(parts)
        local = x.sum(dim=tuple(range(2, x.dim())), keepdim=True) / count
        out = sum_over_axis(local, rt.space, tag="pool")
        rt.gathered = True
        return out


class SpatialImagePool(SpatialLayer):
    """`models.ImagePool` (DeepLab's image-level branch) inside the split region.

    The per-sample mean over the whole sample is the sum of the blocks' sums over the global
    count, all-reduced over `space` (`AllReduceSum`, tag "pool"); the small projection runs on it
    identically on every rank, and its output is broadcast over this rank's block, so the tensors
    stay split. Backward: each rank's block contributes its own part of the gradient of the mean
    and of the projection's parameters; the gradient of the mean is all-reduced (every block used
    it), the parameters' partial gradients are summed by the data-parallel all-reduce over
    `data+space` like a split convolution's (no 1/S scaling: no rank holds the whole of them).
    Communication: one all-reduce of N × C elements forward and one backward, N × C × s bytes
    each per rank. After a gather (replicated mode) it is the plain module.
    """

    def __init__(self, pool: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(pool, name, runtime, may_gather)
        self.in_channels, self.out_channels = pool.in_channels, pool.out_channels
        self.weight, self.scale, self.shift = pool.weight, pool.scale, pool.shift

    def describe(self) -> str:
        return f"{self.in_channels} -> {self.out_channels} channels"

    def forward(self, x):
        from ...models.image_pool import broadcast_over, image_pool_features

        rt = self.runtime
        mode, _ = self.enter(x)
        if mode == GATHER:
            x = rt.gather(x)
        dims = tuple(range(2, x.dim()))
        if mode == "split":
            parts, _, _ = rt.layout(x.dim() - 2, self)
            count = math.prod(x.shape[2:]) * math.prod(parts)
            mean = AllReduceSum.apply(x.sum(dim=dims) / count, rt.space, "pool")
        else:
            mean = x.mean(dim=dims)
        return broadcast_over(image_pool_features(mean, self.weight, self.scale, self.shift), x)


class SpatialGlobalMaxPool(SpatialLayer):
    """AdaptiveMaxPoolNd(1): each block's maximum, then the maximum over `space`.

    The serial pool passes its gradient to one element, the volume's maximum; here exactly one
    spatial rank passes it on, the lowest one whose block holds the maximum (ties between blocks
    are not found in float data but after a ReLU at 0, where the ReLU stops the gradient anyway).
    Every rank returns the global maximum, so the layers after it run replicated.
    Communication: two all-reduces over `space` of N × C elements (MAX of the values, MIN of the
    rank that holds each), 2 × N × C × s bytes per rank (tag "pool"); none backward.
    """

    def __init__(self, pool: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(pool, name, runtime, may_gather)
        if pool.return_indices:
            raise SpatialSplitError(
                f"{type(pool).__name__} '{name}' has return_indices=True: the indices would be "
                f"positions in this rank's block, not in the sample. Use return_indices=False "
                f"under a space split, or space=(1, 1, 1).")

    def forward(self, x):
        rt = self.runtime
        k = x.dim() - 2
        pool = (F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d)[k - 1]
        mode, _ = self.enter(x)
        if mode == "replicated":
            return pool(x, 1)
        rt.layout(k, self)
        local = pool(x, 1)                    # its gradient goes to the block's first maximum
        best = local.detach().clone()
        all_reduce(best, rt.space, op=dist.ReduceOp.MAX, tag="pool")
        holds = local.detach() == best
        holder = torch.where(holds, float(rt.space.rank), float(rt.space.size)).to(local.dtype)
        all_reduce(holder, rt.space, op=dist.ReduceOp.MIN, tag="pool")
        rt.gathered = True
        # the value is the global maximum everywhere; only the holder's is differentiable
        return torch.where(holder == rt.space.rank, local, best)
