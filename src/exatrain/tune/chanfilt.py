"""Cost terms of channel/filter-parallel convolutions (parallel/tensor/conv.py) for the planner.

`conv_terms(model, plan, input_shape)` predicts, for one rank of `plan` and one training step
with a replica batch of `input_shape` (whole samples; under `space` the early layers see their
blocks), from the strategy's own rules and formulas (imported, not rewritten):

  which convolutions split   `tensor.switch.switch_point` (under space; else all from the first)
                             and `tensor.cnn.find_conv_pairs` (pairs; the other eligible
                             convolutions are filter-parallel with a gathered output)
  tensor_bytes               Σ `conv.filter_bytes` / `conv.channel_bytes` over them, at the
                             layer shapes of one meta-device forward (`switch.conv_shapes`),
                             + the 8-byte dropout-seed broadcast of every tensor-parallel forward
  tensor_by_op               the same bytes per collective, with the calls, as the ledger keys
                             them: {"all_reduce": [bytes, calls], "all_gather": ..., "broadcast":
                             ...}. A pair's filter conv all-reduces its input gradient (backward)
                             and its channel conv its output (forward); a gathered filter conv
                             all-gathers its output (forward) and all-reduces its input gradient
                             (backward); the model's first convolution has no input gradient
  conv_params_per_rank       convolution (and paired BatchNorm) parameters the rank holds:
                             split ones / t
  grad_allreduce_bytes       4 bytes per held convolution parameter, over the replica axes
                             (falls by t for the split layers)
  switch_bytes               under space: the gather of the blocks at the switch (ledger: the
                             `space` axis, all-gather of the whole activation)

The Linear layers' terms are `linear_terms` (linear1d's formulas, over the pairs of
`tensor.pairs.find_pairs` and the column singles that gather their output); `cnn_tensor` adds
the two and gives each parameter's local shape, which is what `tune/cost.py` uses for a CNN
under 1D `tensor` (without `space`): parameters per rank, the tensor axis's bytes and the
gradient all-reduce. They equal the ledger exactly (tests/test_tensor_conv.py: a CNN whose Linear
stays whole; tests/test_planner.py: CosmoFlow's dry run under data × tensor, bytes and calls
per collective against the dry run's `ledger_entries`).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ..parallel.tensor.cnn import BATCHNORMS, find_conv_pairs
from ..parallel.tensor.conv import channel_bytes, filter_bytes, is_conv, splittable
from ..parallel.tensor.switch import conv_names, conv_shapes, eligible_after, switch_point
from ..plan import Plan

SEED_BYTES = 8


def _add(by_op: dict, op: str, nbytes: int) -> None:
    """One collective of `nbytes` (none when a formula's term is 0: the layer skips it)."""
    if nbytes:
        entry = by_op.setdefault(op, [0, 0])
        entry[0] += nbytes
        entry[1] += 1


def _merge(*parts: dict) -> dict:
    out: dict = {}
    for part in parts:
        for op, (nbytes, calls) in part.items():
            entry = out.setdefault(op, [0, 0])
            entry[0] += nbytes
            entry[1] += calls
    return out


def conv_terms(model: nn.Module, plan: Plan, input_shape: tuple[int, ...],
               element_size: int = 4, chanfilt_from: str = "") -> dict:
    """The convolutions' channel/filter terms for one rank of `plan` (module docstring).
    `input_shape`: one replica's batch (N, C, *spatial), whole samples."""
    t = plan.tensor_degree if not plan.tensor_3d else 1
    example = torch.empty(input_shape, device="meta")
    shapes = conv_shapes(model, example)
    names = conv_names(model)
    first = chanfilt_from or (switch_point(model, t, example, element_size)
                              if plan.space_degree > 1 else (names[0] if names else None))
    eligible = eligible_after(model, first, ()) if t > 1 else set()
    convs = dict((n, m) for n, m in model.named_modules() if is_conv(m))
    pairs = find_conv_pairs(model, t, eligible.__contains__) if t > 1 else []
    paired = {p[0][0] for p in pairs} | {p[2][0] for p in pairs}
    split_bn = {n for p in pairs for n, _par, _k, m in p[1] if isinstance(m, BATCHNORMS)}
    by_op: dict = {}
    held = 0
    whole_params = 0
    for name, conv in convs.items():
        c = shapes[name]
        n = c["N"]
        params = sum(p.numel() for p in conv.parameters())
        input_grad = name != names[0]        # the model's input needs no gradient
        if name in paired:
            side = "filter" if any(p[0][0] == name for p in pairs) else "channel"
            if side == "filter":     # copy_to: all-reduce of the input gradient
                _add(by_op, "all_reduce", filter_bytes(n, c["C_in"], c["V_in"], c["C_out"],
                                                       c["V_out"], element_size, False, input_grad))
                held += params // t
            else:                    # reduce_from: all-reduce of the output
                _add(by_op, "all_reduce", channel_bytes(n, c["C_in"], c["V_in"], c["C_out"],
                                                        c["V_out"], element_size, False, False))
                bias = conv.bias.numel() if conv.bias is not None else 0
                held += (params - bias) // t + bias
        elif name in eligible and splittable(conv, t, "filter"):
            shape = (n, c["C_in"], c["V_in"], c["C_out"], c["V_out"], element_size)
            _add(by_op, "all_gather", filter_bytes(*shape, True, False))     # the output
            _add(by_op, "all_reduce", filter_bytes(*shape, False, input_grad))
            held += params // t
        else:
            held += params
            whole_params += params
    for name, m in model.named_modules():
        if isinstance(m, BATCHNORMS):
            params = sum(p.numel() for p in m.parameters())
            held += params // t if name in split_bn else params
    switch_bytes = 0
    if plan.space_degree > 1 and first is not None and t > 1:
        c = shapes[first]
        switch_bytes = c["N"] * c["C_in"] * c["V_in"] * element_size
    replicas = plan.data * plan.shard
    if t > 1:
        _add(by_op, "broadcast", SEED_BYTES)
    return {"switch": first if t > 1 else None, "pairs": [(p[0][0], p[2][0]) for p in pairs],
            "tensor_bytes": sum(b for b, _calls in by_op.values()), "tensor_by_op": by_op,
            "conv_params_per_rank": held,
            "grad_allreduce_bytes": 4 * held if replicas * plan.space_degree > 1 else 0,
            "switch_bytes": switch_bytes, "split_batchnorm": split_bn,
            "whole_conv_params": whole_params,
            "input_volume": math.prod(input_shape[2:])}


def linear_terms(model: nn.Module, t: int, rows: int, element_size: int = 4) -> dict:
    """The Linear layers under 1D tensor = t (`parallel.tensor.convert`): chained pairs
    (`find_pairs`: column layers sharing their input's f, a row layer that all-reduces its
    output) and column singles that all-gather their output (every other exact `nn.Linear`
    whose out_features divide t). `rows`: the rows one forward feeds each (samples, for a CNN's
    head). Returns {"tensor_bytes", "by_op": {op: [bytes, calls]}, "split": {name: ("column" |
    "row")}}: a pair all-reduces its input gradient (backward, shared f) and the row layer's
    output (forward); a column single all-gathers its output (forward) and all-reduces its input
    gradient (backward)."""
    from ..parallel.tensor.pairs import find_pairs
    from ..parallel.tensor.linear1d import column_bytes, row_bytes, shared_input_bytes
    split: dict[str, str] = {}
    by_op: dict = {}
    for parent, module, columns, row in find_pairs(model):
        cols = [module.get_submodule(c) for c in columns]
        r = module.get_submodule(row)
        if any(c.out_features % t for c in cols) or r.in_features % t:
            continue
        prefix = f"{parent}." if parent else ""
        _add(by_op, "all_reduce", shared_input_bytes(rows, cols[0].in_features, element_size))
        _add(by_op, "all_reduce", row_bytes(rows, r.in_features, r.out_features, element_size,
                                            False))
        split.update({prefix + c: "column" for c in columns})
        split[prefix + row] = "row"
    for name, m in model.named_modules():
        if type(m) is nn.Linear and name not in split and m.out_features % t == 0:
            _add(by_op, "all_gather", column_bytes(rows, m.in_features, m.out_features,
                                                   element_size, True, False))
            _add(by_op, "all_reduce", column_bytes(rows, m.in_features, m.out_features,
                                                   element_size, False, True))
            split[name] = "column"
    return {"tensor_bytes": sum(b for b, _c in by_op.values()), "by_op": by_op, "split": split}


def _local_shape(shape: tuple, dim: int, t: int) -> tuple:
    return tuple(n // t if i == dim else n for i, n in enumerate(shape))


def cnn_tensor(model: nn.Module, plan: Plan, sample_shape: tuple[int, ...], samples: float,
               element_size: int = 4) -> dict:
    """A CNN under 1D `tensor` (no `space`): convolutions (`conv_terms`) and Linears
    (`linear_terms`) together, for one rank and one step of `samples` samples of `sample_shape`
    (C, *spatial). Returns {"tensor_bytes", "calls", "by_op", "per_sample_by_op", "local_shapes",
    "batchnorm_channels"}: the tensor axis's bytes (ledger convention; the 8-byte seed broadcast
    once per forward), the collectives they take, both per collective as the ledger keys them
    ({op: [bytes, calls]}; `per_sample_by_op` without the broadcast, bytes of one sample), every
    parameter's shape on the rank, in registration order, and the channels each BatchNorm holds
    on the rank (a BatchNorm inside a pair holds 1/t)."""
    t = plan.tensor_degree
    one = conv_terms(model, plan, (1, *sample_shape), element_size)
    lin = linear_terms(model, t, 1, element_size)
    per_sample = one["tensor_bytes"] - SEED_BYTES + lin["tensor_bytes"]
    convs = dict((n, m) for n, m in model.named_modules() if is_conv(m))
    filter_side = {a for a, _b in one["pairs"]}
    channel_side = {b for _a, b in one["pairs"]}
    split_bn = one["split_batchnorm"]
    shapes = []
    for name, param in model.named_parameters():
        owner, _, kind = name.rpartition(".")
        shape = tuple(param.shape)
        if owner in filter_side or (owner in convs and owner not in channel_side
                                    and splittable(convs[owner], t, "filter")):
            shape = _local_shape(shape, 0, t)
        elif owner in channel_side:
            shape = _local_shape(shape, 1, t) if kind == "weight" else shape
        elif owner in split_bn or lin["split"].get(owner) == "column":
            shape = _local_shape(shape, 0, t)
        elif lin["split"].get(owner) == "row" and kind == "weight":
            shape = _local_shape(shape, 1, t)
        shapes.append(shape)
    per_op = _merge(one["tensor_by_op"], lin["by_op"])
    seed = per_op.pop("broadcast", [0, 0])
    by_op = {op: [b * samples, calls] for op, (b, calls) in per_op.items()}
    if seed[1]:
        by_op["broadcast"] = seed
    calls = sum(c for _b, c in by_op.values())
    batchnorm = [m.num_features // t if n in split_bn else m.num_features
                 for n, m in model.named_modules() if isinstance(m, BATCHNORMS)]
    return {"tensor_bytes": per_sample * samples + SEED_BYTES, "per_sample_bytes": per_sample,
            "calls": calls, "by_op": by_op, "per_sample_by_op": per_op,
            "local_shapes": shapes, "batchnorm_channels": batchnorm}


@functools.lru_cache(maxsize=8)
def cosmoflow_meta(size: int, in_channels: int, base_channels: int, conv_layers: int,
                   batchnorm: bool) -> nn.Module:
    """CosmoFlow on the meta device (no memory): the shapes `cnn_tensor` walks."""
    from ..models.cosmoflow import CosmoFlow
    with torch.device("meta"):
        return CosmoFlow(size=size, in_channels=in_channels, base_channels=base_channels,
                         conv_layers=conv_layers, batchnorm=batchnorm)


__all__ = ["cnn_tensor", "conv_terms", "cosmoflow_meta", "linear_terms"]
