"""Pooling for the `space` axis, and the transitions to the dense layers.

  SpatialPool           MaxPool/AvgPool 1d/2d/3d: halo exchange, then the local pool
  SpatialImagePool      DeepLab's image-level branch: a whole-sample mean; the tensors stay split
  SpatialGlobalAvgPool  AdaptiveAvgPoolNd(1): the whole-sample mean; the layers after it replicated
  SpatialGlobalMaxPool  AdaptiveMaxPoolNd(1): the whole-sample maximum; the layers after it replicated
  SpatialFlatten        nn.Flatten: gathers the blocks; the layers after it replicated
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...comm import all_reduce
from ...comm.halo import Halo, SplitDim, halo_exchange
from .functions import AllReduceSum, sum_over_axis
from .layers import SpatialLayer, Window, ntuple, window_geometry
from ...errors import SpatialSplitError

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
        self.kernel_size = ntuple(pool.kernel_size, nd)
        self.stride = ntuple(pool.stride if pool.stride not in (None, ()) else pool.kernel_size, nd)
        self.padding = ntuple(pool.padding, nd)
        self.dilation = ntuple(getattr(pool, "dilation", 1), nd)
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
        mode, x = self.enter_whole(x)
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
