"""Which weights a model's code reads outside the layer that holds them (`mark_reads_outside`).

A forward may use a layer's weight directly: an autoencoder's decoder as the encoder's weight
transposed (`F.linear(h, self.enc.weight.t())`), a head projecting onto an embedding table, a
weight scaled by hand. Strategies that replace a layer's weight inside its own forward break such
code: `shard` gathers a block's parameters only while that block runs (outside it the weight is
a shard: "mixed torch.Tensor and DTensor"), `tensor` splits a layer's weight (outside it the
weight has a rank's share of the rows: a shape mismatch, or a silently different result).

One forward on a sample finds them: every torch function whose argument is a parameter is
watched (a `TorchFunctionMode`), and a read counts as outside when none of the modules holding
that parameter is running its forward; a module called while its parent is not running (the
root calling `self.blocks[-1].norm(x)`, or reading a parametrized `self.enc.weight`) counts as
reading all its weights outside. Reading a weight's dtype, device or `requires_grad` is not a
use. The forward runs in training mode (a read only training makes counts), without gradients,
with every module's mode put back and no trace left in the model's state (parallel/trial.py),
so the run that follows is the one it would have been; if it fails, once more in eval mode. No
communication here; `train.user_checks.find_reads_outside` takes rank 0's finding on every rank.

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

from .nested import call_on
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
    forward). A forward that fails in both modes finds nothing: training will fail the same way
    and say why."""
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), set()).add(id(module))
    names = {id(m): name for name, m in model.named_modules()}
    owner = _callers(model)
    running: list[int] = []
    watch = _Reads(holders, running, names)

    def enter(module, _args) -> None:
        caller = owner.get(id(module))
        if caller is not None and caller not in running:   # called from outside its parent
            for p in module.parameters():
                watch.outside.setdefault(id(p), names.get(running[-1], "") if running else "")
        running.append(id(module))

    def leave(_module, _args, _output) -> None:   # returns None: the output stays the module's
        running.pop()

    handles = []
    for module in model.modules():   # before the user's own pre-hooks (weight_norm's)
        handles.append(module.register_forward_pre_hook(enter, prepend=True))
        handles.append(module.register_forward_hook(leave, always_call=True))
    modes = {id(m): m.training for m in model.modules()}
    try:
        for training in (True, False):
            try:
                with leaves_no_trace([model]), torch.no_grad(), watch:
                    model.train(training)
                    call_on(model, inputs)
                break
            except Exception:   # noqa: BLE001 - the training forward reports it, where it belongs
                watch.outside.clear()
                running.clear()
        else:
            return {}
    finally:
        for m in model.modules():
            m.training = modes[id(m)]
        for handle in handles:
            handle.remove()
    params = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    return {params[pid]: where for pid, where in watch.outside.items() if pid in params}


def _callers(model: nn.Module) -> dict[int, int]:
    """{module id: id of the module whose forward calls it}: its parent, or the nearest
    ancestor with a forward of its own (a ModuleList's or ModuleDict's blocks are called by the
    module holding the list; a parametrization by the layer it parametrizes)."""
    out: dict[int, int] = {}

    def visit(module: nn.Module, caller: int) -> None:
        for child in module.children():
            container = type(child).forward is nn.Module.forward   # never called itself
            if not container:
                out.setdefault(id(child), caller)
            visit(child, caller if container else id(child))
    visit(model, id(model))
    return out


def mark_reads_outside(model: nn.Module, found: dict[str, str]) -> None:
    """Mark (`exatrain_read_outside`) the parameters `reads_outside` found, by name."""
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in found:
            p.exatrain_read_outside = found[name]


def read_outside(param: torch.Tensor) -> bool:
    """Whether `param` was found read outside its layer (`mark_reads_outside`)."""
    return hasattr(param, "exatrain_read_outside")


def read_outside_of(path: str, params) -> bool:
    """Whether one of `params` was found read where the module at `path` (its name in the
    model, wrapper levels stripped; "" the root) is not running: a block FSDP2 gathers only
    while it runs must not be a unit of its own."""
    for p in params:
        where = getattr(p, "exatrain_read_outside", None)
        if where is not None and path and not (where == path or where.startswith(path + ".")):
            return True
    return False


def weights_set_by_hooks(module: nn.Module) -> list[str]:
    """The names of `module`'s tensors that a forward pre-hook computes before each call from
    other parameters: PyTorch's older `torch.nn.utils.weight_norm` (`weight` from `weight_g` and
    `weight_v`) and `torch.nn.utils.spectral_norm` (`weight` from `weight_orig`). Such a `weight`
    is a plain attribute, not a parameter; a strategy that took it for the layer's weight would
    train a copy of it and leave the parameters that define it untouched."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    return [hook.name for hook in module._forward_pre_hooks.values()
            if isinstance(hook, (WeightNorm, SpectralNorm))]
