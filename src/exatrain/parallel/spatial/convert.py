"""Spatial parallelism: each sample's spatial domain split over the `space` axis (DistConv).

    Plan(data=2, space=(1, 2, 2))   # 8 ranks: 2 replicas, each sample split 2 × 2 over (h, w)

`parallelize_spatial(model, mesh)` returns a copy of a plain PyTorch conv net in which every layer
that sees spatially split tensors is replaced by its distributed version
(modules conv, pool, norm, interpolate, dropout of this package), with the same parameter and
buffer names, so the state dict and checkpoints are those of the serial model. The model's own
forward runs unchanged; its input on each rank is that rank's block of each sample
(`SpatialBlocks` reads it from HDF5 with a hyperslab, or `split_input` cuts it from a whole sample), laid out row-major over
(space_d, space_h, space_w); a 2D model (N, C, H, W) uses (space_h, space_w), a 1D one space_w.

Layers, in the model's registration order (which must be its execution order):

  split region       from the input up to the first nn.Flatten / AdaptiveAvgPool(1): convolutions
                     (halo exchange), pooling, BatchNorm (statistics over data × space),
                     GroupNorm and InstanceNorm (per sample, over space), LayerNorm/RMSNorm
                     over channels, pointwise activations, dropout, nearest and (bi/tri)linear
                     upsampling, transposed convolutions. Anything else there is refused with
                     an error naming the layer.
  transition         nn.Flatten gathers the blocks (all-gather); AdaptiveAvgPool(1) and
                     AdaptiveMaxPool(1) reduce them (all-reduce); so does the first
                     channel/filter-parallel convolution under Plan(space=..., tensor=...) (a gather before it: parallel/tensor/switch.py).
                     A layer of an nn.Sequential whose blocks became too small to split gathers
                     early, if the model has such a transition anyway.
  replicated region  everything after: runs on identical whole tensors on every spatial rank.

Segmentation models under space × tensor (no nn.Flatten / AdaptiveAvgPool(1) after the switch,
e.g. DeepCAM with parallel.chanfilt_from='fuse.0.0'): the output is whole after the switch while
the targets are blocks, so the model's whole output is cut back into this rank's block
(`SplitBlocks`), in the forwards that gathered. Its backward all-gathers the block gradients, so
every spatial rank holds the whole, identical output gradient, as the replicated region expects.
Communication: one all-gather over `space` per backward, tag "output", N × C_out × V_out × s bytes
per rank (the whole output's gradient: V_out its whole volume, s bytes per element). A skip
connection that joins after the switch (a tensor a layer before the switch computed on blocks,
fed to a layer after it) cannot meet the whole tensors there: where the block tensor enters a
layer after the switch as it is, it is refused, naming the switch and the layer, with the fix
(move parallel.chanfilt_from to a convolution after the join). Where it first goes through a
function (torch.cat of the skip itself, a slice), only torch's size mismatch says so.

Whole samples (`whole_samples=True`: a user's own model and data set, `et.fit`). The model takes
whole samples and returns whole outputs, as on one process, so the user's loss and metrics see
exactly what they would serially, whatever they reduce over (a per-voxel mean, a weighted or
Dice loss, a per-sample loss after a global pool). Before the forward, every tensor argument
(N, C, *spatial) is cut into this rank's block (a slice: no communication); after it, an output
that is still split (no nn.Flatten / global pool ran) is all-gathered over `space` (tag
"output", N × C_out × V_out × s bytes per rank: the whole output, V_out its volume, s bytes per
element); its backward keeps the own block's slice of the loss gradient, which every spatial rank
computes identically from the same whole output and target. An output that lost spatial dims
without such a module (x.flatten(1) written in forward: a reduction that saw only the block)
is refused, naming the module to use instead; arithmetic in the user's forward that reads
neighbouring voxels or reduces over a spatial dim is refused at the first forward (guard.py).
With `input_blocks=True`
as well (a user's data set read by blocks, `SpatialBlocks` over its `read(index, region)`), the
input is already this rank's block and is not cut again; the output is gathered whole all the
same, so the user's loss and metrics, and the whole targets the data set reads, are the serial
ones. Without `whole_samples` (the built-in workloads, which read blocks with `SpatialBlocks`
and write their losses for split outputs), the input is this rank's block and a split output
stays split.

Gradients. `parallel.apply` wraps the result in data parallelism over `data+space` that SUMS over
the spatial ranks of a sample and averages over data replicas. A split layer's weight gradient on
one rank is the partial sum over its block, so the sum is exact. A layer in the replicated region
gets the complete gradient on every spatial rank; a hook scales its parameters' gradients by 1/S
(S = spatial ranks) so that the sum counts them once. Losses over split outputs must be normalised
by the global element count (see `workloads.deepcam`), metrics on split outputs summed over
("data", "space"), on gathered outputs over ("data",).
"""

