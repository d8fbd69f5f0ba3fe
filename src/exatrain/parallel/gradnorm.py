"""The global gradient norm, and clipping by it, for parameters laid out by any strategy.

Every rank must reach the same norm (and so the same clipping factor and the same verdict on
finiteness), whatever slice of the parameters it holds:

  plain tensors (replicated, e.g. after a data-parallel all-reduce): local squares count as they are
  DTensor gradients (FSDP2, DTensor tensor parallelism): torch's own norm, which reduces over
              the DTensor's mesh, then summed over the parameter's `exatrain_norm_axes` (FSDP2
              over a tensor-parallel layer)
  a parameter sharded by an exatrain strategy carries `exatrain_norm_axes`, a tuple of
              `comm.Axis` over which its gradient is split: its squares are summed over them

Communication: one all-reduce of one fp32 scalar per distinct set of `exatrain_norm_axes`.

`across` (pipeline parallelism: the `pipe` axis) sums the squares once more, over ranks that hold
different parameters. It is not a per-parameter axis because ranks of different stages hold
different sets of `exatrain_norm_axes` (a stage of embeddings has no tensor-split weights), so
their per-set all-reduces would not match; within a stage every rank lists the same sets.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..comm import all_reduce


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def clip_grad_norm_(parameters, max_norm: float = math.inf, across=None) -> float:
    """Scale gradients so their global 2-norm is at most `max_norm`; return the norm before.

    `across`: an Axis whose members hold disjoint parameters (pipeline stages), or None."""
    # Every parameter takes part, with or without a gradient on this rank: which all-reduces run
    # must not depend on what one rank happened to use, or the ranks would stop matching.
    everything = list(parameters)
    params = [p for p in everything if p.grad is not None]
    dtensor = [p for p in params if _is_dtensor(p.grad)]
    # collectives need tensors where the backend lives: the GPU under NCCL, even when gradients
    # are offloaded to the CPU
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float64, device=device)
    # DTensor gradients grouped by the exatrain axes their parameter is split over besides the
    # DTensor's own mesh (FSDP2 over a tensor-parallel layer: shard mesh + tensor axes)
    dtensor_groups: dict[tuple[str, ...], tuple[tuple, list]] = {}
    for p in dtensor:
        axes = tuple(getattr(p, "exatrain_norm_axes", ()))
        key = tuple(axis.name for axis in axes)
        dtensor_groups.setdefault(key, (axes, []))[1].append(p.grad)
    for axes, grads in dtensor_groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if _is_dtensor(norm) else norm
        sq = norm.detach().double().to(device) ** 2
        for axis in axes:
            all_reduce(sq, axis, tag="metric")
        total_sq += sq
    # keyed by axis names (an Axis holds its group and ledger and is not hashable); the insertion
    # order follows the parameters, which every rank lists alike, so the all-reduces match
    by_axes: dict[tuple[str, ...], tuple[tuple, torch.Tensor]] = {}
    for p in everything:
        if _is_dtensor(p) or (p.grad is not None and _is_dtensor(p.grad)):
            continue
        axes = tuple(getattr(p, "exatrain_norm_axes", ()))
        key = tuple(axis.name for axis in axes)
        sq = (p.grad.detach().double().pow(2).sum().to(device) if p.grad is not None
              else torch.zeros((), dtype=torch.float64, device=device))
        if key in by_axes:
            by_axes[key] = (axes, by_axes[key][1] + sq)
        else:
            by_axes[key] = (axes, sq)
    for axes, sq in by_axes.values():
        for axis in axes:
            all_reduce(sq, axis, tag="metric")
        total_sq += sq
    if across is not None:
        all_reduce(total_sq, across, tag="metric")
    total = float(total_sq.sqrt())
    if math.isfinite(total) and total > max_norm:
        factor = max_norm / (total + 1e-6)
        for p in params:
            p.grad.mul_(factor)
    return total
