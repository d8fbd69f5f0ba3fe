"""GCN workload: full-graph node classification (cross-entropy on the labelled training nodes).

The whole graph is one sample: x = the node features (N, F), y = the labels with every node
outside the split set to -1 (ignored by the loss). So the Trainer's step is one full-graph
forward and backward; `train.batch_size` = `data.parts` (= the data replicas, usually 1).

`data.parts` > 1 splits the training (and validation) nodes into that many equal shares, one
"sample" each: data replicas then train on the same graph with disjoint label shares, and their
averaged gradient equals the serial gradient over all shares (a few labelled nodes are dropped
so the shares are equal). The validation targets also carry the test nodes, coded as -2 - label,
so one evaluation reports val_accuracy and test_accuracy.

Under a 3D tensor plan (plan.tensor = [x, y, z]) `parallelize` lays the model out Plexus-style
(parallel/graph.py); `parallel.graph_balance` switches the random permutations that balance the
adjacency's nonzeros over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..data.graph import load_graph, write_graph
from ..models.gcn import GCN, normalized_adjacency
from .base import InputOptions, Workload


@dataclass
class ModelOptions:
    hidden: int = 64
    layers: int = 2
    dropout: float = 0.5


@dataclass
class DataOptions(InputOptions):
    path: str = "data/graph-20k"   # graph.npz, or a directory of edge/feature/label/split files
    generate: bool = True          # write a power-law graph there if nothing is there
    nodes: int = 20000             # nodes to generate
    seed: int = 0
    parts: int = 1                 # label shares (one per data replica)


class GraphTargets(Dataset):
    """`parts` samples: the same features, each with its own share of the labelled nodes."""

    def __init__(self, features: torch.Tensor, targets: torch.Tensor):
        self.features, self.targets = features, targets     # (N, F), (parts, N)

    def __len__(self) -> int:
        return self.targets.shape[0]

    def __getitem__(self, i):
        return self.features, self.targets[i]


def _shares(labels: torch.Tensor, mask: torch.Tensor, parts: int,
            extra: torch.Tensor | None = None) -> torch.Tensor:
    nodes = mask.nonzero().flatten()
    nodes = nodes[:len(nodes) // parts * parts]
    out = torch.full((parts, len(labels)), -1, dtype=torch.int64)
    for r in range(parts):
        share = nodes[r::parts]
        out[r, share] = labels[share]
    if extra is not None:   # test nodes, coded -2 - label, in the first share
        out[0, extra] = -2 - labels[extra]
    return out


def prepare(config, progress=None) -> Path:
    d = config.data
    path = Path(d.path)
    if d.generate and not path.exists():
        write_graph(path, nodes=d.nodes, seed=d.seed)
    return path


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                           ignore_index=-1)


def build(config, mesh) -> Workload:
    m, d = config.model, config.data
    graph = load_graph(d.path)
    labels = graph.labels
    train = GraphTargets(graph.features, _shares(labels, graph.train_mask & (labels >= 0), d.parts))
    test_nodes = (graph.test_mask & (labels >= 0)).nonzero().flatten()
    val = GraphTargets(graph.features, _shares(labels, graph.val_mask & (labels >= 0), d.parts,
                                               extra=test_nodes))
    adjacency = normalized_adjacency(graph.edge_index, graph.num_nodes)
    model = GCN(adjacency, graph.features.shape[1], m.hidden, graph.num_classes,
                layers=m.layers, dropout=m.dropout)

    def metric_sums(output, target):
        pred = output.argmax(-1)
        val_nodes, test_nodes = target >= 0, target <= -2
        return {"val_correct": (pred == target)[val_nodes].sum().double(),
                "val_count": val_nodes.sum().double(),
                "test_correct": (pred == -2 - target)[test_nodes].sum().double(),
                "test_count": test_nodes.sum().double()}

    def finalize(s):
        return {"val_accuracy": s["val_correct"] / max(float(s["val_count"]), 1.0),
                "test_accuracy": s["test_correct"] / max(float(s["test_count"]), 1.0)}

    counts = torch.bincount(labels[graph.train_mask & (labels >= 0)])
    dims = [graph.features.shape[1]] + [m.hidden] * (m.layers - 1) + [graph.num_classes]
    nnz = adjacency._nnz()
    forward = sum(2 * nnz * a + 2 * graph.num_nodes * a * b for a, b in zip(dims[:-1], dims[1:]))
    return Workload(model=model, train_set=train, val_set=val, loss_fn=cross_entropy,
                    metric_sums=metric_sums, finalize=finalize,
                    baselines={"majority_class_accuracy": float(counts.max() / counts.sum())},
                    flops_per_sample=3 * forward)
