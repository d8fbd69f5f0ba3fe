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
  conv_params_per_rank       convolution (and paired BatchNorm) parameters the rank holds:
                             split ones / t
  grad_allreduce_bytes       4 bytes per held convolution parameter, over the replica axes
                             (falls by t for the split layers)
  switch_bytes               under space: the gather of the blocks at the switch (ledger: the
                             `space` axis, all-gather of the whole activation)

The Linear layers' terms are the cost model's own (tune/cost.py, linear1d's formulas); these
terms are the convolutions'. They equal the ledger for the convolution layers exactly
(tests/test_tensor_conv.py checks a CNN whose Linear stays whole).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..parallel.tensor.cnn import BATCHNORMS, find_conv_pairs
from ..parallel.tensor.conv import channel_bytes, filter_bytes, is_conv, splittable
from ..parallel.tensor.switch import conv_names, conv_shapes, eligible_after, switch_point
from ..plan import Plan

SEED_BYTES = 8


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
    tensor_bytes = 0
    held = 0
    whole_params = 0
    for name, conv in convs.items():
        c = shapes[name]
        n = c["N"]
        params = sum(p.numel() for p in conv.parameters())
        input_grad = name != names[0]        # the model's input needs no gradient
        if name in paired:
            side = "filter" if any(p[0][0] == name for p in pairs) else "channel"
            if side == "filter":
                tensor_bytes += filter_bytes(n, c["C_in"], c["V_in"], c["C_out"], c["V_out"],
                                             element_size, False, input_grad)
                held += params // t
            else:
                tensor_bytes += channel_bytes(n, c["C_in"], c["V_in"], c["C_out"], c["V_out"],
                                              element_size, False, input_grad)
                bias = conv.bias.numel() if conv.bias is not None else 0
                held += (params - bias) // t + bias
        elif name in eligible and splittable(conv, t, "filter"):
            tensor_bytes += filter_bytes(n, c["C_in"], c["V_in"], c["C_out"], c["V_out"],
                                         element_size, True, input_grad)
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
    return {"switch": first if t > 1 else None, "pairs": [(p[0][0], p[2][0]) for p in pairs],
            "tensor_bytes": tensor_bytes + (SEED_BYTES if t > 1 else 0),
            "conv_params_per_rank": held,
            "grad_allreduce_bytes": 4 * held if replicas * plan.space_degree > 1 else 0,
            "switch_bytes": switch_bytes,
            "whole_conv_params": whole_params,
            "input_volume": math.prod(input_shape[2:])}


__all__ = ["conv_terms"]
