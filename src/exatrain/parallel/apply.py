"""parallelize(): lay a plain module out over the mesh as one ordered list of steps per stage.

    split into stages -> tensor -> space -> branches -> BatchNorm -> replica buffers ->
                      layout -> activation checkpointing -> compile -> shard -> data

(torchtitan's order, for the same reasons.) Under pipe > 1, `pipe.pipeline_parallel` cuts the
model's depth into stages and hands each of this rank's stages to `parallelize_stage`, which runs
the remaining steps in order, with no early return: each step is a no-op where its axis has size
1 and works on what the previous one produced. Layer-splitting strategies come first because they
replace modules; memory and compile wrappers act on the replaced modules; sharding and data
replication come last, since they only need the final parameters. BatchNorm layers take their
statistics over the replica axes (and `space`) unless `parallel.batchnorm = "replica"`
(parallel/batchnorm.py); under `pipe` and `train.grad_accum` they are per micro-batch, as serial
training with that micro-batch would be. Other buffers a training forward changes are averaged
over the data and shard replicas after each (parallel/replica_buffers.py).

Gradient synchronisation is decided once for the combination (`gradient_reduction`), then each
step does its part of it:

  replica axes   every gradient is averaged over them: `data`, and `shard` when shard > 1
                 (both split the batch). Owned by exactly one step: shard when shard > 1, else
                 the tensor strategy's GradSync when tensor > 1 (one all-reduce over data and
                 tensor_z together), else the data step (DDP).
  partial axes   every gradient is summed over them, because each rank holds a partial sum of
                 the same gradient: `space` (each spatial rank saw a block of every sample).
                 Summed by whichever step owns the replica axes, in the same collective.
  per-parameter  set by the tensor strategy in parameter metadata (`gradsync.set_grad_axes`):
                 `tensor_z` for whole parameters under 3D, `tensor` inside sequence-parallel
                 regions. These differ from parameter to parameter, which ZeRO's buckets do not
                 express; `plan.py` and the shard step refuse them together with shard > 1.

  Plan                   replica axes    partial    who reduces
  data                   data            -          data step (DDP, mean)
  data × space           data            space      data step (DDP over data+space, ÷ data)
  shard (× data)         data, shard     -          shard step (ZeRO-1/2 buckets or FSDP2)
  shard × space          data, shard     space      shard step (+ space in its all-reduce)
  tensor (× data)        data            per-param  tensor step (GradSync over data+tensor_z)
  tensor 1D × shard      data, shard     -          shard step; TP leaves only the layout
  tensor 1D × space      data            space      tensor step (GradSync over data+space)

Under tensor × space a CNN runs its early convolutions split over `space` and, from the switch
point on (tensor/switch.py), channel/filter-split over `tensor`: the spatial step gathers the
blocks before the first channel/filter convolution (parallel/spatial/convert.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import nn

from ..errors import ParallelizeError
from ..mesh import Mesh
from .data import data_parallel, replicate_for_pipeline
from .options import ParallelOptions, cuda_graphs_refusal


def _strategy(name: str):
    return importlib.import_module(f"exatrain.parallel.{name}")


@dataclass(frozen=True)
class GradientReduction:
    """Over which axes every parameter's gradient is averaged and summed, and who does it."""
    replica_axes: tuple[str, ...]   # mean over these (they split the batch)
    partial_axes: tuple[str, ...]   # sum over these (partial gradients of the same samples)
    owner: str                      # "data" | "shard" | "tensor": the step that reduces


def gradient_reduction(plan) -> GradientReduction:
    replica = ("data", "shard") if plan.shard > 1 else ("data",)
    partial = ("space",) if plan.space_degree > 1 else ()
    owner = "shard" if plan.shard > 1 else "tensor" if plan.tensor_degree > 1 else "data"
    return GradientReduction(replica, partial, owner)


