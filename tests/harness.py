"""Run a function on N spawned gloo ranks and compare results with serial runs."""

from __future__ import annotations

import torch

from exatrain.launch import spawn


def run_ranks(world_size: int, fn, *args, timeout_s: float = 300.0) -> list:
    """`fn(*args)` on `world_size` spawned ranks (env:// rendezvous set); results by rank."""
    return spawn(fn, world_size, args=args, timeout_s=timeout_s)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the relative error of `a` against reference `b`."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def max_rel_err_state(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(rel_err(a[k], b[k]) for k in a)
