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
    compile: bool = False           # torch.compile each block
    sequence_parallel: bool = False  # 1D tensor parallelism: split norms/dropout over the sequence
    bucket_cap_mb: float = 25.0     # gradient all-reduce bucket size
    # with plan.pipe > 1 (see parallel/pipe): schedule, micro-batches per replica batch (0 = two per
    # stage), stages per rank of the looped schedules, split override (layer indices where stages
    # 1.. begin; [] = balanced), balance by "params" or measured "time"
    pipe_schedule: str = "1f1b"     # gpipe | 1f1b | interleaved | zero_bubble
    microbatches: int = 0
    pipe_virtual_stages: int = 2
    pipe_split: list[int] = field(default_factory=list)
    pipe_balance: str = "params"
    graph_balance: bool = True      # 3D GCN: random row/column permutations of the adjacency
