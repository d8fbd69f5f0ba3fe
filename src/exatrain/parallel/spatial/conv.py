"""Distributed convolutions for the `space` axis: Conv1d/2d/3d (halo exchange, then the local
convolution; optionally overlapped) and ConvTranspose1d/2d/3d.

The halo widths follow from each window's geometry (`layers.window_geometry`,
`layers.transpose_geometry`; the formulas are in `layers`' docstring). Communication: the
`comm.halo` exchange forward and its adjoint backward (tag "halo"); the weights' gradients are
partial sums over the block, summed with the data-parallel all-reduce over `data+space`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.halo import Halo, SplitDim, halo_exchange
from .layers import GATHER, SpatialLayer, Window, ntuple, transpose_geometry, window_geometry
from ...errors import SpatialSplitError

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
        self.out_channels = conv.out_channels
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
            lo = hi = ntuple(conv.padding, self.nd)
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
        dims, local_pad, out_shape = [], [], [shape[0], self.out_channels]
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
