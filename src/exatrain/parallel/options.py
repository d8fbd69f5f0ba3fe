"""ParallelOptions: how strategies are applied beyond the Plan's degrees (the config's [parallel]).

It lives with the strategies that read it, so they need not import the training config.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    graph_balance: bool = True      # 3D GCN: random row/column permutations of the adjacency
