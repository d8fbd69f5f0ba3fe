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
# reads the rows its index names (an embedding lookup reads the rows of its tokens, not the
# table): the indices, the gathered elements and the output they are written to
GATHERS = {torch.ops.aten.embedding, torch.ops.aten.index_select, torch.ops.aten.gather,
           torch.ops.aten.index}
# adds or writes its source into the rows its index names of a tensor it changes in place (a
# message passing's sum into its nodes): the indices, the source, and the rows it touches read
# and written, at most as many as the source has (the out-of-place forms copy the whole
# tensor first and are charged it)
SCATTERS_IN_PLACE = {torch.ops.aten.index_add_, torch.ops.aten.scatter_add_,
                     torch.ops.aten.scatter_, torch.ops.aten.index_put_,
                     torch.ops.aten._index_put_impl_, torch.ops.aten.index_copy_}


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def moved_bytes(func, args, kwargs, out) -> int:
    """The bytes a memory-bound aten operator reads and writes: each tensor once (an in-place
    or out= operator returns what it wrote), an indexing one the rows it touches."""
    tensors = {id(t): t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}
    packet = func.overloadpacket
    if packet in GATHERS:      # (source, indices...) -> out
        written = {id(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        index = sum(_nbytes(t) for i, t in tensors.items() if i != id(args[0]) and i not in written)
        return index + 2 * sum(_nbytes(tensors[i]) for i in written)
    if packet in SCATTERS_IN_PLACE:   # (target, indices..., source) -> target
        rest = [t for i, t in tensors.items() if i != id(args[0])]
        source = max((_nbytes(t) for t in rest if t.is_floating_point() or t.is_complex()),
                     default=0)
        return sum(_nbytes(t) for t in rest) + 2 * min(source, _nbytes(args[0]))
    return sum(_nbytes(t) for t in tensors.values())


class StepCounter(TorchDispatchMode):
    """A dispatch mode that counts the aten operators run under it (inside FakeTensorMode: no
    real work, the same operators a real CPU run dispatches): `n` of them, the `flops` of the
    matrix products and convolutions (torch's FLOP formulas, `flop_registry`), and the `traffic`
    of the others: every byte each aten operator reads and writes (each tensor once), but for
    views and allocations (no data moves) and the fake mode's own queries (`prim.device`); an
    indexing operator (an embedding lookup, `index_select`, an in-place `index_add_`) the rows
    it touches, not its whole tensors (`moved_bytes`). (Not torch's FlopCounterMode: its module hooks break a forward that calls torch.autograd.grad on its
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
            self.traffic += moved_bytes(func, args, kwargs, out)
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
