"""Buffers a training forward changes, kept equal over the replicas (`keep_buffers_equal`).

A model may keep state in buffers that its forward updates from the samples it sees: a running
mean for normalising its inputs, an exponential average of a field's statistics. Under `data` or
`shard` each replica sees its own share of the batch, so such a buffer would be updated from a
different half on each replica, and the replicas would disagree about the model from the first
step (nothing broadcasts buffers once BatchNorm keeps global statistics; FSDP never does). The
first training forward finds the floating-point buffers it changes on any replica (a version
counter that moved, or a buffer replaced); after it and each training forward that follows,
those buffers are averaged over the replicas (a buffer that first changes later is not). That equals one
process for state updated linearly from the batch mean (an exponential average of the mean:
the mean of equal shares' means is the batch's), and keeps the replicas equal for any other.
Norm layers' running statistics are not touched (BatchNorm keeps them global itself, or per
replica as `parallel.batchnorm = "replica"` asks), nor non-persistent buffers (caches a forward
may rebuild to each replica's shapes). The averages are new tensors bound in the buffers' place:
autograd may have saved the old ones for the backward. Hooks that find nothing changing at the
first training forward remove themselves. Not covered: a buffer that activation checkpointing's
recomputation updates again in the backward.

Communication, over the replica axis: at the first training forward one MAX all-reduce of an
int32 flag per floating-point buffer B (which changed on any replica: the replicas must agree on
which buffers to reduce), 4·B bytes once; then per training forward one SUM all-reduce of each
changing buffer, Σ s(b) bytes (none, and no hook left, for a model whose buffers stay constant).
Evaluation forwards change nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Axis, all_reduce


class _ReplicaBuffers:
    """The forward hooks of `keep_buffers_equal`, over (module, buffer name) pairs (they
    survive wrappers that rename the paths: activation checkpointing's)."""

    def __init__(self, axis: Axis, slots: list[tuple[nn.Module, str]]):
        self.axis, self.slots = axis, slots
        self.before: list | None = None
        self.changing: list[tuple[nn.Module, str]] | None = None   # from the first training forward
        self.training = False
        self.handles: list = []

    def _state(self, slots) -> list[tuple[int, int]]:
        return [(id(m._buffers[k]), m._buffers[k]._version) for m, k in slots]

    def note(self, module, _args) -> None:
        self.training = module.training and torch.is_grad_enabled()
        self.before = self._state(self.slots) if self.training and self.changing is None else None

    @torch.no_grad()
    def average(self, module, _args, _output) -> None:
        if not self.training:
            return
        if self.changing is None:   # the first training forward: which changed on any replica
            first, key = self.slots[0]   # where the buffers are now (moved after the hook)
            changed = torch.tensor([int(a != b) for a, b in zip(self._state(self.slots),
                                                                self.before)],
                                   dtype=torch.int32, device=first._buffers[key].device)
            all_reduce(changed, self.axis, op=dist.ReduceOp.MAX, tag="buffers")
            self.changing = [slot for slot, flag in zip(self.slots, changed.tolist()) if flag]
            if not self.changing:   # constant buffers (a model's tables): nothing more to do
                for handle in self.handles:
                    handle.remove()
        for module_, key in self.changing:
            # a new tensor, not the buffer in place: autograd may have saved the buffer for this
            # forward's backward (`h / self.running_std`)
            mean = module_._buffers[key].clone()
            all_reduce(mean, self.axis, tag="buffers")
            module_._buffers[key] = mean.div_(self.axis.size)


def keep_buffers_equal(model: nn.Module, axis: Axis) -> nn.Module:
    """Hook `model` so that the floating-point buffers its training forwards change are
    averaged over `axis` (the replicas) after each (module doc); returns `model`. Left out:
    norm layers' running statistics (their layers and `parallel.batchnorm` decide them), the
    subtrees of modules that keep their buffers equal themselves (`keeps_buffers_equal`), and
    non-persistent buffers (caches a forward may rebuild to each replica's own shapes)."""
    if axis.size == 1:
        return model
    kept: set[int] = set()
    for module in model.modules():
        if getattr(module, "keeps_buffers_equal", False) or \
                isinstance(module, nn.modules.batchnorm._NormBase):
            kept |= {id(m) for m in module.modules()}
    slots = [(module, key) for module in model.modules() if id(module) not in kept
             for key, b in module._buffers.items()
             if b is not None and b.is_floating_point()
             and key not in module._non_persistent_buffers_set]
    if slots:
        hooks = _ReplicaBuffers(axis, slots)
        hooks.handles = [model.register_forward_pre_hook(hooks.note),
                         model.register_forward_hook(hooks.average)]
    return model


__all__ = ["keep_buffers_equal"]
