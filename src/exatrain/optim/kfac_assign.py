"""Distributed K-FAC's work split: which ranks hold, invert and apply which layer's factors.

Distribution (Pauloski et al., KAISA, SC21). The replica group is the `data` × `space` ranks
(W of them); every other axis is refused by name (`check_plan`). Ranks are laid out as a grid of
R = 1/f rows × n = f·W columns, f = `grad_worker_fraction` ∈ [1/W, 1]:

  1. factors   every rank sums a aᵀ and g gᵀ over its own rows (its samples under `data`, its
               spatial block's positions under `space`; a layer that runs replicated over the S
               spatial ranks weighs its rows by 1/S), and ONE all-reduce over the replica group
               sums all layers' factors and row counts (tag "kfac").
  2. eigen     each layer belongs to one row of grad workers, chosen by greedy
               longest-processing-time over the rows on cost d_A³ + d_G³; inside the row each of
               its two factors is eigendecomposed by one member (LPT again), which broadcasts
               Q and d to the row (tag "kfac").
  3. gradient  the row's members precondition the layer's gradient; each member broadcasts V
               down its column, so every other rank receives V from exactly one worker
               (tag "kfac").

f = 1/W (R = W rows of one rank) is memory-optimal: one rank holds each layer's second-order
state, and every preconditioned gradient is broadcast every step. f = 1 (one row) is
communication-optimal: every rank holds everything and step 3 sends nothing.

Bytes per rank (ledger payload convention: all-reduce and broadcast count the tensor once), with
a = d_A, g = d_G of layer ℓ and 4-byte floats:

  factors (step 1, every `factor_every`)    4 · (Σ_ℓ (a² + g²) + 2L)       all-reduce, all ranks
  eigen   (step 2, every `inverse_every`)   4 · Σ_{ℓ in my row} (a² + a + g² + g)   when n > 1
  gradient (step 3, every step)             4 · Σ_ℓ g·a                    when R > 1

(L layers; the 2L are each layer's two row counts, sent as floats in the same all-reduce.)

Second-order state held per rank (`memory_bytes`; the persistent tensors: running factors,
eigenvectors, eigenvalues of the layers of its row):

  4 · Σ_{ℓ in my row} (2a² + a + 2g² + g)          (2a for a diagonal A, 2g for a diagonal G)

so the sum over ranks is n times the serial state, and each rank holds about f of it.

(`KFAC.memory_bytes` counts it from the tensors; `KFAC.memory_formula` is this formula.)
"""

from __future__ import annotations

import torch.distributed as dist

from ..comm import Axis, Ledger
from ..errors import ConfigError


def lpt(costs: list[float], bins: int) -> list[int]:
    """Greedy longest-processing-time: item i -> bin, largest items first to the least loaded
    bin (ties: the lowest bin, so every rank computes the same assignment)."""
    load = [0.0] * bins
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        b = min(range(bins), key=lambda j: (load[j], j))
        out[i] = b
        load[b] += costs[i]
    return out


class WorkerGrid:
    """The replica ranks as R rows of n grad workers, and which row holds each layer and which
    member of the row inverts each of its factors (see the module doc).

    Args:
        mesh: the Mesh (its data × space ranks are the replicas); None on one process.
        costs: per layer, (cost of A, cost of G): the inversion's flops, up to a constant.
        fraction: `grad_worker_fraction`, n / W.
    """

    def __init__(self, mesh, costs: list[tuple[int, int]], fraction: float):
        self.axis = self._replica_axis(mesh)
        W = self.axis.size
        n = max(1, round(fraction * W))
        if not 1 / W - 1e-9 <= fraction <= 1 or W % n:
            fractions = [k / W for k in range(1, W + 1) if W % k == 0]
            raise ConfigError(f"kfac grad_worker_fraction={fraction} on {W} replica ranks: it "
                              f"must be one of {fractions} (n/W with n dividing W).")
        self.workers, self.rows = n, W // n
        self.my_row, self.my_col = divmod(self.axis.rank, n)
        self.row_axis, self.col_axis = self._grid_axes()
        # each layer's row by LPT on its inversion cost; inside the row, each factor's
        # inversion by LPT over the row's members
        self.layer_row = lpt([a + g for a, g in costs], self.rows)
        self.factor_worker: dict[tuple[int, str], int] = {}
        for row in range(self.rows):
            mine = [i for i, r in enumerate(self.layer_row) if r == row]
            items = [(i, k) for i in mine for k in ("A", "G")]
            sizes = [costs[i][0 if k == "A" else 1] for i, k in items]
            for item, w in zip(items, lpt(sizes, n)):
                self.factor_worker[item] = w

    @staticmethod
    def _replica_axis(mesh) -> Axis:
        if mesh is None:
            return Axis("data", 1, 0, None, Ledger(), (0,))
        return mesh.axis("data", "space")

    def _grid_axes(self) -> tuple[Axis, Axis]:
        """The row (grad workers) and column (gradient broadcast) groups of this rank; creating a
        group is collective, so every rank creates every row and every column."""
        n, R, ax = self.workers, self.rows, self.axis
        ranks = ax.global_ranks

        def groups(members_of, count, mine):
            out = None
            for k in range(count):
                members = tuple(ranks[j] for j in members_of(k))
                group = dist.new_group(list(members)) if 1 < len(members) < ax.size \
                    else (ax.group if len(members) == ax.size else None)
                if k == mine:
                    out = Axis(ax.name, len(members), members.index(ranks[ax.rank]), group,
                               ax.ledger, members)
            return out

        if ax.size == 1:
            return ax, ax
        row = groups(lambda k: range(k * n, (k + 1) * n), R, self.my_row)
        col = groups(lambda c: range(c, ax.size, n), n, self.my_col)
        return row, col

    def holds(self, i: int) -> bool:
        """Does this rank hold layer i's second-order state (is it one of its grad workers)?"""
        return self.layer_row[i] == self.my_row
