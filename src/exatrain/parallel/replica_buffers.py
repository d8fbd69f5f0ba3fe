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
BatchNorm's statistics are not touched: its layers keep them global themselves
(`keeps_buffers_equal`). A model whose forward changes no floating-point buffer gets no hook.

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
    """The forward hooks of `keep_buffers_equal`."""

    def __init__(self, model: nn.Module, axis: Axis, names: list[str]):
        self.model, self.axis, self.names = model, axis, names
        self.before: dict[str, tuple[int, int]] | None = None
        self.changing: list[str] | None = None   # decided at the first training forward
        self.handles: list = []
        self.training = False

    def _state(self) -> dict[str, tuple[int, int]]:
        buffers = dict(self.model.named_buffers())
        return {n: (id(buffers[n]), buffers[n]._version) for n in self.names if n in buffers}

    def note(self, module, _args) -> None:
        training = module.training and torch.is_grad_enabled()
        self.before = self._state() if training and self.changing is None else None
        self.training = training

    @torch.no_grad()
    def average(self, module, _args, _output) -> None:
        if not self.training:
            return
        buffers = dict(self.model.named_buffers())
        if self.changing is None:   # the first training forward: which changed on any replica
            after = self._state()
            changed = torch.tensor([int(after.get(n) != self.before.get(n)) for n in self.names],
                                   dtype=torch.int32, device=next(iter(buffers.values())).device)
            all_reduce(changed, self.axis, op=dist.ReduceOp.MAX, tag="buffers")
            self.changing = [n for n, flag in zip(self.names, changed.tolist()) if flag]
            if not self.changing:   # constant buffers (a model's tables): nothing more to do
                for handle in self.handles:
                    handle.remove()
        for name in self.changing:
            all_reduce(buffers[name], self.axis, tag="buffers")
            buffers[name].div_(self.axis.size)


def keep_buffers_equal(model: nn.Module, axis: Axis) -> nn.Module:
    """Hook `model` so that the floating-point buffers its training forwards change are
    averaged over `axis` (the replicas) after each (module doc); returns `model`."""
    if axis.size == 1:
        return model
    names = [f"{prefix}.{name}" if prefix else name
             for prefix, module in model.named_modules()
             if not getattr(module, "keeps_buffers_equal", False)
             for name, b in module._buffers.items()
             if b is not None and b.is_floating_point()]
    if names:
        hooks = _ReplicaBuffers(model, axis, names)
        hooks.handles = [model.register_forward_pre_hook(hooks.note),
                         model.register_forward_hook(hooks.average)]
    return model


__all__ = ["keep_buffers_equal"]
