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
                     upsampling, pixel shuffles, transposed convolutions (plain, or parametrized by
                     weight_norm / spectral_norm: the spatial layer takes the parametrization
                     over and computes the whole weight at each forward). Anything else there
                     is refused with an error naming the layer.
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
from functools import partial

from torch import nn
from torch.nn.utils.parametrize import is_parametrized, transfer_parametrizations_and_params

from ...mesh import Mesh
from ...models.image_pool import ImagePool
from ..reads import weights_set_by_hooks
from ..trial import leaves_no_trace
from .blocks import GLOBAL_POOLS, is_transition
from .conv import SpatialConv, SpatialConvTranspose
from .dropout import SpatialDropout
from .layers import SpatialLayer
from .norm import SpatialBatchNorm, SpatialGroupNorm, SpatialLayerNorm
from .pool import (SpatialFlatten, SpatialGlobalAvgPool, SpatialGlobalMaxPool, SpatialImagePool,
                   SpatialPool)
from ...errors import SpatialSplitError
from .interpolate import SpatialPixelShuffle, upsample_layer
from .runtime import SpatialRuntime

__all__ = ["parallelize_spatial", "describe_spatial", "spatial_refusal", "DEFAULT_OVERLAP"]

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
    **{t: SpatialPixelShuffle for t in (nn.PixelShuffle, nn.PixelUnshuffle)},
    **{t: SpatialLayerNorm for t in (nn.LayerNorm, nn.RMSNorm)},
    **{t: SpatialDropout for t in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)},
    nn.Flatten: SpatialFlatten,
    ImagePool: SpatialImagePool,
}
_AVG_POOLS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)
_POINTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
              nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid, nn.Tanh,
              nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid, nn.Identity, nn.Threshold)
SUPPORTED = ("Conv1d/2d/3d (any padding_mode), ConvTranspose1d/2d/3d (either parametrized: "
             "weight_norm, spectral_norm), MaxPool/AvgPool1d/2d/3d, "
             "BatchNorm1d/2d/3d, GroupNorm, InstanceNorm1d/2d/3d, LayerNorm/RMSNorm over "
             "channels (channels-last), nearest/linear/bilinear/trilinear Upsample, "
             "PixelShuffle/PixelUnshuffle (2D), "
             "Dropout/Dropout1d/2d/3d, Softmax/LogSoftmax over channels, "
             "pointwise activations, Identity, exatrain.models.ImagePool; nn.Flatten and "
             "AdaptiveAvgPool(1) / AdaptiveMaxPool(1) end the split")


def _direct_params(module: nn.Module) -> list[str]:
    return [n for n, p in module._parameters.items() if p is not None]


def _unsupported(name: str, module: nn.Module, why: str = "") -> SpatialSplitError:
    return SpatialSplitError(
        f"layer '{name}' ({type(module).__name__}) sits where the tensors are split into spatial "
        f"blocks (before any nn.Flatten / AdaptiveAvgPool(1)) and {why or 'exatrain has no spatial version of it'}. "
        f"Supported there: {SUPPORTED}. Replace it with a supported layer, move it after the "
        f"nn.Flatten so it runs on the gathered tensor, or set space=(1, 1, 1).")


def _parametrized_conv(module: nn.Module, name: str, rt: SpatialRuntime,
                       may_gather: bool) -> nn.Module:
    """The spatial layer of a parametrized convolution (`parametrizations.weight_norm`,
    `spectral_norm`): built from the weight as it is now, then given the parametrizations and
    the parameters they hold (the same objects, so the state dict keeps its keys), so that each
    forward computes the whole weight from them, as one process does. Building it reads the
    weight; a spectral norm's power iteration would step there, so nothing of it is kept."""
    kind = type(module).__bases__[0]
    with leaves_no_trace([module]):
        new = _CONVERT[kind](module, name, rt, may_gather)
        for tensor_name in module.parametrizations:
            value = getattr(new, tensor_name)
            delattr(new, tensor_name)  # the computed tensor, a plain attribute until here
            new.register_parameter(tensor_name, nn.Parameter(value.detach()))
        transfer_parametrizations_and_params(module, new)
    new.source_type = kind.__name__
    return new


def _converter(name: str, module: nn.Module, split_region: bool):
    """What replaces `module` under the split: a constructor `(module, name, runtime,
    may_gather) -> layer`, or None where the module runs as it is. Raises SpatialSplitError,
    naming the layer, where it cannot run on blocks."""
    kind = type(module)
    if getattr(module, "needs_whole_input", False):  # channel/filter-parallel: after the gather
        return None
    if is_parametrized(module) and kind.__bases__[0] in _CONVERT and \
            issubclass(kind.__bases__[0], nn.modules.conv._ConvNd):
        return _parametrized_conv
    if kind in _CONVERT:
        if kind is nn.Flatten and split_region and module.start_dim != 1:
            raise _unsupported(name, module, f"start_dim={module.start_dim} would flatten only "
                                             "part of the spatial dims; use nn.Flatten(1)")
        return _CONVERT[kind]
    if isinstance(module, GLOBAL_POOLS):
        size = module.output_size
        if all(s == 1 for s in (size if isinstance(size, tuple) else (size,))):
            return SpatialGlobalAvgPool if isinstance(module, _AVG_POOLS) else SpatialGlobalMaxPool
        if split_region:
            raise _unsupported(name, module, f"output_size={size} is not a global pool; only "
                                             "AdaptiveAvgPool/AdaptiveMaxPool with output size 1 "
                                             "are supported")
        return None
    if not split_region or kind in _POINTWISE:
        return None
    if kind in (nn.Softmax, nn.LogSoftmax, nn.Softmin):
        if module.dim == 1:
            return None
        raise _unsupported(name, module, f"dim={module.dim} normalises over split dims; only "
                                         "dim=1 (channels) is block-local")
    if kind in (nn.Linear, nn.Bilinear, nn.LazyLinear):
        raise _unsupported(name, module, "a dense layer needs the whole sample; put an nn.Flatten "
                                         "module (not x.flatten() in forward) before it, where "
                                         "exatrain gathers the blocks. A dense layer on a "
                                         "per-sample input beside the field (model(field, "
                                         "params): FiLM, a time embedding) is refused as well: "
                                         "broadcast that input over the field as channels and "
                                         "use an nn.Conv of kernel size 1 in its place")
    raise _unsupported(name, module)


