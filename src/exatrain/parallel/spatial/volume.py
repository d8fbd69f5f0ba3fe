"""The halo volume a spatially split model must move: the formula `exatrain bench spatial` checks
the ledger against, and the planner costs spatial Plans with.

For every convolution and pooling layer and every rank of the `space` grid, the input elements
its outputs read that it neither owns nor gets as zero padding (from the layer geometry alone),
forward, and again backward where the layer's input needs a gradient (all but the first layer);
layers whose output does not divide over the grid run on gathered tensors and move no halo.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def analytic_halo_bytes(model: nn.Module, input_shape: tuple, space: tuple, elem: int = 4) -> int:
    """Halo bytes one training step must move at least, summed over ranks (see module doc)."""
    return halo_bytes_of_layers(layer_geometry(model, input_shape), space, elem)


def layer_geometry(model: nn.Module, input_shape: tuple) -> list:
    """(layer, input shape, output shape) of every convolution and pooling layer, in order of
    execution, from one forward pass on the meta device."""
    records = []
    meta = copy.deepcopy(model).to("meta")
    hooks = [m.register_forward_hook(lambda m, i, o: records.append((m, i[0].shape, o.shape)))
             for m in meta.modules() if isinstance(m, (nn.Conv3d, nn.MaxPool3d, nn.AvgPool3d))]
    with torch.no_grad():
        meta(torch.empty(input_shape, device="meta"))
    for h in hooks:
        h.remove()
    return records


def halo_bytes_of_layers(records: list, space: tuple, elem: int = 4) -> int:
    """The module doc's halo bytes for `layer_geometry` records under the split `space`."""
    total = 0
    for index, (layer, shape, out_shape) in enumerate(records):
        def triple(v):
            return tuple(v) if isinstance(v, (tuple, list)) else (v,) * 3
        k, s, p = triple(layer.kernel_size), triple(layer.stride or layer.kernel_size), triple(layer.padding)
        d = triple(getattr(layer, "dilation", 1))
        if any(out_shape[2 + i] % space[i] for i in range(3)):
            continue  # this layer runs on gathered tensors: no halo
        # A rank's needed and owned regions are boxes: products over the dims of per-dim
        # extents. Summed over the grid (the Cartesian product of per-dim coordinates), a sum of
        # products is the product of per-dim sums, so each dim is walked once.
        need_sum = own_sum = 1
        for i in range(3):
            n, parts = shape[2 + i], space[i]
            b, m = n // parts, out_shape[2 + i] // parts
            need_i = own_i = 0
            for c in range(parts):
                lo = c * m * s[i] - p[i]
                hi = ((c + 1) * m - 1) * s[i] - p[i] + d[i] * (k[i] - 1)
                lo, hi = max(lo, 0), min(hi, n - 1)                 # zero padding is not sent
                need_i += hi - lo + 1
                own_i += max(0, min(hi, (c + 1) * b - 1) - max(lo, c * b) + 1)
            need_sum *= need_i
            own_sum *= own_i
        per_sample = need_sum - own_sum
        passes = 1 if index == 0 else 2  # the input of the first layer needs no gradient
        total += passes * per_sample * shape[0] * shape[1] * elem
    return total
