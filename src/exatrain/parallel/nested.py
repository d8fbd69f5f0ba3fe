"""Outputs of several tensors: a model's forward may return one tensor, or a tuple, list or dict
of them (several heads, a prediction and its uncertainty, an auxiliary loss). What the step does
to an output (the loss in fp32, evaluation's cut to the valid samples, `space`'s gather of whole
outputs) it does to every tensor in it, keeping the structure (a namedtuple stays one) that the
user's loss and metrics take. No communication.

A pipeline's last stage hands torch's stage a flat tuple of tensors (`tensors_of`) and its loss
the user's structure again (`rebuild`); evaluation joins the micro-batches' outputs
(`join_microbatches`).

Inputs likewise: a model of several inputs takes them as its data set gives them, a tuple or
list as positional arguments, a dict as keyword arguments (`call_on`).
"""

from __future__ import annotations

import torch


def map_tensors(out, fn):
    """`out` with `fn` applied to every tensor in it (nested tuples, namedtuples, lists, dicts);
    anything else is kept as it is."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        mapped = [map_tensors(v, fn) for v in out]
        return type(out)(*mapped) if hasattr(out, "_fields") else type(out)(mapped)
    if isinstance(out, dict):
        mapped = {k: map_tensors(v, fn) for k, v in out.items()}
        try:    # an OrderedDict, or a dict subclass with attributes, stays what it was
            return type(out)(mapped)
        except Exception:  # noqa: BLE001 - a subclass that cannot be built from a dict
            return mapped
    return out


def call_on(model, inputs):
    """`model` called on a batch's inputs as a data set gives them: a tuple or list of tensors
    as positional arguments (`forward(self, field, params)`), a dict as keyword arguments, one
    tensor as the one argument. (A model whose one argument is a list takes it as a tuple of
    one: `((xs,), target)`.)"""
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def first_tensor(out) -> torch.Tensor | None:
    """The first tensor in `out` (depth first), None when it holds none."""
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return next((t for t in map(first_tensor, values) if t is not None), None)


def fp32(out):
    """The output's floating-point tensors in float32 at least (the loss and metrics run in
    fp32 under bf16/fp16 autocast); float64 outputs (a float64 model's) keep their digits, and
    integer and bool outputs (indices, masks) are kept as they are."""
    return map_tensors(out, lambda t: t.float() if t.is_floating_point()
                       and torch.finfo(t.dtype).bits < 32 else t)


def cut_batch(out, keep: int, batch: int):
    """The first `keep` samples of every tensor of `out` whose leading dim is the batch (`batch`
    rows); other tensors (a 0-dim auxiliary loss, a per-model tensor) are kept whole."""
    return map_tensors(out, lambda t: t[:keep] if t.dim() and t.shape[0] == batch else t)


def tensors_of(out) -> list[torch.Tensor]:
    """Every tensor in `out`, depth first (the order `rebuild` fills them back in)."""
    found: list[torch.Tensor] = []
    map_tensors(out, lambda t: found.append(t) or t)
    return found


def skeleton(out):
    """`out`'s structure with each tensor replaced by an empty meta tensor: a template for
    `rebuild` that holds no memory."""
    return map_tensors(out, lambda t: torch.empty(0, device="meta"))


def rebuild(template, tensors) -> object:
    """`template`'s structure (from `skeleton`) holding `tensors` in `tensors_of`'s order."""
    remaining = iter(tensors)
    return map_tensors(template, lambda _: next(remaining))


def join_microbatches(chunks: list, micro: int):
    """One output from the outputs of equal micro-batches of `micro` samples, in order:
    batch-leading tensors concatenated; a floating 0-dim tensor (an auxiliary loss) averaged as
    the batch mean would be; any other tensor (per model, not per sample) as the first gave it."""
    def join(ts):
        if ts[0].dim() and ts[0].shape[0] == micro:
            return torch.cat(ts)
        if not ts[0].dim() and ts[0].is_floating_point():
            return torch.stack(ts).mean()
        return ts[0]
    joined = [join(ts) for ts in zip(*(tensors_of(c) for c in chunks))]
    return rebuild(chunks[0], joined)


__all__ = ["call_on", "cut_batch", "first_tensor", "fp32", "join_microbatches", "map_tensors",
           "rebuild", "skeleton", "tensors_of"]
