"""Halo exchange between the spatial blocks of one sample (DistConv's communication pattern).

Spatial parallelism splits each sample's spatial dims (d, h, w) into a grid of equal blocks, one
per rank of the `space` axis. A layer whose outputs read a neighbourhood of inputs (a convolution,
an overlapping pooling window) needs, besides its own block, a thin shell of its neighbours'
inputs: the halo. Along one split dim a rank at grid coordinate c needs `left[c]` elements below
its block and `right[c]` above it (a negative width means the layer does not read that many of
its own edge elements: they are cropped). The widths follow from kernel, stride, dilation,
padding and the block offset; `exatrain.parallel.spatial.layers` computes them.

The extended block `ext` a layer computes on is, along each split dim,

    [ left halo | own block (cropped) | right halo ]

and the product of these ranges over the split dims. Every region of `ext` outside the own block
is identified by an offset o in {-1, 0, +1}^k (k split dims, o != 0); it comes from the neighbour
at grid coordinate c + o, or is filled with `fill` (0 for zero padding, -inf for max pooling) where
c + o lies outside the grid (the global boundary). Along a periodic dim (circular padding) the grid
wraps: the neighbour is at (c + o) mod parts, so the first and last blocks exchange halos like any
other pair and nothing is filled. Faces, edges and corners all travel in ONE batched round of
non-blocking point-to-point messages (`comm.exchange`, tag "halo") to at most 3^k - 1 neighbours,
so a 3D split costs one latency, not three. Where two offsets lead to the same peer (a periodic dim
of 2 blocks: the left and the right neighbour are one rank), messages between a pair are matched
in posting order: receives are posted in increasing offset order and sends in decreasing order,
so the k-th message A sends to B (offset o) is the k-th B receives from A (offset -o).

Backward is the adjoint: the gradient of each received region is sent back to the neighbour it came
from, and each rank adds what it receives to the edge elements it had sent (regions may overlap,
e.g. a face and a corner, so the additions accumulate). Filled and cropped regions get no gradient.

Bytes, per rank and per exchange (ledger op "recv"; "send" records the mirror image):

    forward   (prod_d ext_d - prod_d own_d - filled volume) * (batch * channels) * element size
    backward  the same (skipped when the layer's input needs no gradient)

which is exactly the number of input elements this rank's outputs read but does not own: the
minimum any algorithm must move. `start`/`finish` split an exchange so that a caller can compute
on its interior while the messages are in flight.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..errors import SpatialSplitError
from .collectives import Axis, exchange


@dataclass(frozen=True)
class SplitDim:
    """One split tensor dimension as seen from this rank."""

    dim: int                   # tensor dimension (e.g. 2 for D of an (N, C, D, H, W) tensor)
    parts: int                 # blocks along it
    coord: int                 # this rank's block
    stride: int                # step of the position on the space axis per +1 of `coord`
    left: tuple[int, ...]      # halo each coordinate needs below its block (< 0: crop)
    right: tuple[int, ...]     # halo each coordinate needs above its block (< 0: crop)
    periodic: bool = False     # the grid wraps: the first and last blocks are neighbours


def _volume(shape) -> int:
    return math.prod(shape)


class Halo:
    """The exchange plan of one layer, for one rank and one block shape.

    `block_shape` is the full local tensor shape; `dims` the split dims with their halo widths.
    Raises SpatialSplitError if a halo is wider than a neighbour's block (only nearest
    neighbours talk), naming the rank, the widths and the fix.
    """

    def __init__(self, axis: Axis, dims: list[SplitDim], block_shape: tuple[int, ...],
                 fill: float = 0.0):
        self.axis, self.fill = axis, fill
        self.block_shape = tuple(block_shape)
        ndim = len(block_shape)
        center_src = [slice(None)] * ndim
        center_dst = [slice(None)] * ndim
        ext_shape = list(block_shape)
        recv_ranges, send_ranges, exists = [], [], []
        self.cropped = False
        for sd in dims:
            b, c = block_shape[sd.dim], sd.coord
            lo, hi = sd.left[c], sd.right[c]
            hl, hr, cl, cr = max(lo, 0), max(hi, 0), max(-lo, 0), max(-hi, 0)
            center = b - cl - cr
            wrap = sd.periodic
            need_up = sd.left[(c + 1) % sd.parts] if wrap or c + 1 < sd.parts else 0
            need_down = sd.right[(c - 1) % sd.parts] if wrap or c > 0 else 0
            if ((c > 0 or wrap) and hl > b) or ((c + 1 < sd.parts or wrap) and hr > b) \
                    or center <= 0 \
                    or need_up > b or need_down > b:
                wide = max(hl, hr, need_up, need_down, cl + cr + 1)
                parts = [q for q in range(1, sd.parts + 1) if b * sd.parts // q >= wide]
                raise SpatialSplitError(
                    f"rank {axis.rank} of {axis.name!r} (block {c} of {sd.parts} along tensor "
                    f"dim {sd.dim}): its block is {b} wide, too narrow for the layer's halo "
                    f"(its widths below/above {lo}/{hi}, its neighbours' {need_down}/{need_up}; "
                    f"only nearest neighbours exchange, so every block must be at least {wide} "
                    f"wide). Split that dim into at most {max(parts or [1])} parts "
                    f"(plan.space), or use a larger input.")
            self.cropped |= cl > 0 or cr > 0
            center_src[sd.dim] = slice(cl, b - cr)
            center_dst[sd.dim] = slice(hl, hl + center)
            ext_shape[sd.dim] = hl + center + hr
            recv_ranges.append({-1: (0, hl), 0: (hl, hl + center), 1: (hl + center, hl + center + hr)})
            send_ranges.append({-1: (0, need_down), 0: (cl, b - cr), 1: (b - need_up, b)})
            exists.append({-1: c > 0 or wrap, 0: True, 1: c + 1 < sd.parts or wrap})
        self.ext_shape = tuple(ext_shape)
        self.center_src, self.center_dst = tuple(center_src), tuple(center_dst)
        # (peer position, region of ext received from it, region of block sent to it)
        self.recvs: list[tuple[int, tuple]] = []
        self.sends: list[tuple[int, tuple]] = []
        self.fills: list[tuple] = []
        me = axis.rank
        for offset in itertools.product((-1, 0, 1), repeat=len(dims)):
            if not any(offset):
                continue
            recv = [slice(None)] * ndim
            send = [slice(None)] * ndim
            recv_size = send_size = 1
            for sd, o, rr, sr in zip(dims, offset, recv_ranges, send_ranges):
                recv[sd.dim] = slice(*rr[o])
                send[sd.dim] = slice(*sr[o])
                recv_size *= max(rr[o][1] - rr[o][0], 0)
                send_size *= max(sr[o][1] - sr[o][0], 0)
            if all(e[o] for e, o in zip(exists, offset)):
                peer = me + sum(((sd.coord + o) % sd.parts - sd.coord) * sd.stride
                                for sd, o in zip(dims, offset))
                if recv_size:
                    self.recvs.append((peer, tuple(recv)))
                if send_size:
                    self.sends.append((peer, tuple(send)))
            elif recv_size:
                self.fills.append(tuple(recv))
        self.sends.reverse()  # decreasing offsets: see the module doc (one peer, two offsets)
        self.recv_elements = sum(_volume(_shape(r, self.ext_shape)) for _, r in self.recvs)
        self.fill_elements = sum(_volume(_shape(r, self.ext_shape)) for r in self.fills)

    @property
    def trivial(self) -> bool:
        """True when the layer needs nothing from its neighbours and nothing is cropped."""
        return not self.recvs and not self.sends and not self.fills and not self.cropped

    # ------------------------------------------------------------------ forward
    def start(self, x: torch.Tensor):
        """Post the sends of `x`'s edges and the receives of the halos; returns a pending handle."""
        sends = [(x[region].contiguous(), peer) for peer, region in self.sends]
        recvs = [(x.new_empty(_shape(region, self.ext_shape)), peer) for peer, region in self.recvs]
        works = exchange(sends, recvs, self.axis, tag="halo") if sends or recvs else []
        return works, sends, recvs

    def finish(self, x: torch.Tensor, pending) -> torch.Tensor:
        """Assemble the extended block once the halos have arrived."""
        works, _sends, recvs = pending
        ext = x.new_empty(self.ext_shape)
        ext[self.center_dst] = x[self.center_src]
        for region in self.fills:
            ext[region] = self.fill
        for work in works:
            work.wait()
        for (buf, _peer), (_, region) in zip(recvs, self.recvs):
            ext[region] = buf
        return ext

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(x, self.start(x))

    # ------------------------------------------------------------------ backward
    def start_backward(self, grad_ext: torch.Tensor):
        """Send the halo gradients back to their owners; post receives for our edges' gradients."""
        sends = [(grad_ext[region].contiguous(), peer) for peer, region in self.recvs]
        recvs = [(grad_ext.new_empty(_shape(region, self.block_shape)), peer)
                 for peer, region in self.sends]
        works = exchange(sends, recvs, self.axis, tag="halo") if sends or recvs else []
        return works, sends, recvs

    def finish_backward(self, grad_ext: torch.Tensor, pending) -> torch.Tensor:
        """The gradient of the own block: its centre plus what the neighbours sent back."""
        works, _sends, recvs = pending
        if self.cropped:
            grad = grad_ext.new_zeros(self.block_shape)
            grad[self.center_src] = grad_ext[self.center_dst]
        else:
            grad = grad_ext[self.center_dst].clone(memory_format=torch.contiguous_format)
        for work in works:
            work.wait()
        for (buf, _peer), (_, region) in zip(recvs, self.sends):
            grad[region] += buf
        return grad


def _shape(region: tuple, full: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(region, full))


class HaloExchange(torch.autograd.Function):
    """x (own block) -> ext (block with halos and boundary fill); backward returns halo gradients.

    Communication: one batched round of point-to-point messages each way (see the module doc for
    the byte formula); nothing when the layer needs no halo.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, halo: Halo) -> torch.Tensor:
        ctx.halo = halo
        return halo.exchange(x)

    @staticmethod
    def backward(ctx, grad_ext: torch.Tensor):
        halo: Halo = ctx.halo
        return halo.finish_backward(grad_ext, halo.start_backward(grad_ext)), None


def halo_exchange(x: torch.Tensor, halo: Halo) -> torch.Tensor:
    """Differentiable halo exchange: the extended block of `x` under `halo`'s plan."""
    if halo.trivial:
        return x
    return HaloExchange.apply(x, halo)
