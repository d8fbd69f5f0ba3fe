"""FSDP2's collectives, routed through exatrain's ledger.

FSDP2 (`torch.distributed.fsdp.fully_shard`) issues its own all-gathers and reduce-scatters. It
lets a caller replace both with objects implementing its `AllGather` / `ReduceScatter` interfaces
(`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`); the classes below are those
objects. They run the very collective FSDP2 would have run, on the process group FSDP2 passes
(its `shard` mesh dimension), and record it in the ledger under the named axis first. The
gradient all-reduce over `data` of hybrid sharding is a plain `comm.all_reduce` on the reduced
shard, called from FSDP2's `set_all_reduce_hook` (see `parallel.shard`).

So every byte FSDP2 moves is counted as it is sent, not derived afterwards. Payload per call,
with the ledger's conventions (padded to a multiple of the shard degree N, as FSDP2 pads dim 0):

  all_gather       bytes of the unsharded (gathered) parameters of one FSDP unit, in the
                   all-gather dtype (fp32, or bf16/fp16 under a mixed-precision policy)
  reduce_scatter   bytes of the unsharded gradients of one FSDP unit, in the reduce dtype (fp32)

Per step with ZeRO-3 (Ψ parameters): ≈4Ψ all-gathered in forward, ≈4Ψ again in backward (for
units resharded after forward; the root unit keeps its parameters), and 4Ψ reduce-scattered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# FSDP2's interfaces for custom collectives (torch >= 2.8; this package needs >= 2.13)
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from .collectives import Axis, nbytes
from .collectives import all_gather_single as _all_gather
from .collectives import reduce_scatter_single as _reduce_scatter
from .timing import comm_range, timed


class LedgerAllGather(AllGather):
    """FSDP2's parameter all-gather over `axis`, recorded with tag "param"."""

    def __init__(self, axis: Axis, tag: str = "param"):
        self.axis, self.tag = axis, tag

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False):
        self.axis.ledger.record(self.axis.name, "all_gather", nbytes(output_tensor), self.tag)
        with comm_range(self.axis.ledger, self.axis.name, "all_gather", self.tag):
            work = _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        return timed(work, self.axis.ledger, self.axis.name, "all_gather", self.tag)


class LedgerReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter over `axis`, recorded with tag "grad"."""

    def __init__(self, axis: Axis, tag: str = "grad"):
        self.axis, self.tag = axis, tag

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op=dist.ReduceOp.SUM, async_op: bool = False):
        self.axis.ledger.record(self.axis.name, "reduce_scatter", nbytes(input_tensor), self.tag)
        with comm_range(self.axis.ledger, self.axis.name, "reduce_scatter", self.tag):
            work = _reduce_scatter(output_tensor, input_tensor, op=op, group=group,
                                   async_op=async_op)
        return timed(work, self.axis.ledger, self.axis.name, "reduce_scatter", self.tag)
