"""ParallelOptions: how strategies are applied beyond the Plan's degrees (the config's [parallel]).

It lives with the strategies that read it, so they need not import the training config.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ParallelOptions:
    """How strategies are applied beyond the Plan's degrees (see exatrain.parallel.apply)."""
    zero_stage: int = 3             # with plan.shard > 1: 1, 2 or 3 (3 = FSDP)
    offload: bool = False           # CPU offload of sharded parameters and optimizer state
    precision: str = "fp32"         # fp32 | bf16 | fp16 (fp32 master weights and reductions)
    activation_checkpointing: str = "none"  # none | full | selective
    compile: bool = False           # torch.compile the model (see parallel/memory.py)
    compile_backend: str = "inductor"  # torch.compile's backend (eager, aot_eager: debugging)
    compile_scope: str = "auto"     # model | blocks | auto: the whole model (stage) as one frame,
                                    # or each block; auto = blocks under FSDP2 (its hooks sit on
                                    # blocks) and for 4+ repeated blocks (transformers), else model
    channels_last: str = "auto"     # auto | on | off: convolutional models channels-last, weights
                                    # and inputs (auto: with 2D/3D convolutions; parallel/layout.py)
    cudnn_benchmark: bool = True    # GPU: let cuDNN time its convolution algorithms for each new
                                    # shape during fit (static shapes repay it; restored after)
    sequence_parallel: bool = False  # 1D tensor parallelism: split norms/dropout over the sequence
    bucket_cap_mb: float = 25.0     # gradient all-reduce bucket size
    # under `data`: search the autograd graph each step for parameters the forward left out
    # (needed when a model skips some parameters in some steps; costs a graph traversal per step)
    find_unused_parameters: bool = False
    # BatchNorm statistics over the whole batch of every replica ("global": the serial result, one
    # small all-gather per layer) or per replica ("replica": DDP's default; see parallel/batchnorm)
    batchnorm: str = "global"
    # with plan.pipe > 1 (see parallel/pipe): schedule, micro-batches per replica batch (0 = two per
    # stage), stages per rank of the looped schedules, split override (layer indices where stages
    # 1.. begin; [] = balanced), balance by "params" or measured "time"
    pipe_schedule: str = "1f1b"     # gpipe | 1f1b | interleaved | zero_bubble
    microbatches: int = 0
    pipe_virtual_stages: int = 2
    pipe_split: list[int] = field(default_factory=list)
    pipe_balance: str = "params"
    # et.Branches containers: "none" (run serially on every rank) or "data" (each branch on its
    # own ranks of the data axis, combined by one reduce-scatter; see parallel/branches)
    branches: str = "none"
    # channel/filter parallelism of convolutions under 1D tensor (parallel/tensor/cnn.py): the
    # module name of the first convolution split over `tensor` (earlier ones stay whole, or run
    # split over `space` under Plan(space=..., tensor=...)); "" = automatic (parallel/tensor/switch.py).
    # chanfilt_skip: convolutions kept whole by name.
    chanfilt_from: str = ""
    chanfilt_skip: list[str] = field(default_factory=list)
    graph_balance: bool = True      # 3D GCN: random row/column permutations of the adjacency


LOOPED_SCHEDULES = ("interleaved", "zero_bubble")  # several stages per rank
BATCHNORM_MODES = ("global", "replica")


def zero_stage_refusal(plan, zero_stage: int, pipe_schedule: str) -> str | None:
    """Why `parallel.zero_stage` cannot run with `plan` and this schedule (with the fix); None
    when it can. The strategies refuse with it at build time, the planner ranks with it."""
    if plan.shard == 1 or zero_stage != 3:
        return None
    if plan.space_degree > 1:
        # layers that run replicated after a spatial gather scale their weight gradients by 1/S
        # with tensor hooks on the parameters (parallel/spatial/convert.py); FSDP2 computes
        # gradients on its own unsharded copies, so those hooks would never run
        return (f"{plan}: parallel.zero_stage=3 (FSDP2) is not implemented with spatial "
                "parallelism. Set parallel.zero_stage=2 (or 1): gradients and optimizer state are "
                "then sharded over `shard` and summed over `space`.")
    if plan.pipe > 1 and pipe_schedule in LOOPED_SCHEDULES:
        # measured: two FSDP2 stages on one rank (looped schedules) train on NaNs in torch 2.13
        return (f"{plan}: parallel.pipe_schedule={pipe_schedule!r} puts several stages on each "
                "rank, which does not work with parallel.zero_stage=3 (FSDP2 stages: NaN losses). "
                "Use zero_stage=2 (or 1) with this schedule, or pipe_schedule='1f1b' or 'gpipe' "
                "with zero_stage=3.")
    return None
