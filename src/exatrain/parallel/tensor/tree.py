"""The module tree tensor parallelism converts: a copy that shares the storage of the model it is
given (`clone_tree`), the parameters tied in it, and the memory of a model split on the meta
device (`materialize`: each rank allocates its own parts only).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.utils.parametrize import is_parametrized


def clone_tree(module: nn.Module, _modules=None, _params=None) -> nn.Module:
    """A copy of the module tree: new module objects and new Parameter objects that share the
    original storage (so no memory is copied), hooks and attributes of their own.

    Shared submodules and tied parameters stay shared in the copy. The copy and the original
    share weights: train one or the other.
    """
    _modules = {} if _modules is None else _modules
    _params = {} if _params is None else _params
    if id(module) in _modules:
        return _modules[id(module)]
    if is_parametrized(module):   # (weight_norm) refuses copy.copy's pickling hook
        new = type(module).__new__(type(module))
        new.__dict__.update(module.__dict__)
    else:   # copy.copy: an fx GraphModule (a pipeline stage) copies itself (a class per instance)
        new = copy.copy(module)
    for key, value in list(new.__dict__.items()):
        if isinstance(value, dict):
            new.__dict__[key] = value.copy()
    _modules[id(module)] = new
    for name, p in module._parameters.items():
        if p is not None and id(p) not in _params:
            _params[id(p)] = nn.Parameter(p.detach(), requires_grad=p.requires_grad)
            _params[id(p)].__dict__.update(   # what exatrain knows of it (parallel/reads.py)
                {k: v for k, v in vars(p).items() if k.startswith("exatrain_")})
        new._parameters[name] = None if p is None else _params[id(p)]
    for name, child in module._modules.items():
        new._modules[name] = None if child is None else clone_tree(child, _modules, _params)
    return new


def tied_parameters(root: nn.Module) -> set[int]:
    """The ids of parameters that stay whole: those held by several modules, those the model's
    forward reads outside their layer (parallel/reads.py: `F.linear(h, enc.weight.t())` would
    meet a rank's share), and those of a layer whose weight a hook computes from them (the older
    `torch.nn.utils.weight_norm`: its norm runs over a whole row of `weight_v`)."""
    from ..reads import read_outside, weights_set_by_hooks

    counts: dict[int, int] = {}
    for _name, p in root.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    return {pid for pid, n in counts.items() if n > 1} | \
        {id(p) for p in root.parameters() if read_outside(p)} | \
        {id(p) for m in root.modules() if weights_set_by_hooks(m) for p in m.parameters()}


def materialize(root: nn.Module, device) -> None:
    """Give every meta-device parameter and buffer uninitialised memory on `device` (after the
    split, so only local parts are allocated), keeping names, ties and exatrain metadata."""
    done: dict[int, torch.Tensor] = {}
    for module in root.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                    new = nn.Parameter(empty, requires_grad=t.requires_grad) \
                        if isinstance(t, nn.Parameter) else empty
                    new.__dict__.update(t.__dict__)
                    done[id(t)] = new
                table[name] = done[id(t)]
