"""3D-parallel full-graph GCN on the tensor grid tensor_x × tensor_y × tensor_z (Plexus, SC'25).

A GCN layer is H = Â·F (SpMM), Q = H·W + b (GEMM). On a grid of X·Y·Z ranks each layer gives the
three grid axes three roles:

    rows    splits Â's rows (the layer's output nodes); the depth axis of W
    cols    splits Â's columns and F's rows (the input nodes); SpMM's contraction ("outer" axis)
    feats   splits F's columns (the input features); GEMM's contraction ("inner" axis)

Rank (i, j, k) holds Â[rows-block, cols-block] (as CSR, with its transpose for the backward),
F[cols-block, feats-block], and the W block W[feats-block, cols-block] sharded once more by rows
over the rows axis (ZeRO-3 style). One layer (`_GraphConv3D`):

    forward   W_blk = all-gather_rows(W_shard)                    (prefetched one layer ahead)
              H_blk = all-reduce_cols(Â_blk · F_blk)            (n_r × d_i)
              Q_blk = all-reduce_feats(H_blk · W_blk) + b_blk   (n_r × d_o)
    backward  dW_shard = reduce-scatter_rows(H_blkᵀ · dQ_blk)       (asynchronous, overlapped)
              dH_blk = all-reduce_cols(dQ_blk · W_blkᵀ)
              dF_blk = all-reduce_rows(Â_blkᵀ · dH_blk)         (only when F needs a gradient)
              db: summed over rows by the gradient sync (each rows-rank saw its nodes only)

The output Q is split rows × cols and replicated over feats, which is the input layout of a
layer whose (rows, cols, feats) are (feats, rows, cols): so the roles rotate from layer to layer,
(x, y, z) → (z, x, y) → (y, z, x) → (x, y, z) …, and layers chain with no re-layout. At the
model's boundary the replicated input features are sliced into layer 0's layout (no
communication) and the last layer's logits are all-gathered over its cols then rows axes.

Padding: the node count is padded to a multiple of lcm(X, Y, Z) and every feature width to a
multiple of X·Y·Z, with zero rows/columns of Â, zero features and zero weights. Padded nodes have
no edges into real nodes, and padded weights get zero gradients (their inputs or upstream
gradients are zero), so results on the real nodes and classes equal the unpadded model's.

Load balance: with `permute`, rows and columns of Â are permuted by two independent random
permutations P_r, P_c (of the padded node range). A layer's output rows are the next layer's input
rows, so layers alternate: even layers use Â[P_r, P_c] (input in P_c order, output in P_r
order), odd layers Â[P_c, P_r]. The input features are permuted like the columns (P_c), and the
gathered logits are mapped back to the original node order before they leave the model, so
labels, loss and metrics are untouched. `nnz_imbalance` gives max-over-ranks / mean of the
nonzeros of the SpMM blocks.

Bytes per training step per rank, layer with roles (r, c, f), s bytes per element,
n_r = N_pad/|r|, n_c = N_pad/|c|, d_i = D_in_pad/|f|, d_o = D_out_pad/|c|:

    r   2·d_i·d_o·s     W all-gather (gathered size) + dW reduce-scatter (full input size)
        + n_c·d_i·s     dF all-reduce (layers whose input needs a gradient: all but the first)
        + d_o·s         bias-gradient all-reduce (gradient sync, tag "grad"; on "data+r" when
                        data > 1, together with the data-parallel mean)
    c   n_r·d_i·s       H all-reduce (forward)
        + n_r·d_i·s     dH all-reduce (backward; only needed for dF, so not in the first layer)
    f   n_r·d_o·s       Q all-reduce (forward)

plus, when the model's input needs a gradient, its all-gather at the boundary (n_c·D_in_pad·s on
layer 0's feats, N_pad·D_in_pad·s on its cols); for the last layer (roles r_L, c_L), the logits gather: n_{r_L}·C_pad·s on c_L and
N_pad·C_pad·s on r_L; with `data` > 1, the gradient all-reduce of every local parameter (on
"data", or "data+r" for the biases; `gradsync`); with
dropout, an 8-byte seed broadcast on `tensor` (tag "control"). `GCN3D.bytes_per_step()` evaluates
this for the last forward.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..comm import Axis, all_gather_into, all_reduce, broadcast, reduce_scatter_into
from ..comm.autograd import gather, scatter
from ..mesh import Mesh
from ..plan import PlanError
from ..models.gcn import GCN, GraphConv, SparseOperator
from .gradsync import GradSync, set_grad_axes
from .tensor.state import shard_of


@dataclass(frozen=True)
class Roles:
    """The grid axes' roles in one layer (see the module docstring)."""
    rows: Axis
    cols: Axis
    feats: Axis


