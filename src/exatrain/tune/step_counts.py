"""What one training step of a model dispatches, counted without running it for real (under
torch's FakeTensorMode): its aten operators, the FLOPs of its matrix products and convolutions,
and the bytes its memory-bound operators read and write. The planner charges a step its
operators at a fixed cost each (`tune.overheads`), its FLOPs at the device's rate and its bytes
at the device's elementwise bandwidth (`tune.cost`); `tune.calibrate` measures that bandwidth on
operators counted the same way.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry


# allocations without contents, and a reshape's view of a tensor made contiguous just before
MOVE_NOTHING = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
                torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided,
                torch.ops.aten._unsafe_view}


class StepCounter(TorchDispatchMode):
    """A dispatch mode that counts the aten operators run under it (inside FakeTensorMode: no
    real work, the same operators a real CPU run dispatches): `n` of them, the `flops` of the
    matrix products and convolutions (torch's FLOP formulas, `flop_registry`), and the `traffic`
    of the others: every byte each aten operator reads and writes (each tensor once), but for
    views and allocations (no data moves) and the fake mode's own queries (`prim.device`). An
    indexing operator (`index_select`, `index_add_`) is charged its whole tensors, not the rows
    it touches: a model that gathers few rows of large tensors is over-charged. (Not torch's
    FlopCounterMode: its module hooks break a forward that calls torch.autograd.grad on its
    input.)"""

    def __init__(self):
        super().__init__()
        self.n, self.flops, self.traffic = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.n += 1
        if func.overloadpacket in flop_registry:
            self.flops += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        elif func.namespace == "aten" and not func.is_view \
                and func.overloadpacket not in MOVE_NOTHING:
            # each tensor once: an in-place or out= operator returns what it wrote
            tensors = {id(t): t for t in tree_leaves((args, kwargs, out))
                       if isinstance(t, torch.Tensor)}
            self.traffic += sum(t.numel() * t.element_size() for t in tensors.values())
        return out


def count_ops(model: nn.Module, inputs, loss_fn) -> int:
    """Aten operators of one forward + loss + backward of `model` (run it under fake mode)."""
    return count_step(model, inputs, loss_fn)[0]


def count_step(model: nn.Module, inputs, loss_fn) -> tuple[int, float, float]:
    """One forward + loss + backward of `model` (run it under fake mode): its aten operators,
    the FLOPs of its matrix products and convolutions (torch's FLOP counter: every one the step
    runs, an `einsum` or a `bmm` as well as a Linear's), and the bytes its memory-bound
    operators read and write (`StepCounter`). The parameters' gradients are as they were after
    it: a training step starts from none (none to add to), and a user's model must not keep the
    trace's fake ones."""
    params = list(model.parameters())
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with StepCounter() as counter:
            loss_fn(model(*inputs)).backward()
    finally:
        for p, grad in zip(params, kept):
            p.grad = grad
    return counter.n, float(counter.flops), float(counter.traffic)
