"""Data parallelism over the `data` axis: bucketed gradient all-reduce overlapped with backward.

We wrap PyTorch's DistributedDataParallel, whose C++ reducer already buckets gradients (25 MiB
buckets, filled in reverse order of use) and launches each bucket's all-reduce as soon as its last
gradient is ready, overlapping communication with the rest of the backward pass. Rather than
re-implement that in Python we keep DDP's reducer and replace only its communication hook, so that
each bucket's all-reduce goes through `exatrain.comm` and is counted in the ledger (tag "grad").
`exatrain bench dp` measures what the hook costs against plain DDP.

Communication per step, per rank: one SUM all-reduce of every gradient, i.e. 4Ψ bytes for Ψ fp32
parameters (the payload convention of `comm.ledger`; a ring moves 2(N-1)/N of it over the wire).

Under pipeline parallelism (`replicate_for_pipeline`) DDP's reducer cannot be used: a schedule's
backward does not always pass through autograd hooks (zero-bubble schedules add weight
gradients to `.grad` by hand), so the stage gets a deferred `gradsync.GradSync` instead, which the
pipeline reduces once after the last micro-batch: the same bytes, 4Ψ per rank and step, without
overlap with backward (which only the last micro-batch's backward could offer).

A parameter that the forward leaves out gets no gradient, so DDP's reducer never finishes its
bucket and the next step fails. DDP can search the autograd graph for such parameters every step
(`parallel.find_unused_parameters = true`, a graph traversal per step); without it the failure is
re-raised as `UnusedParameterError`, naming the parameters and both fixes.

The gradient is divided by `replicas` before the sum. Over plain `data`, replicas = the axis size
(mean over the global batch). Over `data+space` (spatial parallelism) the ranks of one spatial
group hold partial gradients of the same samples, which must be summed, so replicas is the data
degree only.
"""

import inspect
import re

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..comm import Axis, all_reduce_future, broadcast
from .gradsync import GradSync, set_grad_axes
from ..errors import UserError


class _HookState:
    def __init__(self, axis: Axis, replicas: int):
        self.axis = axis
        self.replicas = replicas


def _ledger_allreduce_hook(state: _HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    buffer.div_(state.replicas)
    return all_reduce_future(buffer, state.axis, tag="grad")


class UnusedParameterError(UserError, RuntimeError):
    """A parameter that requires a gradient got none in the last step under data parallelism, or
    a layer that K-FAC preconditions ran no forward or backward in a step: the model's forward
    does not use it.

    What to do: the message names the parameters; use them, freeze them
    (`requires_grad_(False)`), or remove them from the model.
    """


class ReplicatedModule(DistributedDataParallel):
    """DDP whose failure on an unused parameter names the parameters and the fixes."""

    def forward(self, *args, **kwargs):
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as err:
            if "finished reduction in the prior iteration" not in str(err):
                raise
            unused = self._unused_names(str(err))
            raise UnusedParameterError(
                f"data parallelism: the last step's forward did not use "
                f"{len(unused)} parameter(s) that require a gradient"
                f"{': ' + ', '.join(unused[:8]) if unused else ''}"
                f"{' ...' if len(unused) > 8 else ''}. Freeze them (requires_grad_(False)) or "
                "remove them from the model, or set parallel.find_unused_parameters = true "
                "(one search of the autograd graph per step).") from err


    def _unused_names(self, message: str) -> list[str]:
        """The names of the parameters DDP's message lists by index ("Parameter indices which
        did not receive grad for rank R: i j ..."; the gradients themselves are gone by then,
        zeroed by the optimizer), in the reducer's order: module by module, each parameter
        once, those requiring a gradient and not ignored."""
        found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", message)
        if not found:
            return []
        order, seen = [], set()
        for module_name, module in self.module.named_modules():
            for name, p in module.named_parameters(recurse=False):
                full = f"{module_name}.{name}" if module_name else name
                if p.requires_grad and full not in self.parameters_to_ignore and id(p) not in seen:
                    seen.add(id(p))
                    order.append(full)
        return [order[int(i)] for i in found.group(1).split() if int(i) < len(order)]


# torch 2.13 renamed DDP's per-forward buffer broadcast `forward_sync_buffers` (buffers are still
# synced once at construction) and deprecated `broadcast_buffers`; the GPU clusters' torch 2.11
# knows only the old name, whose False also skips the sync at construction, which is harmless
# here since False is passed only where buffers start equal on every member.
_DDP_ARGS = inspect.signature(DistributedDataParallel.__init__).parameters
_BUFFER_SYNC_ARG = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS \
    else "broadcast_buffers"


def data_parallel(model: nn.Module, axis: Axis, replicas: "int | None" = None,
                  bucket_cap_mb: float = 25.0, device: "torch.device | None" = None,
                  broadcast_buffers: bool = True,
                  find_unused_parameters: bool = False) -> nn.Module:
    """Wrap `model` so its gradients are averaged over `axis` during backward.

    `broadcast_buffers=False` where buffers are already equal on every member (spatial
    BatchNorm keeps global statistics), so DDP need not re-send them each forward.
    `find_unused_parameters`: DDP's per-step search for parameters the forward left out.
    Returns `model` itself when the axis has one member: there is nothing to synchronise.
    """
    if axis.size == 1:
        return model
    ddp = ReplicatedModule(
        model,
        device_ids=[device] if device is not None and device.type == "cuda" else None,
        process_group=axis.group,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,  # no extra copy of each gradient into the bucket
        **{_BUFFER_SYNC_ARG: broadcast_buffers},
        find_unused_parameters=find_unused_parameters,
    )
    ddp.register_comm_hook(_HookState(axis, replicas or axis.size), _ledger_allreduce_hook)
    return ddp


def replicate_for_pipeline(stage: nn.Module, mesh, mean_axes: tuple[str, ...],
                           sum_axes: tuple[str, ...], bucket_cap_mb: float = 25.0) -> nn.Module:
    """Data parallelism for a pipeline stage: gradients averaged over `mean_axes` and summed over
    `sum_axes` (space) by a deferred GradSync (`stage.exatrain_gradsync`), which the pipeline
    calls after the schedule. Parameters start equal on every replica, as DDP makes them."""
    axes = tuple(a for a in (*mean_axes, *sum_axes) if mesh.axis(a).size > 1)
    if not axes:
        return stage
    group = mesh.axis(*axes)
    with torch.no_grad():
        for p in stage.parameters():
            broadcast(p.data, group, src=0, tag="param")
            set_grad_axes(p, sum_axes=sum_axes, mean_axes=mean_axes)
    stage.exatrain_gradsync = GradSync(stage.parameters(), mesh, bucket_cap_mb=bucket_cap_mb)
    stage.exatrain_gradsync.defer()
    return stage


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside any data-parallel wrapper (DDP, ZeRO-1/2); FSDP2 modules are their own."""
    from .zero import ZeroDataParallel  # here: plain data parallelism need not load ZeRO

    while isinstance(model, (DistributedDataParallel, ZeroDataParallel)):
        model = model.module
    return model
