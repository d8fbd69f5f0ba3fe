"""Which weights a model's code reads outside the layer that holds them (`mark_reads_outside`).

A forward may use a layer's weight directly: an autoencoder's decoder as the encoder's weight
transposed (`F.linear(h, self.enc.weight.t())`), a head projecting onto an embedding table, a
weight scaled by hand. Strategies that replace a layer's weight inside its own forward break such
code: `shard` gathers a block's parameters only while that block runs (outside it the weight is
a shard: "mixed torch.Tensor and DTensor"), `tensor` splits a layer's weight (outside it the
weight has a rank's share of the rows: a shape mismatch, or a silently different result).

One forward on a sample finds them: every torch function whose argument is a parameter is
watched (a `TorchFunctionMode`), and a read counts as outside when none of the modules holding
that parameter is running its forward. Reading a weight's dtype, device or `requires_grad` is not
a use. The forward runs in eval mode without gradients and leaves no trace (parallel/trial.py),
so the run that follows is the one it would have been. No communication.

Each such parameter gets `exatrain_read_outside` (where it was read: the module path of the
running forward, "" for the model's own), which the steps read: `tensor` keeps its layer whole
(tensor/convert.py, as for tied weights) and `shard` leaves its block to the model's own unit,
gathered for the whole forward (shard.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .trial import leaves_no_trace

# reading these of a weight does not use its values or its shape
METADATA = frozenset({"dtype", "device", "requires_grad", "is_cuda", "is_meta", "layout",
                      "is_sparse", "is_quantized", "grad_fn", "is_leaf"})


class _Reads(TorchFunctionMode):
    """Records each parameter a torch function reads while none of its holders runs."""

    def __init__(self, holders: dict[int, set[int]], running: list[int], names: dict[int, str]):
        super().__init__()
        self.holders, self.running, self.names = holders, running, names
        self.outside: dict[int, str] = {}   # parameter id -> the module path that read it

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        getter = getattr(func, "__name__", "") == "__get__"
        if not (getter and getattr(getattr(func, "__self__", None), "__name__", "") in METADATA):
            for value in tree_leaves((args, kwargs)):
                pid = id(value)
                if pid in self.holders and pid not in self.outside \
                        and not self.holders[pid].intersection(self.running):
                    self.outside[pid] = self.names.get(self.running[-1], "") if self.running else ""
        return func(*args, **kwargs)


def reads_outside(model: nn.Module, inputs) -> dict[str, str]:
    """{parameter name: module path of the forward that read it} for the parameters `model`'s
    forward on `inputs` reads outside every module holding them ("" is the model's own
    forward). A forward that fails finds nothing: training will fail the same way and say why."""
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), set()).add(id(module))
    names = {id(m): name for name, m in model.named_modules()}
    running: list[int] = []

    def enter(module, _args) -> None:
        running.append(id(module))

    def leave(_module, _args, _output) -> None:   # returns None: the output stays the module's
        running.pop()

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    was_training = model.training
    watch = _Reads(holders, running, names)
    try:
        with leaves_no_trace([model]), torch.no_grad(), watch:
            model.eval()
            model(inputs)
    except Exception:   # noqa: BLE001 - the training forward reports it, where it belongs
        return {}
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    params = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    return {params[pid]: where for pid, where in watch.outside.items() if pid in params}


def mark_reads_outside(model: nn.Module, inputs) -> dict[str, str]:
    """Find (`reads_outside`) and mark (`exatrain_read_outside`) the parameters read outside
    their layers; returns them. Parameters the model only holds are left unmarked."""
    found = reads_outside(model, inputs)
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in found:
            p.exatrain_read_outside = found[name]
    return found


def read_outside(param: torch.Tensor) -> bool:
    """Whether `param` was found read outside its layer (`mark_reads_outside`)."""
    return hasattr(param, "exatrain_read_outside")

