"""Communication: collectives over named axes, recorded in a per-mesh ledger."""

from .collectives import (Axis, all_gather_into, all_gather_object, all_reduce, all_reduce_future, broadcast,
                          broadcast_object,
                          exchange, nbytes, reduce_scatter_into)
from .ledger import Ledger

__all__ = ["Axis", "Ledger", "all_gather_into", "all_gather_object", "all_reduce", "all_reduce_future", "broadcast", "broadcast_object",
           "exchange", "nbytes", "reduce_scatter_into"]
