"""Graphs for full-graph node classification: a generator with realistic skew, and a reader.

`write_graph(out, nodes)` (`exatrain data graph --out DIR --nodes N`) writes DIR/graph.npz, a
compressed numpy archive:

    indptr, indices        the undirected adjacency in CSR (each edge in both directions, no
                           self-loops), int64
    node_feat              (N, F) float32 features
    node_label             (N,) int64 classes
    train_mask, val_mask, test_mask   (N,) bool

The graph is a degree-corrected stochastic block model: node i gets a weight θ_i from a Pareto
(power-law) distribution and a community (its label); each edge picks one end ∝ θ and the other
∝ θ within the same community with probability `homophily`, else anywhere. Degrees are then
power-law distributed. Nodes are numbered by decreasing θ, hubs first, as crawled graphs often
are, so contiguous blocks of the adjacency hold very different numbers of nonzeros. Features are
the community's centre times `signal` plus unit Gaussian noise: weak on their own, strong once a
GCN averages them over the (mostly same-community) neighbours.

`load_graph(path)` reads our archive or the common on-disk layout of a node-property graph, e.g.
OGB's (`raw/edge.csv.gz`, `raw/node-feat.csv.gz`, `raw/node-label.csv.gz`,
`split/<name>/{train,valid,test}.csv.gz`) or the same as .npy files (`edge_index.npy` (2, E) or
(E, 2), `node_feat.npy`, `node_label.npy`, `train_idx.npy` ... or `train_mask.npy` ...), and
checks it: edge ids in range, one feature row per label, finite features, split ids in range.
Every error names the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import DataError, MissingFileError


class GraphFileError(DataError):
    """A graph file that cannot be used: unreadable, or its arrays disagree in shape.

    What to do: the message names the file and array; write it again with
    `exatrain data graph --out DIR` or fix the array it names.
    """


@dataclass
class Graph:
    edge_index: torch.Tensor     # (2, E) int64
    features: torch.Tensor       # (N, F) float32
    labels: torch.Tensor         # (N,) int64; -1 = unlabelled
    train_mask: torch.Tensor     # (N,) bool
    val_mask: torch.Tensor
    test_mask: torch.Tensor
    source: str = ""

    @property
    def num_nodes(self) -> int:
        return self.features.shape[0]

    @property
    def num_classes(self) -> int:
        return int(self.labels.max()) + 1


# ---------------------------------------------------------------------------- generator
def generate_graph(nodes: int, classes: int = 8, features: int = 64, avg_degree: float = 10.0,
                   exponent: float = 2.5, homophily: float = 0.8, signal: float = 0.2,
                   train: float = 0.3, val: float = 0.2, seed: int = 0) -> dict[str, np.ndarray]:
    """The arrays of graph.npz (see the module docstring)."""
    rng = np.random.default_rng(seed)
    theta = np.sort(rng.pareto(exponent - 1.0, nodes) + 1.0)[::-1]
    labels = rng.integers(0, classes, nodes)
    edges = int(nodes * avg_degree / 2)
    cumulative = np.cumsum(theta)
    src = np.searchsorted(cumulative, rng.random(edges) * cumulative[-1])
    dst = np.searchsorted(cumulative, rng.random(edges) * cumulative[-1])
    inside = rng.random(edges) < homophily
    for c in range(classes):
        members = np.flatnonzero(labels == c)
        pick = np.flatnonzero(inside & (labels[src] == c))
        if len(members) == 0 or len(pick) == 0:
            continue
        weights = np.cumsum(theta[members])
        dst[pick] = members[np.searchsorted(weights, rng.random(len(pick)) * weights[-1])]
    src, dst = np.minimum(src, nodes - 1), np.minimum(dst, nodes - 1)
    keep = src != dst
    indptr, indices = _symmetric_csr(src[keep], dst[keep], nodes)
    centres = rng.normal(size=(classes, features))
    feats = (signal * centres[labels] + rng.normal(size=(nodes, features))).astype(np.float32)
    order = rng.permutation(nodes)
    n_train, n_val = int(train * nodes), int(val * nodes)
    masks = {name: np.zeros(nodes, dtype=bool) for name in ("train_mask", "val_mask", "test_mask")}
    masks["train_mask"][order[:n_train]] = True
    masks["val_mask"][order[n_train:n_train + n_val]] = True
    masks["test_mask"][order[n_train + n_val:]] = True
    return {"indptr": indptr, "indices": indices, "node_feat": feats,
            "node_label": labels.astype(np.int64), **masks}


def _symmetric_csr(src: np.ndarray, dst: np.ndarray, nodes: int) -> tuple[np.ndarray, np.ndarray]:
    keys = np.unique(np.concatenate([src * nodes + dst, dst * nodes + src]))
    rows, cols = keys // nodes, keys % nodes
    indptr = np.zeros(nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=nodes), out=indptr[1:])
    return indptr, cols.astype(np.int64)


def write_graph(out: str | Path, nodes: int, seed: int = 0, **options) -> dict:
    """Generate a graph (see `generate_graph`) into out/graph.npz; returns a description."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    arrays = generate_graph(nodes, seed=seed, **options)
    path = out / "graph.npz"
    partial = out / "graph.partial.npz"
    np.savez_compressed(partial, **arrays)
    partial.replace(path)
    degree = np.diff(arrays["indptr"])
    return {"path": str(path), "nodes": nodes, "edges_directed": int(len(arrays["indices"])),
            "features": int(arrays["node_feat"].shape[1]),
            "classes": int(arrays["node_label"].max()) + 1, "max_degree": int(degree.max()),
            "mean_degree": float(degree.mean()), "bytes": path.stat().st_size}


