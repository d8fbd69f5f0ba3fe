"""Communication: collectives over named axes, recorded in a per-mesh ledger.

  collectives   all-reduce, all-gather, reduce-scatter, broadcast, exchange over one axis
  autograd      the same collectives as differentiable autograd Functions
  halo          halo exchange between the spatial blocks of one sample (DistConv)
  fsdp          FSDP2's collectives routed through the ledger
  ledger, busbw, timing   calls and bytes per axis; bus bandwidth; timed, named ranges
  flight        flight records of a hung collective; inject: slowed links for drills
  dtensor       the one test of a DTensor, and a rank's local piece of one

Imports: torch and the foundations (errors, plan) only.
"""

from .collectives import (Axis, all_gather_into, all_gather_object, all_reduce, all_reduce_future, broadcast,
                          broadcast_object,
                          exchange, nbytes, reduce_scatter_into)
from .ledger import Ledger

__all__ = ["Axis", "Ledger", "all_gather_into", "all_gather_object", "all_reduce", "all_reduce_future", "broadcast", "broadcast_object",
           "exchange", "nbytes", "reduce_scatter_into"]
