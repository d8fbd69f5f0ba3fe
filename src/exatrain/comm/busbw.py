"""Bus bandwidth: the rate a collective's links carried, comparable across ops and group sizes.

As nccl-tests defines it (PERFORMANCE.md): for a collective over n ranks that moved a buffer of S
bytes in t seconds, algorithm bandwidth algbw = S / t and bus bandwidth busbw = algbw * factor,
with the factor the share of S each rank's link must carry in an optimal algorithm:

  all_reduce       2 (n - 1) / n     (S: the tensor, as the ledger counts it)
  all_gather       (n - 1) / n       (S: the gathered output)
  reduce_scatter   (n - 1) / n       (S: the full input)
  broadcast        1
  send / recv      1                 (point to point: S crosses one link)

busbw is then comparable with the link's hardware bandwidth, whatever n is.
"""

from __future__ import annotations


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth for `op` over `n` ranks."""
    op = op.removesuffix(".wait")
    if op == "all_reduce":
        return 2 * (n - 1) / n if n > 1 else 0.0
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n if n > 1 else 0.0
    return 1.0  # broadcast, send, recv, exchange