# ------------------------------------------------------------------------- the steps
def tensor_step(model, mesh, options, layout):
    if mesh.plan.tensor_degree == 1:
        return model.to(mesh.device)
    owner = layout.reduction.owner == "tensor"
    return _strategy("tensor").parallelize_tensor(
        model, mesh, options, pairs=options.tensor_pairs, replica_axes=("data",) if owner else (),
        partial_axes=layout.reduction.partial_axes if owner else (),
        checkpoint_and_compile=False, example=layout.example if layout.split_input else None)


def space_step(model, mesh, options, layout):
    if mesh.plan.space_degree == 1:
        return model
    # after the tensor step the model is already a new tree (and holds process groups, which
    # cannot be deep-copied): the spatial step converts it in place
    return _strategy("spatial").parallelize_spatial(model, mesh, split_input=layout.split_input,
                                                    batchnorm_axes=batchnorm_axes(options, layout),
                                                    copy=mesh.plan.tensor_degree == 1,
                                                    whole_samples=layout.whole_samples,
                                                    input_blocks=layout.input_blocks)


def branches_step(model, mesh, options, layout):
    """Sub-graph parallelism: et.Branches run side by side over `data` (parallel/branches.py)."""
    if getattr(options, "branches", "none") == "none" or mesh.plan.data == 1:
        return model
    from .branches import check_plan, split_branches
    check_plan(mesh.plan, options.branches)
    return split_branches(model, mesh.axis("data"))


def batchnorm_axes(options, layout) -> tuple[str, ...]:
    """The axes BatchNorm statistics span besides `space`: the replica axes, or none."""
    return layout.reduction.replica_axes if options.batchnorm == "global" else ()


def batchnorm_step(model, mesh, options, layout):
    """Under `space` the spatial layers already hold the BatchNorm statistics' axes."""
    axes = batchnorm_axes(options, layout)
    if mesh.plan.space_degree > 1 or not axes:
        return model
    return _strategy("batchnorm").globalise_batchnorm(model, mesh.axis(*axes))


def replica_buffers_step(model, mesh, options, layout):
    """The buffers a training forward changes (a running mean of the inputs), averaged over the
    data and shard replicas after each (parallel/replica_buffers.py). Not under pipe or space:
    there a stage's micro-batches, or a sample's blocks, update such state on their own."""
    axes = [a for a in ("data", "shard") if mesh.axis(a).size > 1]
    if not axes or mesh.plan.pipe > 1 or mesh.plan.space_degree > 1:
        return model
    from .replica_buffers import keep_buffers_equal
    return keep_buffers_equal(model, mesh.axis(*axes))


def layout_step(model, mesh, options, layout):
    """Channels-last weights for convolutional models (parallel/layout.py)."""
    from .layout import to_channels_last, wants_channels_last
    if not wants_channels_last(model, options.channels_last, mesh.plan):
        return model
    return to_channels_last(model)


def float8_step(model, mesh, options, layout):
    """fp8 precision: torchao's float8 Linears (parallel/float8.py), before compile sees them."""
    if options.precision != "fp8":
        return model
    from .float8 import convert_linears
    convert_linears(model)
    return model


def checkpoint_and_compile_step(model, mesh, options, layout):
    if options.activation_checkpointing == "none" and not options.compile:
        return model
    scope = options.compile_scope
    if scope == "auto":
        scope = _strategy("compile").auto_compile_scope(
            model, fsdp=mesh.plan.shard > 1 and options.zero_stage == 3)
    return _strategy("compile").apply_checkpointing_and_compile(model, options,
                                                              whole_model=scope == "model")


def shard_step(model, mesh, options, layout):
    if mesh.plan.shard == 1:
        return model
    return _strategy("shard").parallelize_shard(model, mesh, options,
                                                partial_axes=layout.reduction.partial_axes)


