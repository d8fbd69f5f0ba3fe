"""Pipeline parallelism (the `pipe` axis): a model's depth in stages, micro-batches by schedule.

  split.py       trace a plain model into layers; balanced contiguous stages with serial names
  schedules.py   GPipe, 1F1B, interleaved 1F1B, zero-bubble (torch.distributed.pipelining);
                 which stages a rank holds; each schedule's bubble formula
  stage.py       a PipelineStage with counted sends (ledger, `pipe` axis) and a timeline
  model.py       PipelineModel: this rank's stages under serial names; train_step / eval_batch
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ...comm import broadcast_object
from ..precision import Precision
from .model import PipelineModel, check_microbatches
from .schedules import SCHEDULES, bubble_formula, check_schedule_microbatches, stage_indices, virtual_stages
from .split import PipeSplitError, split_model

__all__ = ["PipelineModel", "PipeSplitError", "SCHEDULES", "bubble_formula", "pipeline_parallel",
           "split_model"]


def pipeline_parallel(model: nn.Module, mesh, options, example: torch.Tensor | None,
                      per_stage: Callable[[nn.Module], nn.Module]) -> PipelineModel:
    """Split `model` over the `pipe` axis; `per_stage` lays out each of this rank's stages.

    `example`: one per-replica batch of inputs (the shapes the stages will see).
    """
    if example is None:
        raise ValueError("plan.pipe > 1: parallelize(model, mesh, options, example=x) needs one "
                         "per-replica batch of inputs x, to trace the model and size the stages.")
    axis = mesh.axis("pipe")
    per_rank = virtual_stages(options.pipe_schedule, options.pipe_virtual_stages)
    stages = axis.size * per_rank
    microbatches = options.microbatches or 2 * stages
    check_microbatches(example.shape[0], microbatches)
    check_schedule_microbatches(options.pipe_schedule, axis.size, microbatches)
    micro = example[: max(1, example.shape[0] // microbatches)].to(mesh.device)
    split = list(options.pipe_split) or None
    modules, starts = split_model(model, stages, micro, starts=split, balance=options.pipe_balance)
    if split is None and options.pipe_balance == "time":  # measured: every rank takes rank 0's cuts
        agreed = broadcast_object(starts, mesh.world)
        if agreed != starts:
            modules, starts = split_model(model, stages, micro, starts=agreed)
    wrapped = {i: per_stage(modules[i]) for i in stage_indices(axis.rank, axis.size, per_rank)}
    autocast = Precision(options.precision, mesh.device).autocast
    return PipelineModel(modules, wrapped, axis, mesh.device, options.pipe_schedule, microbatches,
                         example.to(mesh.device), autocast, starts)