# ---------------------------------------------------------------------------- reader
_NAMES = {
    "edges": ("edge_index", "edge", "edges"),
    "features": ("node_feat", "node-feat", "features"),
    "labels": ("node_label", "node-label", "labels"),
}
_SPLITS = {"train": ("train",), "val": ("valid", "val"), "test": ("test",)}
_SUFFIXES = (".npy", ".csv", ".csv.gz", ".txt")


def _find(folders: list[Path], stems) -> Path | None:
    for folder in folders:
        for stem in stems:
            for suffix in _SUFFIXES:
                if (folder / f"{stem}{suffix}").is_file():
                    return folder / f"{stem}{suffix}"
    return None


def _read_array(path: Path, dtype) -> np.ndarray:
    try:
        if path.suffix == ".npy":
            return np.load(path, allow_pickle=False).astype(dtype, copy=False)
        return np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=1).astype(dtype)
    except (ValueError, OSError) as exc:
        raise GraphFileError(f"{path}: cannot be read as a numeric array ({exc}). Write it as "
                             ".npy, or as comma-separated numbers, one row per line.") from None


def _check_features(features: np.ndarray, where: str) -> None:
    if features.ndim != 2:
        raise GraphFileError(f"{where}: node features must be a 2-D array (nodes, features), "
                             f"got shape {features.shape}.")
    bad = ~np.isfinite(features)
    if bad.any():
        node, feature = np.argwhere(bad)[0]
        raise GraphFileError(f"{where}: {int(bad.sum())} NaN or infinite feature values, the "
                             f"first at node {node}, feature {feature}; fill or drop them before "
                             "training.")


def _check_edges(edge_index: np.ndarray, nodes: int, where: str, features_where: str) -> None:
    if edge_index.size == 0:
        return
    low, high = int(edge_index.min()), int(edge_index.max())
    if low < 0 or high >= nodes:
        bad = low if low < 0 else high
        column = int(np.argwhere((edge_index == bad).any(axis=0))[0][0])
        raise GraphFileError(f"{where}: edge {column} has node id {bad}, but the graph has "
                             f"{nodes} nodes (the rows of {features_where}); node ids must lie "
                             f"in 0..{nodes - 1}.")


def _from_npz(path: Path) -> Graph:
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    need = {"indptr", "indices", "node_feat", "node_label", "train_mask", "val_mask", "test_mask"}
    if missing := need - set(arrays):
        raise GraphFileError(f"{path}: missing arrays {sorted(missing)}; write it with "
                             "`exatrain data graph` or use the edge/feature/label file layout.")
    features, labels = arrays["node_feat"].astype(np.float32), arrays["node_label"]
    _check_features(features, str(path))
    nodes = features.shape[0]
    if labels.shape[0] != nodes or arrays["indptr"].shape[0] != nodes + 1:
        raise GraphFileError(f"{path}: node_feat has {nodes} rows but node_label has "
                             f"{labels.shape[0]} entries and indptr {arrays['indptr'].shape[0]} "
                             f"(want {nodes} and {nodes + 1}).")
    rows = np.repeat(np.arange(nodes), np.diff(arrays["indptr"]))
    edge_index = np.stack([rows, arrays["indices"]])
    _check_edges(edge_index, nodes, f"{path} (indices)", f"{path} (node_feat)")
    return Graph(torch.from_numpy(edge_index.astype(np.int64)), torch.from_numpy(features),
                 torch.from_numpy(labels.astype(np.int64)),
                 *(torch.from_numpy(arrays[k].astype(bool)) for k in
                   ("train_mask", "val_mask", "test_mask")), source=str(path))