def data_step(model, mesh, options, layout):
    reduction = layout.reduction
    if reduction.owner != "data":
        return model
    if mesh.plan.pipe > 1:  # no DDP: reduced once after the schedule (see parallel/data.py)
        return replicate_for_pipeline(model, mesh, ("data",), reduction.partial_axes,
                                      options.bucket_cap_mb)
    axis = mesh.axis("data", *reduction.partial_axes)
    # buffers that every replica keeps equal need no broadcast before each forward: BatchNorm's
    # running statistics under space, or with global statistics (parallel/batchnorm.py)
    equal_buffers = bool(reduction.partial_axes) or options.batchnorm == "global"
    return data_parallel(model, axis, replicas=mesh.plan.data, bucket_cap_mb=options.bucket_cap_mb,
                         device=mesh.device, broadcast_buffers=not equal_buffers,
                         find_unused_parameters=options.find_unused_parameters)


STEPS = (tensor_step, space_step, branches_step, batchnorm_step, replica_buffers_step,
         layout_step, float8_step,
         checkpoint_and_compile_step, shard_step, data_step)


@dataclass(frozen=True)
class StageLayout:
    """What the steps need to know about the stage they lay out."""
    reduction: GradientReduction
    split_input: bool = True  # under space: its input is split into blocks (not yet gathered)
    example: object = None    # one whole batch of inputs (gives the channel/filter switch shapes)
    whole_samples: bool = False  # under space: it takes whole samples, returns whole outputs
    input_blocks: bool = False   # with whole_samples: it takes blocks already, returns whole


def parallelize_stage(stage: nn.Module, mesh: Mesh, options, split_input: bool = True,
                      example=None, whole_samples: bool = False,
                      input_blocks: bool = False) -> nn.Module:
    """One pipeline stage (or the whole model) through every step after the split, in order."""
    layout = StageLayout(gradient_reduction(mesh.plan), split_input, example, whole_samples,
                         input_blocks)
    for step in STEPS:
        stage = step(stage, mesh, options, layout)
    return stage


def parallelize(model: nn.Module, mesh: Mesh, options=None, example=None,
                whole_samples: bool = False, input_blocks: bool = False) -> nn.Module:
    """Return a module that trains like `model` on one process, laid out over `mesh`.

    `options` is a `ParallelOptions` (the config's [parallel] section); None means defaults.
    `example`: one per-replica batch of inputs; needed to split the model under `pipe`.
    `whole_samples` (under `space`): the module takes whole samples and returns whole outputs,
    as `model` does (a user's own data set, `et.fit`); False: it takes this rank's spatial
    block of each sample (a data set read by blocks, `spatial.SpatialBlocks`) and a split
    output stays split (parallel/spatial/convert.py, "Whole samples").
    `whole_samples` with `input_blocks`: it takes this rank's block of each sample (a user's
    data set read by blocks) and returns whole outputs, so the user's loss sees serial ones.
    """
    if options is None:
        options = ParallelOptions()
    plan = mesh.plan
    refusal = cuda_graphs_refusal(plan, options, mesh.device.type)
    if options.precision == "fp8" and not refusal:
        from .float8 import float8_refusal
        refusal = float8_refusal(mesh.device, model, plan.tensor_degree)
    if not refusal and plan.tensor_degree > 1:
        refusal = _strategy("graph").graph_refusal(model)
    if refusal:
        raise ParallelizeError(refusal)
    if whole_samples and plan.space_degree > 1 and plan.pipe > 1:
        # the first stage would cut the samples and the last gather its output: not built yet,
        # and without it the stages would treat whole samples as blocks
        raise ParallelizeError(
            f"{plan}: a model that takes whole samples (your own data set) cannot yet be split "
            f"over pipe and space together. Use pipe or space alone (e.g. "
            f"Plan(data={plan.data}, space={plan.space})).")
    if plan.tensor_degree > 1 and _strategy("graph").has_graph_convs(model):  # 3D GCN (Plexus)
        return _strategy("graph").parallelize_graph(model, mesh, options)
    if plan.pipe > 1:  # split into stages; each of this rank's stages goes through the steps
        return _strategy("pipe").pipeline_parallel(
            model.to(mesh.device), mesh, options, example,
            lambda stage, split_input: parallelize_stage(stage, mesh, options, split_input))
    return parallelize_stage(model, mesh, options, example=example, whole_samples=whole_samples,
                             input_blocks=input_blocks)