def _convert(name: str, module: nn.Module, rt: SpatialRuntime, may_gather: bool,
             split_region: bool) -> nn.Module:
    make = _converter(name, module, split_region)
    return module if make is None else make(module, name, rt, may_gather)


class _Layout:
    """The model's layers as the split sees them, in registration order: `named` (a
    parametrized layer is one layer, its parametrizations go with it), `leaves`, the index of
    the `transition` (None: the output keeps the spatial dims) and the `split_names` up to it."""

    def __init__(self, model: nn.Module):
        inner = {id(m) for owner in model.modules() if is_parametrized(owner)
                 for m in owner.parametrizations.modules()}
        self.named = [(n, m) for n, m in model.named_modules(remove_duplicate=False)
                      if id(m) not in inner]
        self.leaves = [(n, m) for n, m in self.named
                       if not list(m.children()) or is_parametrized(m)]
        self.transition = next((i for i, (_, m) in enumerate(self.leaves)
                                if type(m) is nn.Flatten or isinstance(m, GLOBAL_POOLS)
                                or getattr(m, "needs_whole_input", False)), None)
        self.split_names = {n for i, (n, _) in enumerate(self.leaves)
                            if self.transition is None or i <= self.transition}


def _refuse_hooked_weights(model: nn.Module) -> None:
    for name, module in model.named_modules():
        hooked = weights_set_by_hooks(module)
        if hooked:  # (a deep copy of it fails too: its computed weight is no leaf)
            raise SpatialSplitError(
                f"layer '{name}' ({type(module).__name__}) has its {hooked[0]} computed by a hook "
                f"of PyTorch's older torch.nn.utils.weight_norm / spectral_norm API, which the "
                f"spatial layers cannot carry. Use torch.nn.utils.parametrizations.weight_norm / "
                f"spectral_norm instead (the same function of the same parameters), or set "
                f"space=(1, 1, 1).")


def _containers_with_parameters(model: nn.Module, layout: _Layout) -> list[tuple[str, nn.Module]]:
    """The modules with children that hold parameters of their own; refused (SpatialSplitError)
    where one is the model or holds a layer of the split region (its forward may use them on
    blocks); the others lie wholly after the transition."""
    found = []
    for name, module in layout.named:
        if list(module.children()) and _direct_params(module) and not is_parametrized(module):
            inside = [n for n in layout.split_names if module is model or n.startswith(name + ".")]
            if inside or module is model:
                raise SpatialSplitError(
                    f"'{name or type(module).__name__}' ({type(module).__name__}) holds parameters "
                    f"({', '.join(_direct_params(module))}) that its own forward uses; exatrain "
                    f"cannot tell whether they act on split blocks or on gathered tensors. Move "
                    f"them into a layer module, or set space=(1, 1, 1).")
            found.append((name, module))
    return found


def spatial_refusal(model: nn.Module) -> str | None:
    """Why `parallelize_spatial` would refuse `model` for its layers (the message), or None.
    What depends on the input size (a volume or pooling the split does not divide, arithmetic in
    forward) is found at the first forward instead. No communication, nothing built."""
    try:
        _refuse_hooked_weights(model)
        layout = _Layout(model)
        _containers_with_parameters(model, layout)
        for name, module in layout.leaves:
            _converter(name or type(module).__name__, module, name in layout.split_names)
    except SpatialSplitError as exc:
        return str(exc)
    return None


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
    _refuse_hooked_weights(model)
    model = _copy.deepcopy(model) if copy else model
    if not split_input:
        for name, module in _Layout(model).named:   # a parametrized layer with what it holds
            if _direct_params(module) or is_parametrized(module):
                rt.note_mode(module, replicated=True, name=name)
        model.spatial_runtime = rt
        return model
    layout = _Layout(model)
    leaves, transition, split_names = layout.leaves, layout.transition, layout.split_names
    # a channel/filter-parallel convolution (tensor × space): the switch from spatial blocks to
    # whole samples is there; it gathers the blocks first (the redistribution, counted)
    switch = transition is not None and getattr(leaves[transition][1], "needs_whole_input", False)
    segmentation = switch and not any(is_transition(m) for _, m in leaves[transition:])
    by_name = dict(layout.named)
    for name, module in _containers_with_parameters(model, layout):
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
            if new is module and (_direct_params(module) or is_parametrized(module)):
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
