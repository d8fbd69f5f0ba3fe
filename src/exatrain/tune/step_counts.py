"""What one training step of a model dispatches, counted without running it for real (under
torch's FakeTensorMode): its aten operators, the FLOPs of its matrix products and convolutions,
and the bytes its memory-bound operators read and write. The planner charges a step its
operators at a fixed cost each (`tune.overheads`), its FLOPs at the device's rate and its bytes
at the device's elementwise bandwidth (`tune.cost`); `tune.calibrate` measures that bandwidth on
operators counted the same way.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager

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
# writes into the rows its index names of a tensor it changes in place (a message passing's
# sum into its nodes): (dim, index, source) after the target, or index_put_'s (indices, values);
# the out-of-place forms copy the whole tensor first and are charged it
_a = torch.ops.aten
SCATTERS_IN_PLACE = {_a.index_add_, _a.index_copy_, _a.index_fill_, _a.index_reduce_,
                     _a.scatter_, _a.scatter_add_, _a.scatter_reduce_,
                     _a.index_put_, _a._index_put_impl_}
# ... and adds to (reads) the rows it writes
_ACCUMULATE = {_a.index_add_, _a.index_reduce_, _a.scatter_add_, _a.scatter_reduce_}
_ROWS_ALONG_DIM = {_a.index_add_, _a.index_copy_, _a.index_fill_, _a.index_reduce_}


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _put_elements(target, indices) -> int:
    """The elements `target[indices] = ...` writes: the advanced indices' broadcast shape times
    the target's dims they do not name (a None is a whole dim; a bool mask names as many dims as
    it has, and is taken as all true: under fake tensors its count is not known)."""
    shapes, named, dim = [], 1, 0
    for index in indices:
        if index is None:
            dim += 1
            continue
        mask = index.dtype in (torch.bool, torch.uint8)
        span = index.dim() if mask else 1
        shapes.append((index.numel(),) if mask else tuple(index.shape))
        named *= math.prod(target.shape[dim:dim + span])
        dim += span
    rows = math.prod(torch.broadcast_shapes(*shapes)) if shapes else 1
    return rows * (target.numel() // max(1, named))


def _scattered_bytes(packet, args, kwargs) -> int:
    """An in-place scatter's bytes: its indices, the source elements it reads, and the elements
    of the target it writes (read too where it accumulates), at most the whole target."""
    target = args[0]
    if packet in (_a.index_put_, _a._index_put_impl_):   # (target, indices, values, accumulate)
        indices = [t for t in args[1] if t is not None]
        source = args[2]
        accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
        written = _put_elements(target, args[1])
    else:                                  # (target, dim, index, source or value, ...)
        dim, index = args[1], args[2]
        source = args[3] if len(args) > 3 else None
        indices = [index]
        accumulate = packet in _ACCUMULATE or "reduce" in kwargs
        if not kwargs.get("include_self", True):   # a reduction that overwrites what it reads
            accumulate = False
        written = index.numel() * (target.numel() // max(1, target.shape[dim])
                                   if packet in _ROWS_ALONG_DIM and target.dim() else 1)
    written = min(written, target.numel())
    read = 0
    if isinstance(source, torch.Tensor):   # a 0-dim or broadcast value is read once
        read = min(source.numel(), written) * source.element_size()
    return sum(_nbytes(t) for t in indices) + read \
        + (2 if accumulate else 1) * written * target.element_size()


def moved_bytes(func, args, kwargs, out) -> int:
    """The bytes a memory-bound aten operator reads and writes: each tensor once (an in-place
    or out= operator returns what it wrote), an indexing one the rows it touches."""
    tensors = {id(t): t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}
    packet = func.overloadpacket
    if packet in GATHERS:      # (source, indices...) -> out
        written = {id(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        index = sum(_nbytes(t) for i, t in tensors.items() if i != id(args[0]) and i not in written)
        return index + 2 * sum(_nbytes(tensors[i]) for i in written)
    if packet in SCATTERS_IN_PLACE:
        return _scattered_bytes(packet, args, kwargs)
    return sum(_nbytes(t) for t in tensors.values())


class StepCounter(TorchDispatchMode):
    """A dispatch mode that counts the aten operators run under it (inside FakeTensorMode: no
    real work, the same operators a real CPU run dispatches): `n` of them, the `flops` of the
    matrix products and convolutions (torch's FLOP formulas, `flop_registry`), and the `traffic`
    of the others: every byte each aten operator reads and writes (each tensor once), but for
    views and allocations (no data moves) and the fake mode's own queries (`prim.device`); an
    indexing operator (an embedding lookup, `index_select`, an in-place `index_add_`) the rows
    it touches, not its whole tensors (`moved_bytes`). (Not torch's FlopCounterMode: its module
    hooks break a forward that calls torch.autograd.grad on its input.)"""

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


@contextmanager
def buffers_kept(model: nn.Module):
    """The model's buffers as they were before, after traces of it (a BatchNorm counts the
    batches it is given, fake ones too; a forward may assign a buffer anew, a fake one under the
    trace: the planner's traces are not training). Each module's own buffers, by name, the
    same tensors with their values back, None where there was none."""
    kept = [(module, name, buffer, None if buffer is None else buffer.detach().clone())
            for module in model.modules() for name, buffer in module._buffers.items()]
    try:
        yield
    finally:
        for module, name, buffer, value in kept:
            module._buffers[name] = buffer
            if buffer is not None:
                with torch.no_grad():
                    buffer.copy_(value)


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


def traffic_split(model: nn.Module, x: torch.Tensor, loss, at_one: float,
                   name: str) -> tuple[float, float]:
    """A user's model's memory traffic per sample and per step, from its bytes traced at batches
    2 and 4 (under the caller's fake mode): what grows with the batch is per sample, the rest
    the step's own (an embedding table's dense gradient, a parametrized weight's elementwise
    work), moved once a step whatever the batch. Not from batch 1 (`at_one`), where some of a
    batch's operators are views or skipped (SchNet: 11.1 MiB at batch 1, then 11.6 MiB more for
    each sample). Traffic that grows faster than the batch (a batch-by-batch term) is charged
    per sample at its slope between 2 and 4."""
    try:
        with warnings.catch_warnings():   # batch 1's trace has shown the loss's own
            warnings.simplefilter("ignore")   # (a target of one sample broadcast: its bytes)
            moved = {b: count_step(model, (torch.zeros((b, *x.shape[1:]), dtype=x.dtype),),
                                   loss)[2] for b in (2, 4)}
    except Exception as failed:  # noqa: BLE001 - e.g. a loss bound to one sample's target
        warnings.warn(f"the planner traced {name or type(model).__name__} at batch 1 only: at "
                      f"batch 2 its forward or loss raised {type(failed).__name__}: "
                      f"{str(failed).rstrip('.')}. Its memory traffic per sample is batch 1's, "
                      "whole tables included; give a loss that takes the output of any batch (a "
                      "target of the output's batch size) to have them charged once a step.",
                      stacklevel=3)
        return at_one, 0.0
    per_sample = max(0.0, (moved[4] - moved[2]) / 2)
    return per_sample, max(0.0, moved[2] - 2 * per_sample)