from __future__ import annotations

import copy as _copy
import math
import weakref
from functools import partial

import torch
from torch import nn
from torch.utils.data import Dataset

from ...mesh import Mesh
from .functions import GatherBlocks, ScaleGrad, SplitBlocks
from ...models.image_pool import ImagePool
from .conv import SpatialConv, SpatialConvTranspose
from .dropout import SpatialDropout
from .layers import SpatialLayer
from .norm import SpatialBatchNorm, SpatialGroupNorm, SpatialLayerNorm
from .pool import (SpatialFlatten, SpatialGlobalAvgPool, SpatialGlobalMaxPool, SpatialImagePool,
                   SpatialPool)
from ...errors import SpatialSplitError
from .guard import BlockMixingGuard
from .interpolate import upsample_layer

__all__ = ["parallelize_spatial", "SpatialSplitError", "SpatialBlocks", "block_region", "block_slices",
           "block_shape", "split_input", "gather_output", "describe_spatial", "DEFAULT_OVERLAP",
           "is_transition", "stage_regions", "whole_shape"]

# Overlap each convolution's interior with its halo transfer? Measured by `exatrain bench spatial`
# (step_s_spatial vs step_s_spatial_overlap): on a 2-core CPU, gloo's transfers share the cores with
# the convolution and it is 3-4 % slower (CosmoFlow 128³: 2.08 s vs 2.14 s), so it is off by
# default; `parallelize_spatial(..., overlap=True)` turns it on. See docs/how-to/spatial.md, "Overlap".
DEFAULT_OVERLAP = False

_CONVERT: dict[type, type] = {
    **{t: SpatialConv for t in (nn.Conv1d, nn.Conv2d, nn.Conv3d)},
    **{t: SpatialConvTranspose for t in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)},
    **{t: SpatialPool for t in (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
                                nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)},
    **{t: SpatialBatchNorm for t in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
                                     nn.SyncBatchNorm)},
    **{t: SpatialGroupNorm for t in (nn.GroupNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
                                     nn.InstanceNorm3d)},
    **{t: upsample_layer for t in (nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d)},
    **{t: SpatialLayerNorm for t in (nn.LayerNorm, nn.RMSNorm)},
    **{t: SpatialDropout for t in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)},
    nn.Flatten: SpatialFlatten,
    ImagePool: SpatialImagePool,
}
_AVG_POOLS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
_GLOBAL_POOLS = _AVG_POOLS + (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_POINTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
              nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid, nn.Tanh,
              nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid, nn.Identity, nn.Threshold)
