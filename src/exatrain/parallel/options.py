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
    precision: str = "fp32"         # fp32 | bf16 | fp16 | fp8 (fp32 master weights, reductions)
    activation_checkpointing: str = "none"  # none | full | selective
    compile: bool = False           # torch.compile the model (see parallel/compile.py)
    compile_backend: str = "inductor"  # torch.compile's backend (eager, aot_eager: debugging)
    cuda_graphs: bool = False       # GPU: replay recorded CUDA graphs, no launch per kernel
    cuda_graphs_scope: str = "compiled"  # compiled: the compiled regions (torch.compile mode
                                    # "reduce-overhead"); step: the whole step, forward, backward,
                                    # clipping and the fused optimizer, one graph (train/step_graph)
    compile_scope: str = "auto"     # model | blocks | auto: the whole model (stage) as one frame,
                                    # or each block; auto = blocks under FSDP2 (its hooks sit on
                                    # blocks) and for 4+ repeated blocks (transformers), else model
    channels_last: str = "auto"     # auto | on | off: convolutional models channels-last, weights
                                    # and inputs (auto: with 2D/3D convolutions; parallel/layout.py)
    cudnn_benchmark: bool = True    # GPU: let cuDNN time its convolution algorithms for each new
                                    # shape during fit (static shapes repay it; restored after)
    sequence_parallel: bool = False  # 1D tensor parallelism: split norms/dropout over the sequence
    # 1D tensor parallelism: chain Linears as column -> row pairs (one all-reduce per pair; the
    # code between them must keep the features where they are), or false: split each Linear on
    # its own, its output gathered (any code between layers; more communication)
    tensor_pairs: bool = True
    bucket_cap_mb: float = 25.0     # gradient all-reduce bucket size
    # under `data`: search the autograd graph each step for parameters the forward left out
    # (needed when a model skips some parameters in some steps; costs a graph traversal per step)
    find_unused_parameters: bool = False
    # BatchNorm statistics over the whole batch of every replica ("global": the serial result, one
    # small all-gather per layer) or per replica ("replica": DDP's default; see parallel/batchnorm)
    batchnorm: str = "global"
    # a user's model under space or tensor (not pipe): before the first step, check that the
    # laid-out model computes what the plain model does on the first training sample (its
    # outputs; under space its gradients too), and stop naming where it differs (costs a
    # forward, and under space a backward, of one sample; parallel/verify.py)
    check_plain: bool = True
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


def graph_scope(options) -> str | None:
    """What `parallel.cuda_graphs` records: "compiled" (the compiled regions), "step" (the
    whole step, train/step_graph.py), or None (off)."""
    if not getattr(options, "cuda_graphs", False):
        return None
    return getattr(options, "cuda_graphs_scope", "compiled")


def cuda_graphs_refusal(plan, options, device_type: str, optimizer: str = "") -> str | None:
    """Why `parallel.cuda_graphs` cannot run here (with the fix); None when it can or is off.

    A CUDA graph replays the kernels it recorded on the memory it recorded them with: it needs a
    GPU, code that torch.compile captured, and nothing outside the graph that launches work of
    its own in the middle of a region or keeps a region's outputs past the next replay. Refused:
    a CPU; compile off; pipeline schedules (stages exchange activations with point-to-point
    sends between regions, micro-batch after micro-batch); FSDP2 (its hooks gather and free
    weights around every block); K-FAC (its hooks keep every layer's inputs and output
    gradients for the step's preconditioner, which the next replay overwrites).

    `cuda_graphs_scope = "step"` records the whole step (train/step_graph.py), compiled or not,
    on one rank: a plan of several ranks is refused (their gradient collectives run between
    the graphs of the compiled scope instead), and so is activation checkpointing (each
    checkpointed block reads the random state on the host, which a recording refuses)."""
    if graph_scope(options) is None:
        return None
    fix = "Set parallel.cuda_graphs=false"
    if device_type != "cuda":
        return (f"parallel.cuda_graphs needs a GPU; this run's device is {device_type!r}, where "
                f"there is no graph to replay. {fix} (parallel.compile alone works here).")
    if graph_scope(options) == "step":
        if plan.world_size > 1:
            return (f"{plan}: parallel.cuda_graphs_scope='step' records the whole step on one "
                    f"rank; this plan's {plan.world_size} ranks exchange gradients inside it. "
                    "Set parallel.cuda_graphs_scope='compiled' (graphs of the compiled regions, "
                    f"any data-parallel plan), or {fix.lower()[0]}{fix[1:]}.")
        if getattr(options, "activation_checkpointing", "none") != "none":
            # a checkpointed block keeps the random state for its recomputation: it reads the
            # CUDA generator's seed on the host, which a recording refuses
            return (f"parallel.cuda_graphs_scope='step' does not record activation checkpointing "
                    f"(parallel.activation_checkpointing={options.activation_checkpointing!r} "
                    "reads the random state on the host in every block). Set "
                    "parallel.activation_checkpointing='none', or parallel.cuda_graphs_scope="
                    f"'compiled', or {fix.lower()[0]}{fix[1:]}.")
    elif not options.compile:
        return ("parallel.cuda_graphs replays compiled code: set parallel.compile=true as well, "
                f"or {fix.lower()[0]}{fix[1:]}.")
    elif plan.pipe > 1:
        return (f"{plan}: parallel.cuda_graphs does not run pipeline schedules (stages exchange "
                f"activations between the graphs, micro-batch after micro-batch). {fix}, or set "
                "plan.pipe=1.")
    elif plan.shard > 1 and options.zero_stage == 3:
        return (f"{plan}: parallel.cuda_graphs does not run under FSDP2 (zero_stage=3: its hooks "
                f"gather and free the weights around every block). {fix}, or use "
                "parallel.zero_stage=2 (or 1).")
    if optimizer == "kfac":
        return ("parallel.cuda_graphs does not run with optim.name='kfac' (its hooks keep each "
                f"layer's inputs, which the next replay overwrites). {fix}, or use adamw or sgd.")
    return None


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
