"""PipelineModel: this rank's pipeline stages under their serial names, trained by a schedule.

`parallelize` splits the model (split.py), puts each of this rank's stage modules through the
remaining per-stage steps (tensor, space, checkpointing, compile, shard, data), and hands them
here. The PipelineModel is an `nn.Module` whose tree holds exactly this rank's layers at their
serial paths (`blocks.4...`), so `parameters()`, optimizers, gradient clipping, state dicts and
DCP checkpoints see the serial model's names; the stage modules that the schedule calls share
those parameters.

Gradient reduction over the replica axes (data, shard, space, tensor_z) runs once per step, after
the schedule: every stage's synchroniser (a deferred GradSync from the data or tensor step, or a
ZeRO-1/2 wrapper) is put in deferred mode here and called by `train_step` after the last
micro-batch. Hooks cannot do it: zero-bubble schedules add weight gradients to `.grad` by hand.
FSDP2 stages (ZeRO-3) are reduced by torch's schedule itself (`perform_reduce_grad`).

A training step: the per-replica batch is cut into m micro-batches; the schedule runs them
through the stages; the loss (mean over each micro-batch) is summed over micro-batches and
divided by m by the schedule's gradient scaling, so gradients equal the un-pipelined step's
gradient of the batch-mean loss (equal micro-batches). Stage input and output shapes are
found once, before the first step, by running the stages on fake tensors of one micro-batch --
no run-time shape exchange between ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ...comm import Axis, all_reduce
from ...comm.collectives import host_only_p2p
from ..data import unwrap
from ..nested import cut_batch, join_microbatches, tensors_of
from .schedules import bubble_formula, build_schedule
from ..trial import leaves_no_trace
from ...errors import ConfigError, ParallelizeError


def _is_path(module: nn.Module) -> bool:
    """A module a stage made only to hold the path to its layers (see split.py), no layer itself."""
    return type(module) in (nn.Module, nn.ModuleList)


def _merge_into(shell: nn.Module, part: nn.Module) -> None:
    """Mount `part`'s layers, parameters and buffers on `shell` at the same paths.

    Path modules are recreated, never adopted: two stages of one rank each have a `blocks`, and
    adopting the first stage's would put the second stage's blocks inside the first stage.
    """
    for name, p in part.named_parameters(recurse=False):
        shell.register_parameter(name, p)
    for name, b in part.named_buffers(recurse=False):
        shell.register_buffer(name, b, persistent=name not in part._non_persistent_buffers_set)
    for name, child in part.named_children():
        mine = shell._modules.get(name)
        if mine is None:
            if not _is_path(child):
                shell.add_module(name, child)
                continue
            mine = type(child)()
            shell.add_module(name, mine)
        if mine is not child:
            _merge_into(mine, child)


def _deferred_syncs(stage: nn.Module) -> list:
    """The gradient synchronisers of one laid-out stage, switched to reduce on demand."""
    syncs = [stage] if hasattr(stage, "sync_now") else []          # ZeRO-1/2
    gradsync = getattr(unwrap(stage), "exatrain_gradsync", None)     # data or tensor step
    if gradsync is not None:
        syncs.append(gradsync)
    for sync in syncs:
        sync.defer()
    return syncs


def check_microbatches(batch: int, microbatches: int) -> None:
    if batch % microbatches:
        raise ConfigError(
            f"parallel.microbatches={microbatches} does not divide the per-replica batch of {batch} "
            f"samples; choose a divisor of {batch} (or change train.batch_size).")


def stage_shapes(modules: list[nn.Module], micro: torch.Tensor, autocast,
                 microbatches: int = 1) -> list[tuple]:
    """(inputs, outputs) of each stage for one micro-batch (one of `microbatches`), as meta
    tensors (fake execution).

    Run on the plain stages, before they are laid out: a sharded stage's forward would start
    collectives (FSDP2's all-gather) that fake tensors must not reach."""
    shapes = []
    # fake execution still steps a real integer buffer (BatchNorm's num_batches_tracked)
    with leaves_no_trace(modules), FakeTensorMode(allow_non_fake_inputs=True) as mode, \
            autocast():
        x = (mode.from_tensor(micro),)
        for module in modules:
            try:
                y = tuple(tensors_of(module(*x)))  # a last stage's dict or namedtuple too
            except ValueError as exc:
                if "Expected more than 1 value per channel" not in str(exc):
                    raise
                # BatchNorm normalises each micro-batch by its own statistics: one value per
                # channel has none (torch's message came from inside the first step)
                raise ParallelizeError(
                    f"plan.pipe: parallel.microbatches={microbatches} cuts the replica's batch "
                    f"into micro-batches of {micro.shape[0]} sample(s), and a BatchNorm layer, "
                    f"which normalises each micro-batch by its own statistics, got one value per "
                    f"channel ({exc}): use fewer micro-batches (parallel.microbatches), a larger "
                    "train.batch_size, or GroupNorm/LayerNorm.") from exc
            meta = lambda ts: tuple(torch.empty(t.shape, dtype=t.dtype, device="meta",
                                                requires_grad=t.requires_grad) for t in ts)
            shapes.append((meta(x), meta(y)))
            x = y
    return shapes


def transport_refusal(device_type: str, backend: str, stages: int, rank: int) -> str | None:
    """Why the pipeline cannot run here, or None: torch.distributed.pipelining posts its
    receives into the stages' own device buffers, so a backend whose point-to-point reads host
    memory only (`host_only_p2p`: gloo) cannot carry CUDA activations."""
    if stages > 1 and host_only_p2p(device_type, backend):
        return (f"rank {rank}: plan.pipe = {stages} on CUDA tensors over {backend} (ranks sharing "
                f"one GPU, EXATRAIN_SHARE_GPU=1): {backend}'s send and receive read tensor "
                "memory from the CPU, and the pipeline's transfers would crash the rank. Run one "
                "rank per GPU over NCCL (unset EXATRAIN_SHARE_GPU and launch as many ranks as "
                "GPUs), or the pipeline on the CPU.")
    return None


class PipelineModel(nn.Module):
    """This rank's stages of a pipeline; `train_step` / `eval_batch` run the schedule."""

    def __init__(self, num_stages: int, wrapped: dict[int, nn.Module], shapes: list[tuple],
                 axis: Axis, device: torch.device, schedule: str, microbatches: int,
                 example: torch.Tensor, autocast, starts: list[int]):
        super().__init__()
        self.axis, self.device, self.autocast = axis, device, autocast
        self.schedule_name, self.microbatches, self.layer_starts = schedule, microbatches, starts
        self.num_stages = num_stages
        self.stage_ids = sorted(wrapped)
        for i in self.stage_ids:  # as laid out by the per-stage steps (tensor: new local shards)
            _merge_into(self, unwrap(wrapped[i]))
        self.norm_axis = axis  # the gradient norm sums over the stages' ranks too
        # the stages as laid out (ZeRO wrappers included): a tuple, not submodules, so that
        # the parameters are registered once, under their serial names
        self.stage_wrappers = tuple(wrapped[i] for i in self.stage_ids)
        self.gradient_syncs = [sync for w in self.stage_wrappers for sync in _deferred_syncs(w)]
        check_microbatches(example.shape[0], microbatches)
        self.batch = example.shape[0]
        refusal = transport_refusal(device.type, dist.get_backend(axis.group) if axis.size > 1
                                    else "", self.num_stages, dist.get_rank() if axis.size > 1
                                    else 0)
        if refusal:
            raise ParallelizeError(refusal)
        # here, not at import: torch.distributed.pipelining is ~800 files a job without a pipe
        # axis need not open (the Trainer imports this module for an isinstance test)
        from .stage import CountedStage, Timeline
        self.timeline = Timeline(axis.rank, device)
        self.stages = [CountedStage(wrapped[i], i, self.num_stages, device, shapes[i][0],
                                    shapes[i][1], axis, self.timeline) for i in self.stage_ids]
        self.is_first = 0 in self.stage_ids
        self.is_last = self.num_stages - 1 in self.stage_ids
        self._loss_fn = None
        self.schedule = build_schedule(schedule, self.stages, microbatches, self._loss)
        self.per_rank = len(self.stage_ids)

    def _loss(self, output, target):
        return self._loss_fn(output, target)

    def forward(self, *args):
        raise RuntimeError("a pipelined model runs by schedule: call train_step(x, y, loss_fn) or "
                           "eval_batch(x) (the Trainer does).")

    def bubble_formula(self) -> float:
        return bubble_formula(self.schedule_name, self.axis.size, self.microbatches, self.per_rank)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> float:
        """One pipelined forward and backward of the batch; returns its mean loss (every rank)."""
        self._loss_fn = loss_fn
        losses: list = []
        self.timeline.begin_step()
        with self.autocast():
            self.schedule.step(*((x,) if self.is_first else ()), target=y if self.is_last else None,
                               losses=losses, return_outputs=False)
        self.timeline.end_step()  # the bubble is the schedule's idle time, not the reduction's
        for sync in self.gradient_syncs:
            sync.sync_now()
        return self._shared_mean(losses)

    def _shared_mean(self, losses: list) -> float:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.is_last:
            total += torch.stack([l.detach().double() for l in losses]).mean()
        all_reduce(total, self.axis, tag="metric")  # only the last stage's rank adds a value
        return float(total)

    @torch.no_grad()
    def eval_batch(self, x: torch.Tensor) -> torch.Tensor | None:
        """Forward only; the output on the last stage's rank, None elsewhere.

        A batch smaller than the training batch (the last one) is padded with its last sample,
        since the stages' shapes are fixed; the padding is cut off the output.
        """
        n = x.shape[0]
        if n > self.batch:
            raise ConfigError(f"evaluation batch of {n} exceeds the pipelined batch {self.batch}.")
        if n < self.batch:
            x = torch.cat([x, x[-1:].expand(self.batch - n, *x.shape[1:])])
        # the schedule computes a loss on the last stage whenever it has a loss function: give
        # it a placeholder target and a loss that costs nothing
        self._loss_fn = lambda output, target: torch.zeros((), device=self.device)
        placeholder = torch.zeros(self.batch, device=self.device) if self.is_last else None
        last = self.stages[-1]
        last.outputs = [] if self.is_last else None   # the micro-batches' outputs, joined here:
        try:                                          # torch's merge cannot join a 0-dim output
            with self.autocast():
                self.schedule.eval(*((x,) if self.is_first else ()), target=placeholder,
                                   return_outputs=False)
            if not self.is_last:
                return None
            joined = join_microbatches(last.outputs, self.batch // self.microbatches)
            return cut_batch(joined, n, self.batch)
        finally:
            last.outputs = None
