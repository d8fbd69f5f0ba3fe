"""The global gradient norm, and clipping by it, for parameters laid out by any strategy.

Every rank must reach the same norm (and so the same clipping factor and the same verdict on
finiteness), whatever slice of the parameters it holds:

  plain tensors (replicated, e.g. after a data-parallel all-reduce): local squares count as they are
  DTensor gradients (FSDP2, DTensor tensor parallelism): torch's own norm, which reduces over
              the DTensor's mesh, then summed over the parameter's `exatrain_norm_axes` (FSDP2
              over a tensor-parallel layer)
  a parameter sharded by an exatrain strategy carries `exatrain_norm_axes`, a tuple of
              `comm.Axis` over which its gradient is split: its squares are summed over them

Communication: one all-reduce of one float64 scalar per distinct set of `exatrain_norm_axes`.

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
from ..comm.dtensor import is_dtensor


def _by_device_and_dtype(grads) -> dict:
    """Plain gradient tensors grouped by (device, dtype): what one foreach kernel takes."""
    groups: dict = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    return groups


def _norms(grads: list) -> list[torch.Tensor]:
    """The 2-norms of plain gradient tensors, stacked per (device, dtype) group, in float32 or
    wider: one foreach norm per group (a handful of kernels, however many parameters)."""
    out = []
    for (_, dtype), group in _by_device_and_dtype(grads).items():
        if dtype.is_complex:   # complex weights (a Fourier layer's): |z|² = re² + im²
            group = [torch.view_as_real(g) for g in group]
            dtype = group[0].dtype
        # half-precision gradients: norms in float32 (a float16 norm overflows at 65504)
        wide = None if dtype in (torch.float32, torch.float64) else torch.float32
        out.append(torch.stack(torch._foreach_norm(group, 2, dtype=wide)))
    return out


def _sum_of_squares(grads: list, device: torch.device) -> torch.Tensor:
    """Σ‖g‖² of plain gradient tensors, in float64 on `device`; no host read."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for norms in _norms(grads):
        total = total + norms.double().pow(2).sum().to(device)
    return total


def _by_axes(parameters) -> tuple[list, dict, dict]:
    """One pass over the parameters: those with a gradient; DTensor gradients and plain ones,
    each grouped by the names of their `exatrain_norm_axes` as (axes, gradients). The insertion
    order follows the parameters, which every rank lists alike, so the all-reduces match; every
    parameter takes part, with or without a gradient on this rank, so which all-reduces run does
    not depend on what one rank happened to use."""
    params, dtensor, plain = [], {}, {}
    for p in parameters:
        g = p.grad
        if g is not None:
            params.append(p)
        axes = getattr(p, "exatrain_norm_axes", ())
        key = tuple(axis.name for axis in axes) if axes else ()  # an Axis is not hashable
        if is_dtensor(p) or (g is not None and is_dtensor(g)):
            if g is not None:
                dtensor.setdefault(key, (axes, []))[1].append(g)
            continue
        grads = plain.setdefault(key, (axes, []))[1]
        if g is not None:
            grads.append(g)
    return params, dtensor, plain


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float = math.inf, across=None) -> torch.Tensor:
    """Scale gradients so their global 2-norm is at most `max_norm`; return the norm before.

    The norm is a 0-d float64 tensor on the device the collectives use, and clipping multiplies
    by min(1, max_norm / norm) on the device (torch's `clip_grad_norm_` formula): nothing here
    waits for the host. A non-finite norm leaves the gradients non-finite (the caller skips the
    step on it). `across`: an Axis whose members hold disjoint parameters (pipeline stages), or
    None."""
    params, dtensor_groups, by_axes = _by_axes(parameters)
    # collectives need tensors where the backend lives: the GPU under NCCL, even when gradients
    # are offloaded to the CPU
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    if nccl:
        device = torch.device("cuda", torch.cuda.current_device())
    elif not dist.is_initialized() and params:
        device = params[0].grad.device  # one process: where the gradients are
    else:
        device = torch.device("cpu")
    if not dtensor_groups and across is None and list(by_axes) == [()]:
        norms = _norms(by_axes[()][1])
        if len(norms) == 1:  # the usual case: three kernels, nothing to sum or reduce
            return _clip(params, torch.linalg.vector_norm(norms[0], dtype=torch.float64)
                         .to(device), max_norm, device)
    total_sq = torch.zeros((), dtype=torch.float64, device=device)
    # DTensor gradients: torch's norm over the DTensor's mesh, then over the exatrain axes the
    # parameter is split over besides (FSDP2 over a tensor-parallel layer: shard + tensor axes)
    for axes, grads in dtensor_groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if is_dtensor(norm) else norm
        sq = norm.detach().double().to(device) ** 2
        for axis in axes:
            all_reduce(sq, axis, tag="metric")
        total_sq += sq
    for axes, grads in by_axes.values():
        sq = _sum_of_squares(grads, device)
        for axis in axes:
            all_reduce(sq, axis, tag="metric")
        total_sq += sq
    if across is not None:
        all_reduce(total_sq, across, tag="metric")
    return _clip(params, total_sq.sqrt(), max_norm, device)


def decided_locally(parameters, across=None) -> bool:
    """Whether this rank's gradients alone say whether every rank's are finite: each parameter's
    whole gradient is here and, after the data-parallel all-reduce, the same on every rank (no
    `exatrain_norm_axes`, no DTensor, no `across`). Where it holds, `found_nonfinite` can stand
    in for the global norm's verdict; it holds for a run's whole life (the layout is fixed)."""
    return across is None and not any(getattr(p, "exatrain_norm_axes", ()) or is_dtensor(p)
                                      for p in parameters)


@torch.no_grad()
def found_nonfinite(parameters) -> torch.Tensor | None:
    """1.0 (a 0-d float32 tensor where the gradients are) if any gradient holds an inf or a NaN,
    else 0.0; None without gradients. GradScaler's fused check
    (`torch._amp_foreach_non_finite_check_and_unscale_`, here unscaling by one, which leaves
    every value as it was), one call per device and dtype. Local: see `decided_locally`.

    Why not the norm: where nothing needs the norm (no clipping), its finiteness is all the step
    uses, and on a CPU, whose foreach norm runs tensor by tensor, the check costs a fifth as much
    (40 small gradients: 8 against 37 µs; a tiny model's step is ~1 ms). On a GPU the norm is one
    fused kernel that only reads, so the Trainer keeps it there."""
    flags = []
    groups = _by_device_and_dtype(p.grad for p in parameters if p.grad is not None)
    for (device, _), grads in groups.items():
        flag = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, flag, torch.ones((), dtype=torch.float32, device=device))
        flags.append(flag)
    if len(flags) > 1:
        return torch.stack([f.to(flags[0].device) for f in flags]).amax()
    return flags[0] if flags else None


def _clip(params: list, total: torch.Tensor, max_norm: float, device) -> torch.Tensor:
    """Multiply the gradients by min(1, max_norm / total) on the device; return `total`."""
    if math.isfinite(max_norm) and params:
        factor = (max_norm / (total + 1e-6)).clamp(max=1.0)
        plain = (p.grad for p in params if not is_dtensor(p.grad))
        for (gdevice, dtype), group in _by_device_and_dtype(plain).items():
            torch._foreach_mul_(group, factor.to(device=gdevice, dtype=dtype))
        for p in params:
            if is_dtensor(p.grad):
                p.grad.mul_(factor.to(dtype=p.grad.dtype).item())
    return total