SUPPORTED = ("Conv1d/2d/3d (any padding_mode), ConvTranspose1d/2d/3d, MaxPool/AvgPool1d/2d/3d, "
             "BatchNorm1d/2d/3d, GroupNorm, InstanceNorm1d/2d/3d, LayerNorm/RMSNorm over "
             "channels (channels-last), nearest/linear/bilinear/trilinear Upsample, "
             "Dropout/Dropout1d/2d/3d, Softmax/LogSoftmax over channels, "
             "pointwise activations, Identity, exatrain.models.ImagePool; nn.Flatten and "
             "AdaptiveAvgPool(1) / AdaptiveMaxPool(1) end the split")


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
        return _map_tensors(out, self._split_block)

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
        """Forward pre-hook of the root (whole_samples): every tensor argument (N, C, *spatial)
        becomes this rank's block; no communication (module doc, "Whole samples"). With
        `input_blocks` the arguments are blocks already: only their spatial dims are noted."""
        self.input_dims = None
        return _map_tensors(args, self._cut), _map_tensors(kwargs, self._cut)

    def _cut(self, x: torch.Tensor) -> torch.Tensor:
        k = x.dim() - 2
        if k < 1:  # (N, F) side inputs: not spatial, the same on every rank
            return x
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
        return _map_tensors(out, partial(self._gather_output, type(module).__name__))

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
                for p in module._parameters.values():
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


