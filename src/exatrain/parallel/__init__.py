"""Parallel strategies: `parallelize` lays a plain module out over the mesh, one strategy per module.

`apply.parallelize` applies the steps in a fixed order per pipeline stage (pipe -> tensor -> space
-> branches -> BatchNorm -> layout -> activation checkpointing -> compile -> shard -> data); each is
a no-op where its axis has size 1.

  apply          parallelize(): the ordered steps, how gradients are reduced for the whole Plan
  options        [parallel]: how strategies are applied beyond the Plan's degrees
  data, gradsync data parallelism: bucketed gradient all-reduce driven by parameter metadata
  shard, zero    the shard axis: ZeRO-3 (FSDP2) and the stage choice; ZeRO-1/2 (ZeroDataParallel)
  tensor/        1D (Megatron) and 3D (AxoNN) tensor parallelism, channel/filter convolutions
  spatial/       spatial parallelism (DistConv): layers with halos over space=(d, h, w)
  pipe/          pipeline stages and schedules
  graph          3D-parallel full-graph GCN (Plexus)
  branches       sub-graph parallelism: the branches of et.Branches side by side
  batchnorm      BatchNorm statistics over every rank that holds part of the batch
  blocks, checkpointing, compile, compile_stats   what a block is; activation checkpointing;
                 torch.compile of the model or its blocks; what compile did
  layout         channels-last end to end
  precision, float8   bf16/fp16 with fp32 master weights and loss scaling; fp8 Linears (torchao)
  reads, replica_buffers   weights a user's forward reads outside their layer; buffers a
                 training forward changes, kept equal over the replicas
  derivatives    a user's forward that differentiates (forces): where it can train
  trial, verify, verify_gradients   forwards that leave no trace; the checks of a user's
                 laid-out model against the plain one before the first step (outputs; gradients)

Imports: comm, mesh, data and models, the foundations; never optim, workloads or anything above.
"""

from .apply import parallelize
from .data import data_parallel, unwrap

__all__ = ["parallelize", "data_parallel", "unwrap"]
