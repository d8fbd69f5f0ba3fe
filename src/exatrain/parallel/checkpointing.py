"""Activation checkpointing, one block at a time, for any model (what a block is:
`parallel.blocks`; the parallelize step that applies it, with compile:
`parallel.compile.apply_checkpointing_and_compile`).

Activation checkpointing (`parallel.activation_checkpointing`):

  full        each block keeps only its input during forward and recomputes everything inside
              it during backward: activation memory ≈ one block input per block plus one block's
              internals, for one extra forward pass of compute.
  selective   op-level selective checkpointing: inside each block the outputs of matrix
              multiplies, convolutions and attention are saved, everything else (norms,
              activations, dropout masks, reshapes) is recomputed: most of the memory of `full`
              is saved at a small fraction of its recompute cost.

Both use PyTorch's non-reentrant checkpoint and preserve the RNG state, so dropout draws the same
masks when a block is recomputed: in fp32 a checkpointed model trains bit-identically to an
unchecked one, and BatchNorm running statistics are updated once per forward, not again when
recomputed (`KeepRunningStats`). Blocks are wrapped with PyTorch's `checkpoint_wrapper`, whose
`_checkpoint_wrapped_module` level is left out of state-dict keys (by the wrapper's own
state-dict hooks and by `torch.distributed.checkpoint`), so checkpoints stay loadable with
checkpointing on or off.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..errors import ConfigError

# Ops whose outputs selective checkpointing keeps: the expensive ones to recompute.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
for _name in ("_scaled_dot_product_cudnn_attention",):
    if hasattr(torch.ops.aten, _name):
        _SAVE_OPS.add(getattr(torch.ops.aten, _name).default)


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    if op in _SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class KeepRunningStats:
    """While a block is recomputed in backward, its BatchNorm running statistics stay as the
    forward left them: the recomputation would otherwise count every batch twice (torch's
    checkpoint does nothing about it), and evaluation would differ from an unchecked model's.
    Covers every module with BatchNorm's buffers (torch's, GlobalBatchNorm, SpatialBatchNorm)."""

    def __init__(self, norms: list[nn.Module]):
        self.norms = norms
        self.saved: list[tuple[torch.Tensor, ...]] = []

    def __enter__(self):
        self.saved = [tuple(getattr(m, n).clone() for n in _RUNNING) for m in self.norms]

    def __exit__(self, *exc):
        with torch.no_grad():
            for m, values in zip(self.norms, self.saved):
                for name, value in zip(_RUNNING, values):
                    getattr(m, name).copy_(value)
        self.saved = []


_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def _running_stat_modules(block: nn.Module) -> list[nn.Module]:
    return [m for m in block.modules()
            if all(isinstance(getattr(m, n, None), torch.Tensor) for n in _RUNNING)]


def _contexts(selective: bool, norms: list[nn.Module]):
    """`context_fn` for torch's checkpoint: (forward context, recomputation context); the latter
    keeps the running statistics of `norms`."""
    def make():
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        forward, recompute = (create_selective_checkpoint_contexts(_selective_policy) if selective
                              else (contextlib.nullcontext(), contextlib.nullcontext()))
        if not norms:
            return forward, recompute
        return forward, _both(recompute, KeepRunningStats(norms))
    return make


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def checkpoint_block(block: nn.Module, mode: str, keep_running_stats: bool = True) -> nn.Module:
    """`block` wrapped so its activations are recomputed in backward (`mode`: full | selective).

    `keep_running_stats=False` where the block is compiled too: under torch.compile the
    checkpoint's contexts must be TorchDispatchModes, which `KeepRunningStats` is not, so there
    BatchNorm's running statistics are updated again by the recomputation (torch's behaviour)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, checkpoint_wrapper)
    if mode not in ("full", "selective"):
        raise ConfigError(
            f"parallel.activation_checkpointing={mode!r}: use none, full or selective.")
    kwargs = {}
    norms = _running_stat_modules(block) if keep_running_stats else []
    if mode == "selective" or norms:
        kwargs["context_fn"] = _contexts(mode == "selective", norms)
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                              preserve_rng_state=True, **kwargs)


__all__ = ["KeepRunningStats", "checkpoint_block"]
