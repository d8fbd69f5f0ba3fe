"""Outputs of several tensors: a model's forward may return one tensor, or a tuple, list or dict
of them (several heads, a prediction and its uncertainty). What the step does to an output (the
loss in fp32, evaluation's cut to the valid samples, `space`'s gather of whole outputs) it does
to every tensor in it, keeping the structure the user's loss and metrics take. No communication.
"""

from __future__ import annotations

import torch


def map_tensors(out, fn):
    """`out` with `fn` applied to every tensor in it (nested tuples, lists, dicts); anything else
    is kept as it is."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(map_tensors(v, fn) for v in out)
    if isinstance(out, dict):
        return {k: map_tensors(v, fn) for k, v in out.items()}
    return out


def first_tensor(out) -> torch.Tensor | None:
    """The first tensor in `out` (depth first), None when it holds none."""
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return next((t for t in map(first_tensor, values) if t is not None), None)


def fp32(out):
    """The output in float32 (the loss and metrics run in fp32 under bf16/fp16 autocast)."""
    return map_tensors(out, torch.Tensor.float)


__all__ = ["first_tensor", "fp32", "map_tensors"]
