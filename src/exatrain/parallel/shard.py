"""Sharded data parallelism over the `shard` axis: ZeRO stages 1, 2 and 3, hybrid with `data`.

The `shard` axis splits the batch like `data` does, and in addition splits the training state
(Rajbhandari et al., "ZeRO", SC'20). With Ψ fp32 parameters, AdamW and N = shard degree, each
rank holds (bytes, `observe.memory_meters.zero_state_formula`):

  stage   parameters   gradients   optimizer state   total           built on
  0       4Ψ           4Ψ          8Ψ                16Ψ             DDP (parallel.data)
  1       4Ψ           4Ψ          8Ψ/N              8Ψ + 8Ψ/N       ZeroDataParallel (zero.py)  
  2       4Ψ           4Ψ/N        8Ψ/N              4Ψ + 12Ψ/N      ZeroDataParallel (zero.py)  
  3       4Ψ/N         4Ψ/N        8Ψ/N              16Ψ/N           FSDP2 fully_shard per block

Hybrid sharding (Plan data=D × shard=N): state is sharded within each group of N `shard` ranks
and replicated over the D groups; gradients are reduced within the group, then all-reduced across
`data`. Batches are split over all D·N ranks, so the gradient is the mean over D·N.

Ownership, the same for every stage: each parameter is split along dim 0 into N chunks of
ceil(rows/N) rows (torch.chunk's rule, which is FSDP2's and DTensor `Shard(0)`'s); shard rank r
owns chunk r of every parameter and steps only its optimizer state. A checkpoint therefore
stores every stage's optimizer state the same way, as `Shard(0)` DTensors keyed by parameter
name (see `zero_optimizer_state_dict`), and resumes under any stage or Plan.

Communication per optimizer step, per rank (ledger payload conventions, `comm.ledger`;
Ψ_N = Ψ padded to whole chunks):

  stage 1   all-reduce of all gradients over data+shard       4Ψ     tag grad
            all-gather of updated parameters over shard       4Ψ_N   tag param
  stage 2   reduce-scatter of gradients over shard            4Ψ_N   tag grad
            all-reduce of the shard's gradients over data     4Ψ_N/N tag grad (D > 1)
            all-gather of updated parameters over shard       4Ψ_N   tag param
  stage 3   FSDP2: per block all-gather in forward and again in backward (2 × 4Ψ_N), reduce-scatter
            of gradients (4Ψ_N); with D > 1 an all-reduce of each reduced shard over data

Stage 1 could reduce-scatter (as the paper counts it); it all-reduces because it keeps the full
gradients anyway, which lets the gradients stay in place as views of the reduced buffer.

Stages 1 and 2: `ZeroDataParallel` in `parallel.zero` (buckets filled in backward's order, each
bucket's collective overlapping the rest of backward; the all-gather after the optimizer step).

Stage 3 (`_fully_shard`): FSDP2 `fully_shard` on each block (`parallel.blocks.find_blocks`) and
on the root, over the 1-D `shard` mesh. A block holding a weight the forward reads outside it
(parallel/reads.py: a decoder using the encoder's weight) is left to the root's unit, which is
gathered for the whole forward. Its collectives go through `comm.fsdp` (counted in the
ledger); with data > 1 the reduced gradient shards are all-reduced over `data` through
`comm.all_reduce` in FSDP2's all-reduce hook. Under bf16/fp16, FSDP2 gathers parameters in the
compute dtype and reduces gradients in fp32; norm layers are separate FSDP2 units that keep fp32.

Offload (`parallel.offload`): stage 3 uses FSDP2's `CPUOffloadPolicy` (sharded parameters,
gradients and optimizer state on the host, optimizer step on the CPU; `pin_memory` only with
CUDA); stages 1 and 2 keep their chunks' optimizer step on the host (`parallel.zero`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import all_reduce
from ..mesh import Mesh
from .blocks import find_blocks
from .options import zero_stage_refusal
from .zero import (ZeroDataParallel, clean_fqn, zero_load_optimizer_state_dict,
                   zero_optimizer_state_dict, zero_units)
from ..errors import ConfigError, ParallelizeError


# ---------------------------------------------------------------------- stage 3: FSDP2
def _fully_shard(model: nn.Module, mesh: Mesh, options, partial_axes=()) -> nn.Module:
    from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                        OffloadPolicy, fully_shard)

    from ..comm.fsdp import LedgerAllGather, LedgerReduceScatter
    from .precision import compute_dtype, is_norm
    from .reads import read_outside_of

    shard_axis, data_axis = mesh.axis("shard"), mesh.axis("data", *partial_axes)
    shard_mesh = mesh.device_mesh["shard"]
    metadata = _exatrain_metadata(model)
    dtype = compute_dtype(options.precision)
    mixed = dtype != torch.float32
    # gradients reduced in float32 under a mixed precision or for weights stored narrower,
    # else in the weights' own dtype (a float64 model's stay float64, as one process's are)
    narrow = any(p.is_floating_point() and torch.finfo(p.dtype).bits < 32
                 for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=dtype if mixed else None,
                              reduce_dtype=torch.float32 if mixed or narrow else None)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    offload = (CPUOffloadPolicy(pin_memory=mesh.device.type == "cuda") if options.offload
               else OffloadPolicy())
    # under pipe each micro-batch's forward would gather the stage's parameters again (m times
    # the traffic); they stay gathered from forward to backward, as torchtitan does for PP
    kwargs = dict(mesh=shard_mesh, offload_policy=offload,
                  reshard_after_forward=mesh.plan.pipe == 1)

    paths = {id(m): clean_fqn(name) for name, m in model.named_modules()}

    def norms_of(module: nn.Module, exclude: set) -> list[nn.Module]:
        return [m for m in module.modules() if is_norm(m) and id(m) not in exclude
                and any(p.requires_grad for p in m.parameters(recurse=False))
                and not read_outside_of(paths[id(m)], m.parameters(recurse=False))]

    sharded: set = set()
    for _parent, _name, block in find_blocks(model):
        if read_outside_of(paths[id(block)], block.parameters()):
            continue   # gathered only while the block runs; the forward reads it elsewhere too
        if mixed:  # norm layers: their own units, kept in fp32
            norms = norms_of(block, sharded)
            if norms:
                fully_shard(norms, mp_policy=fp32, **kwargs)
                sharded.update(id(m) for m in norms)
        # complex weights (a Fourier layer's) are gathered and reduced in their own dtype
        fully_shard(block, mp_policy=MixedPrecisionPolicy() if _all_complex(block) else mp,
                    **kwargs)
        sharded.update(id(m) for m in block.modules())
    if mixed:
        norms = norms_of(model, sharded)
        if norms:
            fully_shard(norms, mp_policy=fp32, **kwargs)
    rest = [p for m in model.modules() if id(m) not in sharded
            for p in m.parameters(recurse=False)]
    _refuse_mixed_complex("the model's parameters outside its blocks", rest)
    fully_shard(model, mp_policy=MixedPrecisionPolicy() if rest and all(
        p.is_complex() for p in rest) else mp, **kwargs)

    def sum_over_data(reduced: torch.Tensor) -> None:  # hybrid: sum the shard's gradients
        all_reduce(reduced, data_axis, tag="grad")      # over data (and the partial axes: space)
    hook = sum_over_data if data_axis.size > 1 else None
    for module in model.modules():
        if isinstance(module, FSDPModule):  # grouped units share a state: setting twice is harmless
            module.set_custom_all_gather(LedgerAllGather(shard_axis))
            module.set_custom_reduce_scatter(LedgerReduceScatter(shard_axis))
            # sum-only collectives (gloo has no AVG), mean over all data × shard replicas
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(float(mesh.plan.shard * mesh.plan.data))
            if hook is not None:
                module.set_all_reduce_hook(hook)
    _restore_metadata(model, metadata)
    return model


def _all_complex(block: nn.Module) -> bool:
    """Whether a block's weights are complex, all of them (refused when only some are: FSDP2
    reduces a unit's gradients in one flat buffer of one dtype)."""
    params = list(block.parameters())
    _refuse_mixed_complex(f"block {type(block).__name__}", params)
    return bool(params) and all(p.is_complex() for p in params)


