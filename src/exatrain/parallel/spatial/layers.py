"""The base of the distributed layers of the `space` axis, and their halo geometry.

Each distributed layer replaces one `torch.nn` layer, keeps its parameters and buffers under the
same names (so state dicts and checkpoints are the serial model's), and runs in one of two modes:

  split        its input is this rank's spatial block; it computes its output block, exchanging
               halos with its neighbours where its windows cross block borders (`comm.halo`)
  replicated   its input is the whole (gathered) tensor, identical on every spatial rank; it runs
               the plain PyTorch op, and its parameters' gradients are scaled by 1/S

A layer runs replicated when an earlier layer of the same forward pass gathered the blocks: an
`nn.Flatten` or global average pool (the transition to dense layers), or a layer whose input blocks
are too small to split that sits in an `nn.Sequential` of a model that gathers anyway (the deepest
layers of CosmoFlow at small inputs); otherwise a layer that cannot be split raises an error that
names it and the splits that would work.

The layers themselves, one module per kind: `conv` (convolutions, transposed too), `pool`
(pooling and the transitions to dense layers), `norm` (BatchNorm, GroupNorm / InstanceNorm,
LayerNorm / RMSNorm), `interpolate` (upsampling), `dropout`.

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

from dataclasses import dataclass

from torch import nn

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
    return check_widths(lefts, rights, b) or (lefts, rights, m)


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
    return check_widths(lefts, rights, b) or (lefts, rights, m, offsets)


def check_widths(lefts, rights, b):
    parts = len(lefts)
    for r in range(parts):
        if r > 0 and lefts[r] > b:
            return f"it needs a halo of {lefts[r]} but the blocks are only {b} wide"
        if r < parts - 1 and rights[r] > b:
            return f"it needs a halo of {rights[r]} but the blocks are only {b} wide"
        if b - max(-lefts[r], 0) - max(-rights[r], 0) <= 0:
            return f"its blocks of {b} are smaller than the inputs it skips"
    return None


def ntuple(value, n: int) -> tuple[int, ...]:
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

    def enter_whole(self, x) -> tuple[str, object]:
        """(mode, input) for `x`: as `enter`, with the blocks gathered where the mode is GATHER
        (the opening of the layers that define their own forward: norms, dropout, image pool)."""
        mode, _ = self.enter(x)
        return mode, (self.runtime.gather(x) if mode == GATHER else x)

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
