"""Where a CNN switches from spatial to channel/filter parallelism (Plan(space=..., tensor=t)).

Early layers of a 3D CNN have large volumes and few channels: splitting the volume (`space`)
moves only halos, and their small weights cost little to all-reduce. Late layers have small
volumes and many channels: channel/filter parallelism (`tensor`) moves whole activations but
holds and all-reduces 1/t of the weights. The model switches once, at the first convolution `k`
(in registration order, which is execution order for the models exatrain splits) from which
channel/filter is the cheaper of the two by the byte formulas, per rank and step, s bytes per
element:

    tensor_k = N·(C_in·V_in + C_out·V_out)·s / 2      a pair's two all-reduces, per convolution
    space_k  = |W_k|·s·(1 - 1/t) + halo_k             the weight-gradient bytes channel/filter
                                                      saves, plus the halos space would move
    halo_k   = 2·N·C_in·(V_in / L)·r·s                 one pair of faces of r = kernel // 2 planes
                                                      (L = V_in^(1/d), the side of the volume)

The switch costs one gather of the blocks (the redistribution; counted by the ledger under the
`space` axis, tag "act"). Shapes come from one forward of the plain model on the meta device
with an example batch of whole samples (`conv_shapes`; the Trainer, `et.fit` and the dry run pass
one replica's batch as a meta tensor, `train.job.pipeline_example`, as the planner's
`tune.chanfilt.conv_terms` uses); without one (a plain `parallelize` call) the rule falls back to
the weights alone: the switch is at the first convolution from which the convolutions hold at
least 90 % of all convolution weights. `parallel.chanfilt_from` overrides it by module name.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from .cnn import refusal
from .conv import is_conv
from ...errors import ConfigError, TensorSplitError

WEIGHT_SHARE = 0.9


def conv_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if is_conv(m)]


def conv_shapes(model: nn.Module, example: torch.Tensor) -> dict[str, dict]:
    """{conv name: {N, C_in, V_in, C_out, V_out, weights, r, d}} from one meta-device forward."""
    meta = copy.deepcopy(model).to("meta")
    shapes: dict[str, dict] = {}
    hooks = []
    for name, m in meta.named_modules():
        if is_conv(m):
            def record(mod, args, out, name=name):
                x = args[0]
                shapes[name] = dict(N=x.shape[0], C_in=x.shape[1], V_in=math.prod(x.shape[2:]),
                                    C_out=out.shape[1], V_out=math.prod(out.shape[2:]),
                                    weights=mod.weight.numel(), d=x.dim() - 2,
                                    r=max(k // 2 for k in mod.kernel_size))
            hooks.append(m.register_forward_hook(record))
    with torch.no_grad():
        meta(example.to("meta"))
    for h in hooks:
        h.remove()
    return shapes


def tensor_bytes(c: dict, s: int) -> float:
    return c["N"] * (c["C_in"] * c["V_in"] + c["C_out"] * c["V_out"]) * s / 2


def space_bytes(c: dict, s: int, t: int) -> float:
    side = c["V_in"] ** (1.0 / c["d"])
    halo = 2 * c["N"] * c["C_in"] * (c["V_in"] / side) * c["r"] * s
    return c["weights"] * s * (1 - 1 / t) + halo


def switch_point(model: nn.Module, t: int, example: torch.Tensor | None = None,
                 element_size: int = 4) -> str | None:
    """The name of the first convolution split over `tensor`, by the rule above; None when
    the model has no convolution (or none is cheaper under channel/filter)."""
    names = conv_names(model)
    if not names:
        return None
    if example is not None:
        shapes = conv_shapes(model, example)
        for name in names:
            c = shapes.get(name)
            if c is not None and tensor_bytes(c, element_size) <= space_bytes(c, element_size, t):
                return name
        return None
    weights = {n: m.weight.numel() for n, m in model.named_modules() if is_conv(m)}
    total, after = sum(weights.values()), 0
    for name in reversed(names):
        after += weights[name]
        if after >= WEIGHT_SHARE * total:
            return name
    return names[0]


def eligible_after(model: nn.Module, first: str | None, skip=()) -> set[str]:
    """Names of the convolutions from `first` on (registration order), less `skip`."""
    names = conv_names(model)
    if first is None:
        return set()
    return set(names[names.index(first):]) - set(skip)


__all__ = ["conv_names", "conv_shapes", "eligible_after", "space_bytes", "switch_point",
           "tensor_bytes"]


def conv_selection(model: nn.Module, plan, options, example=None) -> set[str]:
    """The convolutions split channel/filter-wise: none under the 3D grid; under 1D all from
    the switch point on (`parallel.chanfilt_from`, else the first one, or under `space` the
    automatic switch of switch.py), less `parallel.chanfilt_skip`. Bad names are refused."""
    if plan.tensor_3d:
        return set()
    start = getattr(options, "chanfilt_from", "")
    skip = list(getattr(options, "chanfilt_skip", []))
    if plan.pipe > 1 and (start or skip):
        raise ConfigError(f"{plan}: parallel.chanfilt_from / chanfilt_skip name modules of the "
                          "whole model, but under pipe > 1 each stage is converted on its own "
                          "(its modules have stage names); leave them empty (automatic).")
    why = refusal(model, start, skip)
    if why:
        raise TensorSplitError(why)
    names = conv_names(model)
    if not start and names:
        start = switch_point(model, plan.tensor_degree, example) if plan.space_degree > 1 \
            else names[0]
    return eligible_after(model, start or None, skip)
