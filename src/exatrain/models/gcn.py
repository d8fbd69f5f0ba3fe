"""Graph convolutional network (Kipf & Welling) for full-graph node classification.

One layer is aggregation then combination:

    H = Â · F          sparse × dense (SpMM): every node sums its neighbours' features
    Q = H · W + b      dense × dense (GEMM)
    F' = ReLU(Q)       (no activation after the last layer: its Q are the class logits)

with Â = D^-1/2 (A + I) D^-1/2 the symmetric normalised adjacency with self-loops
(`normalized_adjacency`). Â is held in CSR together with its transpose, so the backward SpMM
(dF = Âᵀ · dH) is a CSR product too (`sparse_matmul`).

The model takes the node features of one graph, (N, F), or a batch of graphs over the same
adjacency, (B, N, F), and returns logits (N, C) / (B, N, C). The adjacency is not a parameter
or buffer: it is moved to the features' device on first use.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from ..errors import ModelInputError, ModelOptionError


def normalized_adjacency(edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Â = D^-1/2 (A + I) D^-1/2 as a coalesced sparse COO (N, N) float32 tensor.

    `edge_index` (2, E) holds directed or undirected edges; they are made symmetric, duplicates
    and existing self-loops are dropped, and one self-loop per node is added.
    """
    edge_index = torch.as_tensor(edge_index, dtype=torch.int64)
    src, dst = edge_index[0], edge_index[1]
    keep = src != dst
    src, dst = src[keep], dst[keep]
    loops = torch.arange(num_nodes, dtype=torch.int64)
    keys = torch.unique(torch.cat([src * num_nodes + dst, dst * num_nodes + src,
                                   loops * num_nodes + loops]))
    rows, cols = keys // num_nodes, keys % num_nodes
    degree = torch.bincount(rows, minlength=num_nodes).to(torch.float32)
    scale = degree.rsqrt()
    values = scale[rows] * scale[cols]
    return torch.sparse_coo_tensor(torch.stack([rows, cols]), values, (num_nodes, num_nodes),
                                   is_coalesced=True, check_invariants=False)


class SparseOperator:
    """A sparse matrix in CSR and its transpose in CSR, for the forward and backward SpMM.

    `parts` and `parts_t` hold each CSR's (crow_indices, col_indices, values) as plain tensors:
    what `sparse_matmul` hands the SpMM, so that a compiled model sees only strided tensors (a
    sparse tensor cannot enter a compiled graph)."""

    def __init__(self, coo: torch.Tensor):
        coo = coo.coalesce()
        self.shape = tuple(coo.shape)
        self.nnz = coo._nnz()
        with warnings.catch_warnings():   # "CSR support is in beta": it is what we test against
            warnings.simplefilter("ignore", UserWarning)
            self.matrix = coo.to_sparse_csr()
            self.transposed = coo.t().coalesce().to_sparse_csr()
        self._split()

    def _split(self) -> None:
        self.parts = _csr_parts(self.matrix)
        self.parts_t = _csr_parts(self.transposed)
        self.device = self.parts[0].device

    def __deepcopy__(self, memo) -> "SparseOperator":
        return self   # constant: copies of a model share it

    def to(self, device) -> "SparseOperator":
        if self.device == torch.device(device):
            return self
        moved = object.__new__(SparseOperator)
        moved.shape, moved.nnz = self.shape, self.nnz
        moved.matrix, moved.transposed = self.matrix.to(device), self.transposed.to(device)
        moved._split()
        return moved


def _csr_parts(csr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # copies: plain strided tensors of their own, not views into the sparse tensor's members
    return csr.crow_indices().clone(), csr.col_indices().clone(), csr.values().clone()


def _csr(crow, col, values, columns: int) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, (crow.numel() - 1, columns),
                                       check_invariants=False)


@torch.library.custom_op("exatrain::csr_matmul", mutates_args=())
def csr_matmul(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
               crow_t: torch.Tensor, col_t: torch.Tensor, values_t: torch.Tensor,
               x: torch.Tensor) -> torch.Tensor:
    """A · x for the CSR A = (crow, col, values) with x.shape[0] columns; its transpose
    (crow_t, col_t, values_t) serves the backward. One op to a compiler: it enters a compiled
    graph whole, with plain tensors only."""
    return torch.sparse.mm(_csr(crow, col, values, x.shape[0]), x)


@csr_matmul.register_fake
def _(crow, col, values, crow_t, col_t, values_t, x):
    return x.new_empty(crow.shape[0] - 1, x.shape[1])


def _csr_matmul_context(ctx, inputs, output):
    ctx.transposed = inputs[3:6]
    ctx.rows = inputs[0].shape[0] - 1


def _csr_matmul_backward(ctx, grad):
    crow_t, col_t, values_t = ctx.transposed
    grad_x = torch.sparse.mm(_csr(crow_t, col_t, values_t, ctx.rows), grad.contiguous())
    return None, None, None, None, None, None, grad_x   # A is constant: no gradient


csr_matmul.register_autograd(_csr_matmul_backward, setup_context=_csr_matmul_context)


def sparse_matmul(operator: SparseOperator, x: torch.Tensor) -> torch.Tensor:
    """Â · x, with dx = Âᵀ · dy (Â is constant)."""
    if operator.parts[2].dtype != x.dtype:
        raise TypeError(f"the adjacency is {operator.parts[2].dtype} but the features are "
                        f"{x.dtype}; cast one of them.")
    return csr_matmul(*operator.parts, *operator.parts_t, x)


class GraphConv(nn.Module):
    """Q = (Â · F) · W + b, with W of shape (in_features, out_features) (Glorot-initialised)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        bound = math.sqrt(6.0 / (in_features + out_features))
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, adjacency: SparseOperator, x: torch.Tensor) -> torch.Tensor:
        q = sparse_matmul(adjacency, x) @ self.weight
        return q + self.bias if self.bias is not None else q

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class GCN(nn.Module):
    """`layers` GraphConvs: in_features → hidden → … → hidden → classes, ReLU and dropout between."""

    def __init__(self, adjacency: torch.Tensor, in_features: int, hidden: int, classes: int,
                 layers: int = 2, dropout: float = 0.5):
        super().__init__()
        if layers < 1:
            raise ModelOptionError(f"GCN layers={layers}: need at least one layer.")
        self.num_nodes = adjacency.shape[0]
        self.adjacency = adjacency.coalesce()          # the COO Â, for strategies to partition
        self._operator = SparseOperator(self.adjacency)   # CSR copies, moved on first forward
        dims = [in_features] + [hidden] * (layers - 1) + [classes]
        self.convs = nn.ModuleList(GraphConv(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.dropout = nn.Dropout(dropout)

    def operator(self, device) -> SparseOperator:
        self._operator = self._operator.to(device)
        return self._operator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            return torch.stack([self.forward(graph) for graph in x])
        if x.shape[0] != self.num_nodes:
            raise ModelInputError(f"the features have {x.shape[0]} rows but the graph has "
                                  f"{self.num_nodes} nodes: pass one row of features per node "
                                  f"of the graph the model was built on.")
        adjacency = self.operator(x.device)
        h = x
        for i, conv in enumerate(self.convs):
            h = conv(adjacency, h)
            if i < len(self.convs) - 1:
                h = self.dropout(torch.relu(h))
        return h
