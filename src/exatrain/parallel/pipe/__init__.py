"""Pipeline parallelism (the `pipe` axis): a model's depth in stages, micro-batches by schedule.

  split.py       trace a plain model into layers; balanced contiguous stages with serial names
  schedules.py   GPipe, 1F1B, interleaved 1F1B, zero-bubble (torch.distributed.pipelining);
                 which stages a rank holds; each schedule's bubble formula
  stage.py       a PipelineStage with counted sends (ledger, `pipe` axis) and a timeline
  model.py       PipelineModel: this rank's stages under serial names; train_step / eval_batch

Imports: comm, mesh and the rest of parallel (the shard step's ZeRO per stage).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ...comm import broadcast_object
from ..precision import Precision
from .model import PipelineModel, check_microbatches, stage_shapes
from .schedules import SCHEDULES, bubble_formula, check_schedule_microbatches, stage_indices, virtual_stages
from .split import PipeSplitError, split_model
from ...errors import ParallelizeError

__all__ = ["PipelineModel", "PipeSplitError", "SCHEDULES", "bubble_formula", "pipeline_parallel",
           "split_model"]


def pipeline_parallel(model: nn.Module, mesh, options, example: torch.Tensor | None,
                      per_stage: Callable[[nn.Module, bool], nn.Module]) -> PipelineModel:
    """Split `model` over the `pipe` axis; `per_stage(stage, split_input)` lays out each of this
    rank's stages (`split_input`: under space, the stage's input is split into blocks).

    `example`: one per-replica batch of inputs, as this rank gets it (under space: blocks).

    Under space the model is split and sized on whole samples; the activations that cross a
    stage boundary before the spatial transition (nn.Flatten, global pool) are this rank's
    blocks, after it whole tensors (`spatial.stage_regions`).
    """
    if example is None:
        raise ParallelizeError(
            "plan.pipe > 1: parallelize(model, mesh, options, example=x) needs one "
            "per-replica batch of inputs x, to trace the model and size the stages.")
    axis = mesh.axis("pipe")
    per_rank = virtual_stages(options.pipe_schedule, options.pipe_virtual_stages)
    stages = axis.size * per_rank
    microbatches = options.microbatches or 2 * stages
    check_microbatches(example.shape[0], microbatches)
    check_schedule_microbatches(options.pipe_schedule, axis.size, microbatches)
    spatial = mesh.plan.space_degree > 1
    if spatial:  # trace and size the stages on whole samples
        from ..spatial import block_shape, stage_regions, whole_shape
        example = example.new_zeros(whole_shape(tuple(example.shape), mesh))
    micro = example[: max(1, example.shape[0] // microbatches)].to(mesh.device)
    split = list(options.pipe_split) or None
    measured = split is None and options.pipe_balance == "time"
    modules, starts = split_model(model, stages, micro, starts=split, balance=options.pipe_balance,
                                  check_shared=not measured)
    if measured:  # every rank takes rank 0's cuts (and checks those, not its own)
        agreed = broadcast_object(starts, mesh.world)
        modules, starts = split_model(model, stages, micro, starts=agreed)
    autocast = Precision(options.precision, mesh.device).autocast
    shapes = stage_shapes(modules, micro, autocast, microbatches)
    regions = [(True, True)] * len(modules)  # (input split?, output split?): all, without space
    if spatial:
        regions = stage_regions(modules)
        block = lambda metas, split: tuple(
            torch.empty(block_shape(tuple(t.shape), mesh), dtype=t.dtype, device="meta",
                        requires_grad=t.requires_grad) if split else t for t in metas)
        shapes = [(block(inputs, split_in), block(outputs, split_out))
                  for (inputs, outputs), (split_in, split_out) in zip(shapes, regions)]
    wrapped = {i: per_stage(modules[i], regions[i][0])
               for i in stage_indices(axis.rank, axis.size, per_rank)}
    return PipelineModel(len(modules), wrapped, shapes, axis, mesh.device, options.pipe_schedule,
                         microbatches,
                         example.to(mesh.device), autocast, starts)

