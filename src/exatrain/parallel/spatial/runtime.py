"""What the distributed layers of one spatially parallel model share (`SpatialRuntime`): the
grid and its axes, the per-forward state (gathered yet? which layers ran replicated), and the
model-boundary hooks that cut whole inputs into blocks and gather outputs whole
(`parallelize_spatial(whole_samples=True)`), described in convert.py.
"""

from __future__ import annotations

import math
import weakref
from functools import partial

import torch
from torch import nn

from ...errors import SpatialSplitError
from ...mesh import Mesh
from .blocks import block_slices, own_dims
from .functions import GatherBlocks, ScaleGrad, SplitBlocks
from .guard import BlockMixingGuard
from .layers import SpatialLayer
from ..nested import map_tensors, tensors_of


class SpatialRuntime:
    """What the layers of one spatially parallel model share: grid, axes, per-forward state."""

    def __init__(self, mesh: Mesh, overlap: bool, batchnorm_axes: tuple[str, ...] = ("data",),
                 input_blocks: bool = False):
        plan = mesh.plan
        self.input_dims: int | None = None  # spatial dims of the whole input (whole_samples)
        self.input_blocks = input_blocks   # whole_samples: the inputs come as blocks already
        self.watched, self.guard = False, None  # whole_samples: the first forward's check
        self.first_layer: SpatialLayer | None = None  # the first distributed layer, for messages
        self.parts = tuple(plan.space)
        self.coords = tuple(mesh.coords[f"space_{a}"] for a in "dhw")
        _, h, w = self.parts
        self.strides = (h * w, w, 1)
        self.size = math.prod(self.parts)
        self.space = mesh.axis("space")
        # BatchNorm statistics: over the whole sample always, and over `batchnorm_axes` (the
        # replica axes with parallel.batchnorm = "global", none with "replica")
        self.batch_axis = mesh.axis(*batchnorm_axes, "space")  # over split tensors
        self.data_axis = mesh.axis(*batchnorm_axes)            # over gathered tensors
        position = sum(c * s for c, s in zip(self.coords, self.strides))
        assert self.space.rank == position, (self.space.rank, position)
        self.overlap = overlap
        self.gathered = False          # set once the blocks of this forward pass are gathered
        self._blocks: dict[int, weakref.ref] = {}  # outputs on blocks (before a tensor switch)
        self._modes: dict[int, tuple[str, bool]] = {}

    # ---------------------------------------------------------------- per forward
    def begin(self, _module, _args) -> None:
        """Forward pre-hook of the root module: every forward starts on split blocks."""
        self.gathered = False
        self._blocks = {}

    # ---------------------------------------------------------------- at a tensor switch
    def note_blocks(self, _module, _args, out) -> None:
        """Forward hook of the layers before the switch: remember their outputs on blocks (weak
        references, so nothing is kept alive), to recognise them after the switch."""
        if not self.gathered and isinstance(out, torch.Tensor):
            self._blocks[id(out)] = weakref.ref(out)

    def check_whole(self, switch: str, name: str, module: nn.Module, args) -> None:
        """Forward pre-hook of the layers after the switch: their input must be whole."""
        if not self.gathered:
            return
        for x in args:
            ref = self._blocks.get(id(x)) if isinstance(x, torch.Tensor) else None
            if ref is not None and ref() is x:
                raise SpatialSplitError(
                    f"layer '{name}' ({type(module).__name__}) runs after the switch to channel/"
                    f"filter parallelism at '{switch}', where the tensors are whole samples, but "
                    f"its input {list(x.shape)} was computed before the switch on this rank's "
                    f"spatial block (a skip connection that joins after the switch): it cannot "
                    f"meet the whole tensors there (torch.cat or + would fail on the sizes). "
                    f"Move parallel.chanfilt_from to a convolution after the skip joins (one "
                    f"that runs on the joined tensor), or use Plan(space=...) or "
                    f"Plan(tensor=...) alone.")

    def split_output(self, _module, _args, out):
        """Forward hook of the root of a model without Flatten / AdaptiveAvgPool(1) after the
        switch (a segmentation model): its output is whole and identical on every spatial rank;
        return this rank's block of it, as its targets are blocks (`SplitBlocks`).

        Communication: none forward; backward one all-gather of the output's gradient over
        `space` (tag "output"), S × block bytes per rank: S × N × C_out × V_out / S × s =
        N × C_out × V_out × s bytes (the whole output's gradient; V_out its whole volume, s
        bytes per element). Every spatial rank then holds the whole, identical gradient, which
        the replicated layers after the switch expect (their parameter gradients are scaled by
        1/S and summed over `space`).
        """
        self._blocks = {}
        if not self.gathered:
            return out  # the switch did not run: the output is still blocks
        return map_tensors(out, self._split_block)

    def _split_block(self, y: torch.Tensor) -> torch.Tensor:
        k = y.dim() - 2
        if k < 1:
            raise SpatialSplitError(
                f"the model's output {list(y.shape)} has no spatial dims, but the model has no "
                f"nn.Flatten or AdaptiveAvgPool(1) after its switch to channel/filter parallelism "
                f"for exatrain to gather at; put an nn.Flatten module before its dense layers.")
        parts, coords, _ = self.layout(k, None)
        for n, p, a in zip(y.shape[2:], parts, "dhw"[3 - k:]):
            if n % p:
                raise SpatialSplitError(
                    f"the model's output {list(y.shape)} is {n} long along {a}, which "
                    f"space_{a}={p} does not divide into the blocks its targets are cut in.")
        return SplitBlocks.apply(y, self.space, parts, coords, "output")

    def gather(self, x: torch.Tensor, tag: str = "gather") -> torch.Tensor:
        parts, coords, _ = self.layout(x.dim() - 2, None)
        self.gathered = True
        return GatherBlocks.apply(x, self.space, parts, coords, tag)

    # ---------------------------------------------------------------- whole samples in and out
    def cut_input(self, _module, args, kwargs):
        """Forward pre-hook of the root (whole_samples): the field (the argument of the most
        dims, (N, C, *spatial)) and every argument shaped like it become this rank's blocks;
        arguments of fewer dims ((N, F) parameters, (N, T, F) sequences) stay whole, the same on
        every rank; no communication (module doc, "Whole samples"). With `input_blocks` the
        arguments are blocks already: only their spatial dims are noted."""
        self.input_dims = None
        field = max(tensors_of((args, kwargs)), key=lambda t: t.dim(), default=None)
        cut = partial(self._cut, field=field)
        return map_tensors(args, cut), map_tensors(kwargs, cut)

    def _cut(self, x: torch.Tensor, field: torch.Tensor) -> torch.Tensor:
        k = x.dim() - 2
        if k < 1 or x.dim() != field.dim():   # not the field: the same on every rank
            return x
        if x.shape[2:] != field.shape[2:]:
            raise SpatialSplitError(
                f"the model's inputs hold spatial dims of two sizes, {list(field.shape[2:])} and "
                f"{list(x.shape[2:])}: under space={self.parts} exatrain cuts every input shaped "
                f"like the field into the same blocks, and cannot tell which blocks of the other "
                f"belong with which. Give it at the field's size (upsampled in the data set), "
                f"or train with space=(1, 1, 1).")
        # a plan that splits dims the input lacks is refused naming the layer it would meet
        parts, coords, _ = self.layout(k, self.first_layer)
        if self.input_blocks:
            self.input_dims = k if self.input_dims is None else max(self.input_dims, k)
            return x
        block_slices(tuple(x.shape[2:]), (1,) * (3 - k) + tuple(parts),
                     (0,) * (3 - k) + tuple(coords))  # divisibility, with the sizes that work
        self.input_dims = k if self.input_dims is None else max(self.input_dims, k)
        return SplitBlocks.apply(x, self.space, parts, coords)

    def watch_first_forward(self, module, _args) -> None:
        """Forward pre-hook of the root (whole_samples), after `cut_input`: the first forward
        runs under `guard.BlockMixingGuard`, which refuses arithmetic in the user's forward
        that would read a block as the whole sample. Compiled forwards are not watched."""
        if self.watched or torch.compiler.is_compiling():
            return
        self.watched = True
        self.guard = BlockMixingGuard(self, type(module).__name__)
        self.guard.__enter__()

    def stop_watching(self, _module, _args, _out) -> None:
        """Forward hook of the root, run also when the forward raised (always_call)."""
        if self.guard is not None:
            guard, self.guard = self.guard, None
            guard.__exit__(None, None, None)

    def whole_output(self, module, _args, out):
        """Forward hook of the root (whole_samples): the output as whole tensors on every rank
        (an all-gather over `space`, tag "output") unless a transition already made it whole."""
        if self.gathered or self.input_dims is None:
            return out
        return map_tensors(out, partial(self._gather_output, type(module).__name__))

    def _gather_output(self, model: str, y: torch.Tensor) -> torch.Tensor:
        if y.dim() - 2 != self.input_dims:
            raise SpatialSplitError(
                f"{model}'s output {list(y.shape)} has {max(y.dim() - 2, 0)} spatial dims and "
                f"its input {self.input_dims}, but no nn.Flatten, AdaptiveAvgPool(1) or "
                f"AdaptiveMaxPool(1) module ran: a reduction over the spatial dims written in "
                f"forward (x.mean(dim=...), x.flatten(1), F.adaptive_avg_pool3d(x, 1), x.amax) "
                f"sees only this rank's block under space={self.parts}, so it would differ from "
                f"one process. Use the module instead (self.pool = nn.AdaptiveAvgPool3d(1), "
                f"nn.Flatten(1)), which exatrain reduces over the whole sample; or use "
                f"space=(1, 1, 1).")
        return self.gather(y, tag="output")

    def layout(self, k: int, layer) -> tuple[tuple, tuple, tuple]:
        """(parts, coords, position strides) of the last k spatial dims, for a k-D layer."""
        if not 1 <= k <= 3 or any(p > 1 for p in self.parts[:3 - k]):
            what = f"{layer.source_type} '{layer.qualname}'" if layer is not None else "a tensor"
            dims = "dhw"[3 - k:] if 1 <= k <= 3 else "?"
            raise SpatialSplitError(
                f"{what} has {k} spatial dims ({', '.join(dims)}) but the plan splits "
                f"space={self.parts} (d, h, w): a {k}D model can only split its own dims, "
                f"e.g. space={own_dims(self.parts, k)} on as many ranks.")
        return self.parts[3 - k:], self.coords[3 - k:], self.strides[3 - k:]

    # ---------------------------------------------------------------- gradient bookkeeping
    def note_mode(self, module: nn.Module, replicated: bool, name: str = "") -> None:
        """Record whether `module` runs on split or gathered tensors; scale replicated grads.

        A module that runs replicated (on the whole tensor, identically on every spatial rank)
        gets its parameters' gradients scaled by 1/S, once, so the sum over `space` counts them
        once. Its mode may not change later: that would need the hook added or removed.
        """
        key = id(module)
        seen = self._modes.get(key)
        if seen is None:
            self._modes[key] = (name or getattr(module, "qualname", ""), replicated)
            if replicated and self.size > 1:
                # its own parameters, with those its parametrizations hold (a weight-normed conv)
                held = getattr(module, "parametrizations", None)
                own = [*module._parameters.values(),
                       *(held.parameters() if isinstance(held, nn.ModuleDict) else ())]
                for p in own:
                    if p is not None and p.requires_grad:
                        p.register_hook(ScaleGrad(1.0 / self.size))
        elif seen[1] != replicated:
            raise RuntimeError(
                f"layer '{seen[0]}' ran on {'gathered' if seen[1] else 'split'} tensors before and "
                f"on {'gathered' if replicated else 'split'} tensors now; the spatial layout of a "
                f"model must not change between calls (did the input size change?).")

    def modes(self) -> list[tuple[str, bool]]:
        """(layer name, runs replicated?) of every layer with parameters that has run so far."""
        return list(self._modes.values())