def _map_tensors(out, fn):
    """`out` with `fn` applied to every tensor in it (nested tuples, lists, dicts)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_map_tensors(v, fn) for v in out)
    if isinstance(out, dict):
        return {k: _map_tensors(v, fn) for k, v in out.items()}
    return out


def _direct_params(module: nn.Module) -> list[str]:
    return [n for n, p in module._parameters.items() if p is not None]


def _unsupported(name: str, module: nn.Module, why: str = "") -> SpatialSplitError:
    return SpatialSplitError(
        f"layer '{name}' ({type(module).__name__}) sits where the tensors are split into spatial "
        f"blocks (before any nn.Flatten / AdaptiveAvgPool(1)) and {why or 'exatrain has no spatial version of it'}. "
        f"Supported there: {SUPPORTED}. Replace it with a supported layer, move it after the "
        f"nn.Flatten so it runs on the gathered tensor, or set space=(1, 1, 1).")


def _convert(name: str, module: nn.Module, rt: SpatialRuntime, may_gather: bool,
             split_region: bool) -> nn.Module:
    kind = type(module)
    if getattr(module, "needs_whole_input", False):  # channel/filter-parallel: after the gather
        return module
    if kind in _CONVERT:
        if kind is nn.Flatten and split_region and module.start_dim != 1:
            raise _unsupported(name, module, f"start_dim={module.start_dim} would flatten only "
                                             "part of the spatial dims; use nn.Flatten(1)")
        return _CONVERT[kind](module, name, rt, may_gather)
    if isinstance(module, _GLOBAL_POOLS):
        size = module.output_size
        if all(s == 1 for s in (size if isinstance(size, tuple) else (size,))):
            kind = SpatialGlobalAvgPool if isinstance(module, _AVG_POOLS) else SpatialGlobalMaxPool
            return kind(module, name, rt, may_gather)
        if split_region:
            raise _unsupported(name, module, f"output_size={size} is not a global pool; only "
                                             "AdaptiveAvgPool/AdaptiveMaxPool with output size 1 "
                                             "are supported")
        return module
    if not split_region or kind in _POINTWISE:
        return module
    if kind in (nn.Softmax, nn.LogSoftmax, nn.Softmin):
        if module.dim == 1:
            return module
        raise _unsupported(name, module, f"dim={module.dim} normalises over split dims; only "
                                         "dim=1 (channels) is block-local")
    if kind in (nn.Linear, nn.Bilinear, nn.LazyLinear):
        raise _unsupported(name, module, "a dense layer needs the whole sample; put an nn.Flatten "
                                         "module (not x.flatten() in forward) before it, where "
                                         "exatrain gathers the blocks")
    raise _unsupported(name, module)


def _install_switch(model: nn.Module, leaves: list, transition: int, rt: SpatialRuntime,
                    split_output: bool) -> None:
    """The hooks of a spatial -> channel/filter switch at `leaves[transition]` (module doc).

    Its input blocks are gathered before it. Layers registered after it must not see a tensor
    that a layer before it computed on blocks (a skip connection that joins after the switch):
    that is refused naming both layers. `split_output`: the model has no nn.Flatten /
    AdaptiveAvgPool(1) after the switch (a segmentation model); its whole output is cut back
    into this rank's block. `leaves`: the converted layers (a replaced one loses its hooks).
    """
    switch, layer = leaves[transition]
    layer.register_forward_pre_hook(
        lambda _m, args: None if rt.gathered else (rt.gather(args[0]), *args[1:]))
    for _name, module in leaves[:transition]:
        module.register_forward_hook(rt.note_blocks)
    for name, module in leaves[transition + 1:]:
        module.register_forward_pre_hook(partial(rt.check_whole, switch, name))
    if split_output:
        model.register_forward_hook(rt.split_output)


def parallelize_spatial(model: nn.Module, mesh: Mesh, overlap: bool | None = None,
                        split_input: bool = True,
                        batchnorm_axes: tuple[str, ...] = ("data",), copy: bool = True,
                        whole_samples: bool = False, input_blocks: bool = False) -> nn.Module:
    """A copy of `model` whose layers work on this rank's spatial blocks (see the module doc).

    Raises SpatialSplitError naming the first layer that cannot run under the split. Kernel,
    stride and split combinations are checked at the first forward (they need the input size).
    `split_input=False`: `model` is a pipeline stage after the transition (its input is whole and
    the same on every spatial rank): nothing is converted, all of it runs replicated.
    `whole_samples=True`: the model takes whole samples and returns whole outputs (module doc,
    "Whole samples"); False: it takes this rank's blocks and a split output stays split.
    `whole_samples=True, input_blocks=True`: it takes this rank's blocks (a data set read by
    blocks) and returns whole outputs.
    """
    if mesh.plan.space_degree == 1:
        return model
    rt = SpatialRuntime(mesh, DEFAULT_OVERLAP if overlap is None else overlap, batchnorm_axes,
                        input_blocks=whole_samples and input_blocks)
    model = _copy.deepcopy(model) if copy else model
    if not split_input:
        for name, module in model.named_modules():
            if _direct_params(module):
                rt.note_mode(module, replicated=True, name=name)
        model.spatial_runtime = rt
        return model
    named = list(model.named_modules(remove_duplicate=False))
    leaves = [(n, m) for n, m in named if not list(m.children())]
    transition = next((i for i, (_, m) in enumerate(leaves)
                       if type(m) is nn.Flatten or isinstance(m, _GLOBAL_POOLS)
                       or getattr(m, "needs_whole_input", False)), None)
    # a channel/filter-parallel convolution (tensor × space): the switch from spatial blocks to
    # whole samples is there; it gathers the blocks first (the redistribution, counted)
    switch = transition is not None and getattr(leaves[transition][1], "needs_whole_input", False)
    segmentation = switch and not any(is_transition(m) for _, m in leaves[transition:])
    split_names = {n for i, (n, _) in enumerate(leaves) if transition is None or i <= transition}
    by_name = dict(named)
    for name, module in named:  # containers holding parameters of their own
        if list(module.children()) and _direct_params(module):
            inside = [n for n in split_names if module is model or n.startswith(name + ".")]
            if inside or module is model:
                raise SpatialSplitError(
                    f"'{name or type(module).__name__}' ({type(module).__name__}) holds parameters "
                    f"({', '.join(_direct_params(module))}) that its own forward uses; exatrain "
                    f"cannot tell whether they act on split blocks or on gathered tensors. Move "
                    f"them into a layer module, or set space=(1, 1, 1).")
            rt.note_mode(module, replicated=True, name=name)  # wholly after the transition
    done: dict[int, nn.Module] = {}
    root = model
    for name, module in leaves:
        if id(module) in done:
            new = done[id(module)]
        else:
            parent_name = name.rpartition(".")[0]
            parent = by_name.get(parent_name, model) if name else None
            may_gather = (transition is not None and name in split_names
                          and type(parent) is nn.Sequential)
            new = done[id(module)] = _convert(name or type(module).__name__, module, rt,
                                              may_gather, name in split_names)
            if new is module and _direct_params(module):
                # a plain layer with parameters can only sit after the transition (the split
                # region refuses it): it runs on the gathered tensor on every spatial rank
                rt.note_mode(module, replicated=True, name=name)
        if new is not module:
            if not name:
                root = new
            else:
                parent_name, _, key = name.rpartition(".")
                setattr(by_name.get(parent_name, model) if parent_name else model, key, new)
    if switch:  # on the converted layers: a replaced layer does not keep its hooks
        # on whole samples the targets are whole too: the whole output stays whole
        _install_switch(root, [(n, done[id(m)]) for n, m in leaves], transition, rt,
                        split_output=segmentation and not whole_samples)
    root.register_forward_pre_hook(rt.begin)
    if whole_samples:
        rt.first_layer = next((m for m in root.modules() if isinstance(m, SpatialLayer)), None)
        root.register_forward_pre_hook(rt.cut_input, with_kwargs=True)
        root.register_forward_pre_hook(rt.watch_first_forward)
        root.register_forward_hook(rt.whole_output)
        root.register_forward_hook(rt.stop_watching, always_call=True)
    root.spatial_runtime = rt
    return root


def describe_spatial(model: nn.Module) -> str:
    """What each distributed layer did so far: mode per input shape and halo elements received.

    Modes: split (ran on blocks), gather (gathered its input first; the reason follows), and
    replicated (ran on the gathered tensor). Run one forward pass first.
    """
    model = getattr(model, "module", model)  # a data-parallel wrapper
    lines = []
    for m in model.modules():
        if not isinstance(m, SpatialLayer):
            continue
        for shape, (mode, plan) in m._plans.items():
            halo = getattr(plan, "halo", None)
            received = halo.recv_elements if halo is not None else 0
            line = (f"{m.qualname:<28} {m.source_type:<16} {mode:<10} input {list(shape)}"
                    f"  halo {received} elements")
            lines.append(line + (f"\n    because {m.gather_reason}" if mode == "gather" else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------------- pipeline stages
def is_transition(module: nn.Module) -> bool:
    """Does `module` end the split region (gather or reduce the blocks)?"""
    if type(module) is nn.Flatten:
        return True
    size = getattr(module, "output_size", None)
    return isinstance(module, _GLOBAL_POOLS) and all(
        s == 1 for s in (size if isinstance(size, tuple) else (size,)))


def stage_regions(stages: list[nn.Module]) -> list[tuple[bool, bool]]:
    """(input split?, output split?) of each pipeline stage, in order: tensors are split into
    blocks from the model's input up to the first stage holding a transition layer."""
    regions, split = [], True
    for stage in stages:
        after = split and not any(is_transition(m) for m in stage.modules())
        regions.append((split, after))
        split = after
    return regions