# (rows, cols, feats) as indices into (x, y, z), per layer modulo 3
_ROLE_INDEX = [(0, 1, 2), (2, 0, 1), (1, 2, 0)]


def layer_roles(x: Axis, y: Axis, z: Axis, layer: int) -> Roles:
    """(x, y, z) → (z, x, y) → (y, z, x), repeating: layer l's output layout is l+1's input."""
    axes = (x, y, z)
    return Roles(*(axes[i] for i in _ROLE_INDEX[layer % 3]))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def balancing_permutations(n_pad: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent random permutations (rows P_r, columns P_c) of range(n_pad)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(n_pad, generator=generator), torch.randperm(n_pad, generator=generator)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(len(perm))
    return inverse


def block_counts(rows: torch.Tensor, cols: torch.Tensor, n_pad: int, row_parts: int,
                 col_parts: int) -> torch.Tensor:
    """Nonzeros per (row block, column block) of an N_pad × N_pad matrix."""
    which = rows // (n_pad // row_parts) * col_parts + cols // (n_pad // col_parts)
    return torch.bincount(which, minlength=row_parts * col_parts)


def nnz_imbalance(adjacency: torch.Tensor, grid: tuple[int, int, int], layers: int,
                  permutations: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """Worst (over layers) max-over-ranks / mean nonzeros of the SpMM blocks on `grid`.

    Pure arithmetic on the full adjacency (no communication). `permutations` = (P_r, P_c) of the
    padded node range, or None for the original order.
    """
    n = adjacency.shape[0]
    n_pad = round_up(n, math.lcm(*grid))
    index = adjacency.coalesce().indices()
    worst = 1.0
    for layer in range(layers):
        sizes = [grid[i] for i in _ROLE_INDEX[layer % 3]]
        rows, cols = index[0], index[1]
        if permutations is not None:
            out_perm, in_perm = _orders(permutations, layer)
            rows, cols = _inverse(out_perm)[rows], _inverse(in_perm)[cols]
        counts = block_counts(rows, cols, n_pad, sizes[0], sizes[1]).double()
        worst = max(worst, float(counts.max() / counts.mean()))
    return worst


def _orders(permutations, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(output order, input order) of a layer: even layers P_r, P_c; odd layers P_c, P_r."""
    p_rows, p_cols = permutations
    return (p_rows, p_cols) if layer % 2 == 0 else (p_cols, p_rows)


class _GraphConv3D(torch.autograd.Function):
    """Q_blk = all-reduce_feats(all-reduce_cols(Â_blk F_blk) · all-gather_rows(W_shard))."""

    @staticmethod
    def forward(ctx, x, weight, layer):
        roles = layer.roles
        w = layer.gather_weight()
        h = torch.sparse.mm(layer.block.matrix, x)
        all_reduce(h, roles.cols, tag="act")
        q = h @ w
        all_reduce(q, roles.feats, tag="act")
        ctx.save_for_backward(h, w)
        ctx.layer = layer
        return q

    @staticmethod
    def backward(ctx, grad_q):
        h, w = ctx.saved_tensors
        layer = ctx.layer
        roles = layer.roles
        grad_q = grad_q.contiguous()
        grad_w = work = None
        if ctx.needs_input_grad[1]:   # asynchronous: overlaps the dH and dF work below
            grad_w = torch.empty_like(layer.weight)
            block = h.t() @ grad_q           # kept alive until the wait below
            work = reduce_scatter_into(grad_w, block, roles.rows, tag="weight", async_op=True)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_h = grad_q @ w.t()
            all_reduce(grad_h, roles.cols, tag="act")
            grad_x = torch.sparse.mm(layer.block.transposed, grad_h)   # dH serves only dF
            all_reduce(grad_x, roles.rows, tag="act")
        if work is not None:
            work.wait()
        return grad_x, grad_w, None


class GraphConv3D(nn.Module):
    """A GraphConv laid out on the grid with `roles`; holds its Â block and W / b parts."""

    def __init__(self, conv: GraphConv, roles: Roles, block: SparseOperator, grid: Axis,
                 in_pad: int, out_pad: int):
        super().__init__()
        self.roles, self.block = roles, block
        self.in_features, self.out_features = conv.in_features, conv.out_features
        self.in_pad, self.out_pad = in_pad, out_pad
        full = torch.zeros(in_pad, out_pad, dtype=conv.weight.dtype, device=conv.weight.device)
        full[:conv.in_features, :conv.out_features] = conv.weight.detach()
        layout = ((0, roles.feats), (0, roles.rows), (1, roles.cols))
        self.weight = nn.Parameter(shard_of(full, layout).clone())
        self.weight.exatrain_layout = layout
        self.weight.exatrain_norm_axes = (grid,)
        self.bias = None
        if conv.bias is not None:
            full_bias = torch.zeros(out_pad, dtype=conv.bias.dtype, device=conv.bias.device)
            full_bias[:conv.out_features] = conv.bias.detach()
            self.bias = nn.Parameter(shard_of(full_bias, ((0, roles.cols),)).clone())
            self.bias.exatrain_layout = ((0, roles.cols),)
            self.bias.exatrain_norm_axes = (roles.cols,)
        self._input_grad = False
        self._pending = None       # (block, work, weight version) of a prefetched all-gather

    def prefetch_weight(self) -> None:
        """Start this layer's weight all-gather now, asynchronously (the model calls it one layer
        ahead, so the gather overlaps the previous layer's SpMM and GEMM)."""
        rows = self.roles.rows
        if rows.size > 1 and self._pending is None:
            block = self.weight.new_empty((self.weight.shape[0] * rows.size,
                                           self.weight.shape[1]))
            work = all_gather_into(block, self.weight.detach(), rows, tag="weight", async_op=True)
            self._pending = (block, work, self.weight._version)

    def gather_weight(self) -> torch.Tensor:
        """The W block gathered over rows: the prefetched one if the weight has not changed since
        (its version counter), else gathered now."""
        rows = self.roles.rows
        if rows.size == 1:
            return self.weight.detach()
        pending, self._pending = self._pending, None
        if pending is not None:
            block, work, version = pending
            work.wait()
            if version == self.weight._version:
                return block
        block = self.weight.new_empty((self.weight.shape[0] * rows.size, self.weight.shape[1]))
        all_gather_into(block, self.weight.detach(), rows, tag="weight")
        return block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._input_grad = x.requires_grad
        q = _GraphConv3D.apply(x, self.weight, self)
        return q + self.bias if self.bias is not None else q

    def bytes_per_step(self, n_pad: int) -> dict[str, int]:
        """The module docstring's formula for this layer, one training step."""
        r, c, f = self.roles.rows, self.roles.cols, self.roles.feats
        s = self.weight.element_size()
        n_r, n_c = n_pad // r.size, n_pad // c.size
        d_i, d_o = self.in_pad // f.size, self.out_pad // c.size
        parts = [(r, 2 * d_i * d_o * s), (c, n_r * d_i * s), (f, n_r * d_o * s)]
        if self._input_grad:
            parts += [(c, n_r * d_i * s), (r, n_c * d_i * s)]
        return _add({}, parts)

    def extra_repr(self) -> str:
        r, c, f = self.roles.rows, self.roles.cols, self.roles.feats
        return (f"in={self.in_features}, out={self.out_features}, rows on {r.name}, cols on "
                f"{c.name}, feats on {f.name}, nnz {self.block.nnz}")


def _add(total: dict[str, int], parts) -> dict[str, int]:
    for axis, nbytes in parts:
        if axis.size > 1 and nbytes:
            total[axis.name] = total.get(axis.name, 0) + nbytes
    return total


class GCN3D(nn.Module):
    """A `GCN` on the 3D grid; takes and returns what the plain GCN does, on every rank."""

    def __init__(self, model: GCN, mesh: Mesh, permute: bool = True, seed: int = 0):
        super().__init__()
        plan = mesh.plan
        if not plan.tensor_3d:
            raise PlanError(f"{plan}: the graph strategy needs a 3D tensor grid; write "
                            f"plan.tensor = [{plan.tensor}, 1, 1] for a 1-D split of the graph.")
        self.mesh = mesh
        self.x, self.y, self.z = (mesh.axis(f"tensor_{a}") for a in "xyz")
        self.tensor = mesh.axis("tensor")
        sizes = (self.x.size, self.y.size, self.z.size)
        self.num_nodes = model.num_nodes
        self.n_pad = round_up(model.num_nodes, math.lcm(*sizes))
        self.permutations = balancing_permutations(self.n_pad, seed) if permute else None
        self.dropout_p = model.dropout.p
        self.dropout = model.dropout  # keeps train()/eval() and the repr of the plain model
        grid_size = math.prod(sizes)
        index, values = model.adjacency.indices(), model.adjacency.values()
        blocks: dict[tuple, SparseOperator] = {}
        convs = []
        for i, conv in enumerate(model.convs):
            roles = layer_roles(self.x, self.y, self.z, i)
            key = (roles.rows.name, roles.cols.name, i % 2)
            if key not in blocks:
                blocks[key] = self._block(index, values, roles, i)
            convs.append(GraphConv3D(conv, roles, blocks[key], self.tensor,
                                     round_up(conv.in_features, grid_size),
                                     round_up(conv.out_features, grid_size)))
        self.convs = nn.ModuleList(convs)
        self.classes = model.convs[-1].out_features
        self._seed_bytes, self._graphs = 0, 1
        mean = ("data",) if mesh.axis("data").size > 1 else ()
        for conv in self.convs:
            set_grad_axes(conv.weight, mean_axes=mean)
            if conv.bias is not None:   # each rows-rank summed the gradient of its nodes only
                rows = conv.roles.rows
                set_grad_axes(conv.bias, sum_axes=(rows.name,) if rows.size > 1 else (),
                              mean_axes=mean)
        self.gradsync = GradSync(self.parameters(), mesh)
        self.no_sync = self.gradsync.no_sync

    def _block(self, index, values, roles: Roles, layer: int) -> SparseOperator:
        """This rank's Â[rows-block, cols-block] in the layer's (permuted) node orders."""
        rows, cols = index[0], index[1]
        if self.permutations is not None:
            out_perm, in_perm = _orders(self.permutations, layer)
            rows, cols = _inverse(out_perm)[rows], _inverse(in_perm)[cols]
        n_r, n_c = self.n_pad // roles.rows.size, self.n_pad // roles.cols.size
        mine = (rows // n_r == roles.rows.rank) & (cols // n_c == roles.cols.rank)
        local = torch.stack([rows[mine] - roles.rows.rank * n_r, cols[mine] - roles.cols.rank * n_c])
        coo = torch.sparse_coo_tensor(local, values[mine], (n_r, n_c), check_invariants=False)
        return SparseOperator(coo).to(self.mesh.device)

    # ------------------------------------------------------------------ forward
    def _input_block(self, x: torch.Tensor) -> torch.Tensor:
        roles = self.convs[0].roles
        padded = x.new_zeros((self.n_pad, self.convs[0].in_pad))
        padded[:x.shape[0], :x.shape[1]] = x
        if self.permutations is not None:
            padded = padded[_orders(self.permutations, 0)[1].to(x.device)]
        # own block, no communication; the backward (only if x needs a gradient) all-gathers it
        return scatter(scatter(padded, roles.cols, 0), roles.feats, 1)

    def _dropout(self, h: torch.Tensor, layer: int, seed: int) -> torch.Tensor:
        """Inverted dropout with one mask per (rows, cols) block, equal on the feats ranks that
        hold copies of the block (their generator seeds agree)."""
        roles = self.convs[layer].roles
        generator = torch.Generator(device=h.device).manual_seed(
            (seed * 1_000_003 + layer * 7_919 + roles.rows.rank * 131 + roles.cols.rank) % 2 ** 62)
        keep = torch.rand(h.shape, generator=generator, device=h.device) >= self.dropout_p
        return h * keep / (1 - self.dropout_p)

    def _one_graph(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.num_nodes:
            raise ValueError(f"the features have {x.shape[0]} rows but the graph has "
                             f"{self.num_nodes} nodes.")
        seed = 0
        use_dropout = self.training and self.dropout_p > 0
        if use_dropout:
            value = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=x.device)
            broadcast(value, self.tensor, tag="control")
            seed = int(value)
            self._seed_bytes += 8 if self.tensor.size > 1 else 0
        h = self._input_block(x)
        for i, conv in enumerate(self.convs):
            if i + 1 < len(self.convs):
                self.convs[i + 1].prefetch_weight()
            h = conv(h)
            if i < len(self.convs) - 1:
                h = torch.relu(h)
                if use_dropout:
                    h = self._dropout(h, i, seed)
        last = self.convs[-1].roles
        out = gather(gather(h, last.cols, 1), last.rows, 0)
        if self.permutations is not None:
            out = out[_inverse(_orders(self.permutations, len(self.convs) - 1)[0]).to(x.device)]
        return out[:self.num_nodes, :self.classes]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._graphs = x.shape[0] if x.dim() == 3 else 1
        self._seed_bytes = 0
        if x.dim() == 3:
            return torch.stack([self._one_graph(graph) for graph in x])
        return self._one_graph(x)

    # ------------------------------------------------------------------ figures
    def bytes_per_step(self) -> dict[str, int]:
        """Per-axis bytes of one training step (the module docstring's formula) for the number
        of graphs in the last forward."""
        total: dict[str, int] = {}
        for conv in self.convs:
            for name, nbytes in conv.bytes_per_step(self.n_pad).items():
                total[name] = total.get(name, 0) + nbytes
        last = self.convs[-1]
        s = last.weight.element_size()
        n_r = self.n_pad // last.roles.rows.size
        _add(total, [(last.roles.cols, n_r * last.out_pad * s),
                     (last.roles.rows, self.n_pad * last.out_pad * s)])
        first = self.convs[0]
        if first._input_grad:   # the input's gradient, all-gathered at the boundary
            r0 = first.roles
            _add(total, [(r0.feats, self.n_pad // r0.cols.size * first.in_pad * s),
                         (r0.cols, self.n_pad * first.in_pad * s)])
        total = {name: nbytes * self._graphs for name, nbytes in total.items()}
        for name, nbytes in self.gradsync.bytes_per_step().items():
            total[name] = total.get(name, 0) + nbytes
        if self._seed_bytes:
            total[self.tensor.name] = total.get(self.tensor.name, 0) + self._seed_bytes
        return total

    def plain_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """The plain GCN's state dict (padding cut off), gathered whole on every rank; with
        `grads`, the parameters' gradients instead. Collective over the tensor grid."""
        from .tensor.state import gather_full

        out = {}
        for name, p in self.named_parameters():
            conv = self.convs[int(name.split(".")[1])]
            full = gather_full(p.grad if grads else p.detach(), p.exatrain_layout)
            out[name] = full[:conv.in_features, :conv.out_features] if full.dim() == 2 \
                else full[:conv.out_features]
        return out

    def nnz_per_rank(self) -> int:
        """Nonzeros this rank multiplies per forward (all layers)."""
        return sum(conv.block.nnz for conv in self.convs)


def has_graph_convs(model: nn.Module) -> bool:
    return isinstance(model, GCN)


def graph_refusal(model: nn.Module) -> str | None:
    """Why `tensor` > 1 cannot lay `model` out, for models that pass messages over triplets
    of atoms (DimeNet++); None for the others.

    The graph axis splits a graph's nodes over the tensor grid and exchanges node features
    between the blocks of Â (this module). DimeNet++'s messages live on edges and are updated
    over triplets k→j→i: with the nodes split, the edges k→j and j→i of one triplet land on
    different ranks, and the exchange of edge messages across partitions is not built. (Nor
    does the Linear-splitting tensor path apply: DimeNet++ uses its Linears' weights directly.)
    """
    from ..models.dimenet import DimeNetPlusPlus

    if any(isinstance(m, DimeNetPlusPlus) for m in model.modules()):
        return ("DimeNet++ cannot be split over the tensor (graph) axis: its messages live on "
                "edges and are updated over triplets k→j→i of atoms, and with a molecule's "
                "atoms split over ranks a triplet's two edges fall in different partitions; "
                "that exchange of edge messages is not built. Set plan.tensor = 1 and use "
                "plan.data or plan.shard (each molecule stays whole on one rank).")
    return None


def parallelize_graph(model: GCN, mesh: Mesh, options=None, permute: bool | None = None,
                      seed: int = 0) -> GCN3D:
    """Lay a GCN out over the mesh's 3D tensor grid (and replicate over data); see the module
    docstring. The result's parameters keep the plain model's names (local parts of the padded
    tensors; `GCN3D.plain_state_dict()` gathers the plain model's). `permute` (default:
    options.graph_balance) switches the balancing permutations, seeded by `seed`."""
    if permute is None:
        permute = bool(getattr(options, "graph_balance", True))
    model = model.to(mesh.device)
    graph = GCN3D(model, mesh, permute=permute, seed=seed)
    graph.exatrain_tensor = GraphParallel(mesh, graph)
    return graph


class GraphParallel:
    """What parallelize_graph did, as `model.exatrain_tensor` (like the tensor strategy's record):
    the mesh (checkpoints save split parameters as DTensors on it) and the byte formula."""

    def __init__(self, mesh: Mesh, model: GCN3D):
        self.mesh = mesh
        self._model = weakref.ref(model)      # no reference cycle through the module tree

    def bytes_per_step(self) -> dict[str, int]:
        return self._model().bytes_per_step()