def _refuse_mixed_complex(where: str, params: list) -> None:
    kinds = {p.is_complex() for p in params}
    if len(kinds) > 1:
        raise ParallelizeError(
            f"shard: {where} mix complex and real weights, which FSDP2 cannot reduce in one "
            f"buffer. Keep the complex weights in modules of their own (a Fourier layer holding "
            f"only its spectral weights), store them as real tensors with a last dim of 2 "
            f"(torch.view_as_complex(self.w) in forward), or use data parallelism (plan.data).")


def _exatrain_metadata(model: nn.Module) -> dict[str, dict]:
    """Each parameter's exatrain_* attributes (a tensor-parallel layout, norm axes) by name."""
    return {name: {k: v for k, v in vars(p).items() if k.startswith("exatrain_")}
            for name, p in model.named_parameters()}


def _restore_metadata(model: nn.Module, metadata: dict[str, dict]) -> None:
    """Put them back on the DTensor parameters fully_shard made: the tensor-parallel state dict
    and the gradient norm still need to know over which tensor axes a weight is split."""
    for name, p in model.named_parameters():
        for key, value in metadata.get(name, {}).items():
            setattr(p, key, value)


def _refuse_per_parameter_sums(model: nn.Module, mesh: Mesh) -> None:
    """ZeRO buckets reduce all gradients over the same axes; a parameter whose gradient must in
    addition be summed over its own axes (3D whole parameters over tensor_z, sequence-parallel
    norms over tensor) cannot be expressed; name it and what works."""
    for name, p in model.named_parameters():
        axes = tuple(getattr(p, "exatrain_grad_sum_axes", ()))
        if any(mesh.axis(a).size > 1 for a in axes):
            raise ParallelizeError(
                f"{mesh.plan}: parameter {clean_fqn(name)!r} needs its gradient summed over "
                f"{axes} (sequence parallelism or 3D tensor_z), which sharding does not do. "
                "Set parallel.sequence_parallel=false, or use shard=1.")


def parallelize_shard(model: nn.Module, mesh: Mesh, options, partial_axes=()) -> nn.Module:
    """Shard `model`'s training state over `shard` (× replicate over `data`): ZeRO-1, 2 or 3.

    `model` may already be laid out by tensor (1D) or space: each rank shards what it holds.
    `partial_axes` (space) are summed over together with the data replicas.
    """
    stage = options.zero_stage
    _refuse_per_parameter_sums(model, mesh)
    refusal = zero_stage_refusal(mesh.plan, stage, getattr(options, "pipe_schedule", "1f1b"))
    if refusal:
        raise ParallelizeError(refusal)
    if stage == 3:
        return _fully_shard(model, mesh, options, partial_axes)
    if stage not in (1, 2):
        raise ConfigError(f"parallel.zero_stage={stage} must be 1, 2 or 3 with plan.shard > 1.")
    if options.precision != "fp32":
        from .precision import keep_norms_fp32
        keep_norms_fp32(model)
    return ZeroDataParallel(model, mesh, stage, offload=options.offload,
                            bucket_cap_mb=options.bucket_cap_mb, partial_axes=partial_axes)


__all__ = ["ZeroDataParallel", "clean_fqn", "parallelize_shard",
           "zero_load_optimizer_state_dict", "zero_optimizer_state_dict", "zero_units"]