def _from_files(root: Path) -> Graph:
    folders = [root, root / "raw"]
    found = {key: _find(folders, stems) for key, stems in _NAMES.items()}
    missing = [key for key, path in found.items() if path is None]
    if missing:
        wanted = "; ".join(f"{key}: {' or '.join(s + '.npy/.csv(.gz)' for s in _NAMES[key])}"
                           for key in missing)
        raise MissingFileError(f"{root}: no graph found. Expected graph.npz (`exatrain data "
                               f"graph`) or files in {root} or {root}/raw; missing {wanted}.")
    features = _read_array(found["features"], np.float32)
    if features.ndim == 1:
        features = features[:, None]
    _check_features(features, str(found["features"]))
    nodes = features.shape[0]
    labels = _read_array(found["labels"], np.float64).reshape(-1)
    if labels.shape[0] != nodes:
        raise GraphFileError(f"{found['features']} has {nodes} rows but {found['labels']} has "
                             f"{labels.shape[0]} labels: both need one entry per node.")
    labels = np.where(np.isfinite(labels), labels, -1).astype(np.int64)
    edges = _read_array(found["edges"], np.int64)
    if edges.ndim != 2 or 2 not in edges.shape:
        raise GraphFileError(f"{found['edges']}: an edge index must have shape (2, E) or (E, 2), "
                             f"got {edges.shape}.")
    edge_index = edges if edges.shape[0] == 2 and edges.shape[1] != 2 else edges.T
    _check_edges(edge_index, nodes, str(found["edges"]), str(found["features"]))
    masks = _read_splits(root, nodes)
    return Graph(torch.from_numpy(np.ascontiguousarray(edge_index)), torch.from_numpy(features),
                 torch.from_numpy(labels), *masks, source=str(root))


def _read_splits(root: Path, nodes: int) -> list[torch.Tensor]:
    split_dirs = sorted(p for p in (root / "split").glob("*") if p.is_dir()) \
        if (root / "split").is_dir() else []
    folders = [root, root / "raw", *split_dirs]
    masks = []
    for key, stems in _SPLITS.items():
        mask_file = _find(folders, [f"{s}_mask" for s in stems])
        index_file = _find(folders, [f"{s}_idx" for s in stems] + list(stems))
        if mask_file is not None:
            mask = _read_array(mask_file, np.float64).reshape(-1).astype(bool)
            if mask.shape[0] != nodes:
                raise GraphFileError(f"{mask_file}: {mask.shape[0]} entries for {nodes} nodes.")
        elif index_file is not None:
            index = _read_array(index_file, np.int64).reshape(-1)
            if index.size and (index.min() < 0 or index.max() >= nodes):
                raise GraphFileError(f"{index_file}: node id {int(index.max())} out of range "
                                     f"0..{nodes - 1}.")
            mask = np.zeros(nodes, dtype=bool)
            mask[index] = True
        else:
            raise MissingFileError(f"{root}: no {key} split; give {stems[0]}_idx.npy / "
                                   f"{stems[0]}_mask.npy, or split/<name>/{stems[0]}.csv.gz.")
        masks.append(torch.from_numpy(mask))
    return masks


def load_graph(path: str | Path) -> Graph:
    """Read graph.npz, or a directory holding it or the edge/feature/label/split files."""
    path = Path(path)
    if path.is_file():
        return _from_npz(path)
    if not path.is_dir():
        raise MissingFileError(f"{path}: no such graph file or directory; write one with "
                               f"`exatrain data graph --out {path} --nodes 20000`.")
    if (path / "graph.npz").is_file():
        return _from_npz(path / "graph.npz")
    return _from_files(path)
