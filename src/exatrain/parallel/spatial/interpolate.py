"""Upsampling over spatial blocks: nearest-neighbour by integer factors and sub-pixel
rearrangement (`nn.PixelShuffle` / `nn.PixelUnshuffle`), both block-local with no
communication, and linear, bilinear and trilinear (`nn.Upsample`, `nn.UpsamplingBilinear2d`),
with and without `align_corners`, which the rest of this docstring describes.

Along one dim of global input length N and output length M, torch's linear interpolation reads,
for output j, the inputs i0 = floor(src) and i1 = min(i0 + 1, N - 1) with weight
λ = src − i0 on i1, where

    align_corners=True    src = j (N − 1) / (M − 1)
    align_corners=False   src = max(σ (j + 1/2) − 1/2, 0),   σ = 1 / scale_factor when it is
                          given (and not recomputed), else N / M

(M = N copies: the identity). The layer computes these source indices and weights in global
coordinates, once per input shape, in torch's arithmetic (float32, or float64 for float64
inputs), so block r's outputs [r m, (r + 1) m) (m = M / P) read exactly the inputs and weights
serial interpolation uses: the smallest i0 and largest i1 of the block set its halo widths (one
cell for upsampling, either mapping; the boundary needs none: i0 ≥ 0 and i1 ≤ N − 1). After the
halo exchange the block interpolates one dim at a time, y = (1 − λ) x[i0] + λ x[i1]
(index_select; separable, where torch sums the 2^k corner terms at once: equal up to rounding).

Communication: the `comm.halo` exchange forward and its adjoint backward (tag "halo"): per rank
(prod_d ext_d − prod_d own_d) × N × C × s bytes, one cell per split side for upsampling, i.e.
about 2 k / b of the block's bytes for k split dims of blocks b long.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.halo import Halo, SplitDim, halo_exchange
from .layers import SpatialLayer, check_widths, ntuple
from ...errors import SpatialSplitError

LINEAR_MODES = ("linear", "bilinear", "trilinear")


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


class SpatialPixelShuffle(SpatialLayer):
    """nn.PixelShuffle, (N, C·r², H, W) -> (N, C, H·r, W·r), and its inverse nn.PixelUnshuffle,
    on blocks of H and W: block-local, no communication. Output cells (h·r + i, w·r + j) come
    from input cell (h, w) alone, so a block of b rows gives the output block of b·r rows at the
    same place; PixelUnshuffle needs each block's H and W divisible by r (its groups of r cells
    then never cross a block's edge). Both act on the last two dims only, and mix dim -3 into the
    channels: a split d (space_d > 1) or a 1D model is refused."""

    def __init__(self, module: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(module, name, runtime, may_gather)
        self.unshuffle = isinstance(module, nn.PixelUnshuffle)
        self.factor = module.downscale_factor if self.unshuffle else module.upscale_factor

    def describe(self) -> str:
        return f"{'downscale' if self.unshuffle else 'upscale'} factor {self.factor}"

    def plan(self, shape):
        if len(shape) < 4:
            raise SpatialSplitError(
                f"{self.source_type} '{self.qualname}' rearranges the last two dims of an "
                f"(N, C, H, W) input; its input here is {len(shape)}-dimensional {list(shape)}, "
                f"so it would mix the channels into a split dim. Set space=(1, 1, 1).")
        parts, _, _ = self.runtime.layout(2, self)   # refuses a split d (dim -3 of a volume)
        r = self.factor
        for i, (p, block) in enumerate(zip(parts, shape[-2:])):
            if self.unshuffle and p > 1 and block % r:
                self._cannot_split(i, 2, block * p, p, f"its blocks of {block} do not divide "
                                   f"into groups of {r} cells", lambda q, n=block * p: (n // q) % r == 0)
        return ()

    def replicated_forward(self, x):
        return (F.pixel_unshuffle if self.unshuffle else F.pixel_shuffle)(x, self.factor)


def upsample_layer(up: nn.Module, name: str, runtime, may_gather: bool = False) -> SpatialLayer:
    """The spatial version of an nn.Upsample-like module, by its mode (or a refusal that says why)."""
    if up.mode in LINEAR_MODES:
        return SpatialInterpolate(up, name, runtime, may_gather)
    if up.mode in ("nearest", "nearest-exact"):
        return SpatialUpsample(up, name, runtime, may_gather)
    raise SpatialSplitError(
        f"{type(up).__name__} '{name}' uses mode={up.mode!r}, which exatrain does not split over "
        f"space blocks (bicubic reads two cells beyond each block; not built). Use "
        f"mode='bilinear'/'trilinear' or 'nearest', a ConvTranspose, or space=(1, 1, 1).")


def source_indices(n: int, m: int, align_corners: bool, scale: float | None,
                   dtype: torch.dtype = torch.float32):
    """(i0, i1, λ) of torch's linear interpolation from n to m cells, computed in `dtype` as
    torch computes them for inputs of that precision (module doc)."""
    j = torch.arange(m, dtype=dtype)
    if m == n:
        idx = torch.arange(m)
        return idx, idx, torch.zeros(m, dtype=dtype)
    if align_corners:
        sigma = torch.tensor(n - 1, dtype=dtype) / (m - 1) if m > 1 else torch.tensor(0, dtype=dtype)
        src = sigma * j
    else:
        sigma = torch.tensor(1.0 / scale if scale is not None else n, dtype=dtype)
        if scale is None:
            sigma = sigma / m
        src = (sigma * (j + 0.5) - 0.5).clamp_min(0.0)
    i0 = src.floor().long().clamp_max(n - 1)
    i1 = torch.where(i0 < n - 1, i0 + 1, i0)
    lam = (src - i0).clamp(0.0, 1.0)
    return i0, i1, lam


@dataclass
class _InterpolatePlan:
    halo: Halo | None
    steps: dict  # {float32/64: per spatial dim (tensor dim, i0, i1, λ) in the extended block}
    device: torch.device | None = None  # where the steps' tensors live (moved once)


class SpatialInterpolate(SpatialLayer):
    """Linear/bilinear/trilinear upsampling: a halo of the cells the block's outputs read (one
    for upsampling), then separable interpolation at the global source positions (module doc)."""

    def __init__(self, up: nn.Module, name: str, runtime, may_gather: bool = False):
        super().__init__(up, name, runtime, may_gather)
        self.mode, self.size, self.scale_factor = up.mode, up.size, up.scale_factor
        self.align_corners = bool(up.align_corners)
        self.recompute = bool(getattr(up, "recompute_scale_factor", None))

    def describe(self) -> str:
        what = f"size {self.size}" if self.size is not None else f"scale {self.scale_factor}"
        return f"{what}, {self.mode}, align_corners={self.align_corners}"

    def _out_sizes(self, whole: tuple[int, ...]) -> tuple[int, ...]:
        k = len(whole)
        if self.size is not None:
            return ntuple(self.size, k)
        return tuple(int(math.floor(n * float(s))) for n, s in zip(whole, ntuple(self.scale_factor, k)))

    def plan(self, shape):
        rt, k = self.runtime, len(shape) - 2
        parts, coords, strides = rt.layout(k, self)
        whole = tuple(b * p for b, p in zip(shape[2:], parts))
        outs = self._out_sizes(whole)
        scales = (None,) * k if self.size is not None or self.recompute \
            else tuple(float(s) for s in ntuple(self.scale_factor, k))
        dims, steps = [], {torch.float32: [], torch.float64: []}
        for i in range(k):
            n, m_all, p, c, b = whole[i], outs[i], parts[i], coords[i], shape[2 + i]
            # torch's indices for float32 (and half) inputs and for float64 ones
            both = {t: source_indices(n, m_all, self.align_corners, scales[i], t) for t in steps}
            if p == 1:
                for t, (i0, i1, lam) in both.items():
                    steps[t].append((2 + i, i0, i1, lam))
                continue
            if m_all % p:
                self._cannot_split(i, k, n, p, f"its output length {m_all} does not divide into "
                                   f"{p} equal blocks", lambda q, m_all=m_all: m_all % q == 0)
            m = m_all // p
            lo = torch.minimum(*(i0 for i0, _, _ in both.values()))
            hi = torch.maximum(*(i1 for _, i1, _ in both.values()))
            lefts = tuple(r * b - int(lo[r * m:(r + 1) * m].min()) for r in range(p))
            rights = tuple(int(hi[r * m:(r + 1) * m].max()) - ((r + 1) * b - 1) for r in range(p))
            reason = check_widths(lefts, rights, b)
            if reason:
                self._cannot_split(i, k, n, p, reason, lambda q: q == 1)
            dims.append(SplitDim(2 + i, p, c, strides[i], lefts, rights))
            start = c * b - lefts[c]  # global index of the extended block's first cell
            own = slice(c * m, (c + 1) * m)
            for t, (i0, i1, lam) in both.items():
                steps[t].append((2 + i, i0[own] - start, i1[own] - start, lam[own]))
        halo = Halo(rt.space, dims, shape, fill=0.0) if dims else None
        return _InterpolatePlan(None if halo is None or halo.trivial else halo, steps)

    def split_forward(self, x, plan: _InterpolatePlan):
        if plan.device != x.device:
            plan.steps = {t: [(d, i0.to(x.device), i1.to(x.device), lam.to(x.device))
                              for d, i0, i1, lam in steps] for t, steps in plan.steps.items()}
            plan.device = x.device
        if plan.halo is not None:
            x = halo_exchange(x, plan.halo)
        for dim, i0, i1, lam in plan.steps[torch.float64 if x.dtype == torch.float64
                                           else torch.float32]:
            shape = [1] * x.dim()
            shape[dim] = -1
            w1 = lam.view(shape)
            w0 = 1 - w1
            x = x.index_select(dim, i0) * w0.to(x.dtype) + x.index_select(dim, i1) * w1.to(x.dtype)
        return x

    def replicated_forward(self, x):
        return F.interpolate(x, size=self.size, scale_factor=self.scale_factor, mode=self.mode,
                             align_corners=self.align_corners,
                             recompute_scale_factor=self.recompute or None)
