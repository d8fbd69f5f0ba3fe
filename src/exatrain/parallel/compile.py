"""torch.compile of a model or of its blocks, and the parallelize step of checkpointing and compile.

`apply_checkpointing_and_compile(model, options)` runs in `parallelize` after the layer-splitting
strategies (tensor, space) and before sharding and data replication, torchtitan's order: the
checkpoint wrapper and the compiled code then see the final layers, and FSDP2 shards the wrapped
blocks.

Checkpointing itself is `parallel.checkpointing`; what a block is, `parallel.blocks`.

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

import torch
from torch import nn

from ..errors import ParallelizeError
from .blocks import find_blocks
from .checkpointing import checkpoint_block
from .options import graph_scope

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
    # (the whole step's graph records compiled code as it is: no graphs of its own inside)
    graphs = graph_scope(options) == "compiled"
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


__all__ = ["apply_checkpointing_and_compile", "auto_compile_scope", "compile_in_place"]
