"""Activation checkpointing and torch.compile, one block at a time, for any model.

`apply_checkpointing_and_compile(model, options)` runs in `parallelize` after the layer-splitting
strategies (tensor, space) and before sharding and data replication, torchtitan's order: the
checkpoint wrapper and the compiled code then see the final layers, and FSDP2 shards the wrapped
blocks.

What a block is, without knowing the model (`find_blocks`):

  * every child of every outermost `nn.ModuleList` (a transformer's `blocks`, a U-Net's branches);
  * in a model without a `ModuleList`, each direct child of the root that holds parameters
    (e.g. CosmoFlow's `features` and `head`).

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

Compile (`parallel.compile = true`) compiles in place (`compile_in_place`: the module's forward),
so the module tree and its parameter names do not change, one of two ways
(`parallel.compile_scope`):

  model   the whole model (or pipeline stage) as one frame: every layer, whatever the model's
          structure, runs in compiled code, and the fusions span layers (the default for models
          without repeated blocks: CNNs such as CosmoFlow's and DeepCAM's). Collectives
          inside (global BatchNorm, halo exchanges, tensor-parallel layers) break the graph
          there; the breaks are counted and reported
          (`parallel.compile_stats`), never silent.
  blocks  each block: blocks of equal shape reuse one compiled graph (parameters are graph
          inputs), and the hooks FSDP2 later puts on a block are skipped by the compiler and run
          eagerly (ZeRO-3 with compiled blocks matched serial training to 1e-7 on 2 CPU ranks,
          checked by hand). What lies outside every block (a model without a ModuleList keeps
          only its children with parameters as blocks) stays eager. The default under FSDP2,
          and for models built of 4 or more repeated blocks (transformers): the compile time
          is that of one block, not of the whole depth (a 24-layer GPT compiled whole took 27 s
          before its first step on a 2-core CPU, block by block 4.5 s; on an H100 the whole
          1.3b model did not reach its first step in two minutes).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..errors import ConfigError, ParallelizeError

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


def find_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, block) for every block of `model`, in registration order (see above)."""
    found: list[tuple[nn.Module, str, nn.Module]] = []

    def visit(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.ModuleList):
                found.extend((child, n, c) for n, c in child.named_children())
            else:
                visit(child)

    visit(model)
    if not found:
        found = [(model, n, c) for n, c in model.named_children()
                 if any(True for _ in c.parameters())]
    return found


REGIONAL_MIN_BLOCKS = 4  # repeats of one block from which `auto` compiles block by block


def auto_compile_scope(model: nn.Module, fsdp: bool) -> str:
    """`parallel.compile_scope = "auto"`: "blocks" under FSDP2 (its hooks sit on blocks, which
    compile must leave outside) or where some ModuleList repeats one block (same class, same
    parameter shapes) at least `REGIONAL_MIN_BLOCKS` times, else "model". A whole model's
    compile time grows with its depth, one block's does not; a shallow model compiles whole in
    seconds and its step is faster in one graph (a 2-block GPT on a 2-core CPU: 1.45 ms a
    step compiled whole, 2.15 ms block by block, whose embeddings and head run eager)."""
    if fsdp:
        return "blocks"

    def signature(block: nn.Module):
        return type(block), tuple((n, tuple(p.shape)) for n, p in block.named_parameters())

    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= REGIONAL_MIN_BLOCKS:
            if len({signature(block) for block in module}) == 1:
                return "blocks"
    return "model"


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


def apply_checkpointing_and_compile(model: nn.Module, options, whole_model: bool = False
                                    ) -> nn.Module:
    """Checkpoint every block of `model` and compile each block, or (`whole_model`) the model
    once, in place; returns `model`."""
    blocks = find_blocks(model)
    # a model without blocks can still be compiled whole, with nothing to checkpoint
    if not blocks and not (whole_model and options.activation_checkpointing == "none"):
        raise ParallelizeError(
            f"{type(model).__name__} has no blocks to checkpoint or compile: it has neither an "
            "nn.ModuleList nor children with parameters. Set parallel.activation_checkpointing="
            "'none' and parallel.compile=false, or group its layers into an nn.ModuleList.")
    if options.precision != "fp32":
        # norms must carry their fp32 input cast into the compiled graphs
        from .precision import keep_norms_fp32
        keep_norms_fp32(model)
    mode = options.activation_checkpointing
    graphs = getattr(options, "cuda_graphs", False)
    for parent, name, block in blocks:
        if mode != "none":
            block = checkpoint_block(block, mode, keep_running_stats=not options.compile)
            parent.register_module(name, block)
        if options.compile and not whole_model:
            compile_in_place(block, options.compile_backend, graphs)
    if options.compile and whole_model:
        compile_in_place(model, options.compile_backend, graphs)
    return model


def compile_in_place(module: nn.Module, backend: str, cuda_graphs: bool = False) -> nn.Module:
    """`module`'s forward as compiled code; the module, its hooks and its state-dict keys stay.
    `cuda_graphs`: torch.compile's "reduce-overhead" mode, whose compiled code records CUDA
    graphs and replays them (cudagraph trees; the step marks each new iteration, see Trainer).

    Not `nn.Module.compile()`: that compiles `Module._call_impl`, a frame in Dynamo's skip list,
    so a module of torch's own classes (`nn.Sequential`, say) ran eager, silently. The forward
    of the instance is what Dynamo traces here, whatever class it belongs to."""
    mode = "reduce-overhead" if cuda_graphs else None
    module.forward = torch.compile(module.forward, backend=backend, mode=mode)
    return module


__all__ = ["apply_checkpointing_and_compile", "auto_compile_scope", "checkpoint_block",
           "compile_in_place", "find_blocks"]