def whole_shape(shape: tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
    """The whole (N, C, *spatial) shape whose blocks have `shape`."""
    k = len(shape) - 2
    parts = tuple(mesh.plan.space)[3 - k:]
    return tuple(shape[:2]) + tuple(n * p for n, p in zip(shape[2:], parts))


def block_shape(shape: tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
    """This rank's block of a whole (N, C, *spatial) shape (equal blocks)."""
    region = block_region(tuple(shape[2:]), mesh)
    return tuple(shape[:2]) + tuple(r.stop - r.start for r in region)


# ------------------------------------------------------------------------- data layout
def block_region(sample_shape: tuple[int, ...], mesh: Mesh) -> tuple[slice, ...]:
    """This rank's block of a sample with spatial shape `sample_shape` ((d, h, w), (h, w) or (w,)).

    Blocks are equal: each spatial size must be divisible by its degree.
    """
    return block_slices(sample_shape, tuple(mesh.plan.space),
                        tuple(mesh.coords[f"space_{a}"] for a in "dhw"))


def own_dims(space: tuple[int, int, int], k: int) -> tuple[int, int, int]:
    """`space` (d, h, w) with the degrees of the dims a k-D sample lacks moved onto its first own
    dim: the split a k-D model can take on the same ranks ((2, 1, 1), k=2 -> (1, 2, 1))."""
    if not 1 <= k <= 3:
        return tuple(space)
    lost = math.prod(space[:3 - k])
    return (1,) * (3 - k) + (lost * space[3 - k],) + tuple(space[4 - k:])


def block_slices(sample_shape: tuple[int, ...], space: tuple[int, int, int],
                 coords: tuple[int, int, int]) -> tuple[slice, ...]:
    """The block at grid `coords` (d, h, w) of a sample split by `space` (d, h, w)."""
    k = len(sample_shape)
    parts = tuple(space)
    if any(p > 1 for p in parts[:3 - k]):
        raise SpatialSplitError(f"samples of spatial shape {tuple(sample_shape)} have {k} spatial "
                                f"dims but the plan splits space={parts} (d, h, w); use "
                                f"space={own_dims(parts, k)} on as many ranks.")
    region = []
    for n, p, c, a in zip(sample_shape, parts[3 - k:], coords[3 - k:], "dhw"[3 - k:]):
        if n % p:
            ok = [q for q in range(1, min(n, 64) + 1) if n % q == 0]
            raise SpatialSplitError(f"the samples are {n} long along {a}, which space_{a}={p} does "
                                    f"not divide into equal blocks; use one of {ok}.")
        region.append(slice(c * n // p, (c + 1) * n // p))
    return tuple(region)


class SpatialBlocks(Dataset):
    """A data set whose samples are this rank's spatial block of the samples of `dataset`.

    Each item is `dataset.read(index, region)`: an HDF5 hyperslab read of the block only, never
    the whole sample. `bytes_read` is the underlying data set's counter (bytes this process read).
    """

    def __init__(self, dataset, region: tuple[slice, ...]):
        if not hasattr(dataset, "read"):
            raise TypeError(f"{type(dataset).__name__} has no read(index, region) method; spatial "
                            "parallelism needs a data set that can read a block of a sample.")
        self.dataset, self.region = dataset, tuple(region)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        return self.dataset.read(index, self.region)

    def __getitems__(self, indices: list[int]):
        """A batch of blocks, read straight into one buffer where the data set can (raw counts)."""
        if hasattr(self.dataset, "read_batch"):
            return self.dataset.read_batch(indices, self.region)
        return [self.dataset.read(i, self.region) for i in indices]

    @property
    def bytes_read(self) -> int:
        return self.dataset.bytes_read

    @property
    def read_counter(self):
        """The underlying data set's `data.reads.ReadCounter`, if it keeps one."""
        return getattr(self.dataset, "read_counter", None)

    def targets(self):
        return self.dataset.targets()


def split_input(x: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """This rank's block of a whole batch (N, C, *spatial); differentiable (backward all-gathers)."""
    k = x.dim() - 2
    parts = tuple(mesh.plan.space)[3 - k:]
    coords = tuple(mesh.coords[f"space_{a}"] for a in "dhw"[3 - k:])
    block_region(tuple(x.shape[2:]), mesh)  # the same checks and messages
    return SplitBlocks.apply(x, mesh.axis("space"), parts, coords)


def gather_output(y: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """The whole tensor from the blocks of a split output (N, C, *spatial), on every rank."""
    k = y.dim() - 2
    parts = tuple(mesh.plan.space)[3 - k:]
    coords = tuple(mesh.coords[f"space_{a}"] for a in "dhw"[3 - k:])
    return GatherBlocks.apply(y, mesh.axis("space"), parts, coords)
