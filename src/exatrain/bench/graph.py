"""`exatrain bench graph`: full-graph GCN training, serial vs the 3D grids (2,2,1) and (2,2,2).

A generated power-law graph (`data.graph.generate_graph`: hubs first, community labels) trains a
3-layer GCN from identical initial weights everywhere. In each launch rank 0 first trains
the plain model alone (all cores, the other ranks waiting), then every rank trains the Plexus-style
3D model (parallel/graph.py, balancing permutations on). One step (plain SGD, so that the
comparison measures the strategy, not Adam's amplification of rounding in near-zero gradients)
is one epoch.

Figures:

  epoch_s                  median epoch (step) time after warm-up: "serial", and per grid the
                           slowest rank's
  max_rel_err_vs_serial    worst over grids of max|p - p_serial| / max|p_serial| for the
                           predictions (logits of every node, original order) and every weight
                           after the timed steps
  nnz_imbalance_before     max-over-ranks / mean nonzeros of the SpMM blocks in the original
                           node order (worst layer, worst grid), from the adjacency
  nnz_imbalance_after      the same, counted on the blocks the ranks actually hold after the
                           two random permutations
  bytes_by_axis            counted by the ledger, one training step, busiest rank, per grid
  bytes_formula_by_axis    parallel/graph.py's formula for the same step
  bytes_ratio              worst counted / formula over grids and axes (1.0: exactly the formula)
  cores, device            the machine; `oversubscribed` grids have more ranks than cores

On a CUDA machine the serial epoch also runs on the GPU (`epoch_s_serial_cuda`); the grids run
on CUDA with NCCL when there is one GPU per rank, else on the CPU with gloo.
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch

GRIDS = {4: (2, 2, 1), 8: (2, 2, 2)}


def add_arguments(parser) -> None:
    parser.add_argument("--worlds", default="4,8", help="world sizes (4: (2,2,1), 8: (2,2,2))")
    parser.add_argument("--nodes", type=int, default=100_000, help="nodes of the generated graph")


def _problem(nodes: int, features: int):
    from ..data.graph import generate_graph
    from ..models.gcn import GCN, normalized_adjacency

    arrays = generate_graph(nodes, classes=16, features=features, seed=0)
    indptr = torch.from_numpy(arrays["indptr"])
    rows = torch.repeat_interleave(torch.arange(nodes), indptr.diff())
    adjacency = normalized_adjacency(torch.stack([rows, torch.from_numpy(arrays["indices"])]),
                                     nodes)
    labels = torch.from_numpy(arrays["node_label"]).clone()
    labels[~torch.from_numpy(arrays["train_mask"])] = -1
    torch.manual_seed(0)
    model = GCN(adjacency, features, features, 16, layers=3, dropout=0.0)
    return model, torch.from_numpy(arrays["node_feat"]), labels


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-1)


def _train(model, x, labels, steps: int, warmup: int, device, barrier=None,
           at_warm=None) -> list[float]:
    """Epoch times of `steps` SGD steps after `warmup` ones; `at_warm()` runs when timing starts."""
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    times = []
    for i in range(warmup + steps):
        if barrier:
            barrier()
        if i == warmup and at_warm:
            at_warm()
        t0 = time.perf_counter()
        _loss(model(x), labels).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _rank_main(world: int, nodes: int, features: int, steps: int, warmup: int) -> dict:
    import torch.distributed as dist

    from ..mesh import init
    from ..parallel.graph import nnz_imbalance, parallelize_graph
    from ..plan import Plan

    grid = GRIDS[world]
    gpus = torch.cuda.device_count()
    mesh = init(Plan(tensor=grid), backend="nccl" if gpus >= world else "gloo")
    serial, x, labels = _problem(nodes, features)
    out: dict = {"grid": grid}
    if mesh.rank == 0:
        out["nnz_imbalance_before"] = nnz_imbalance(serial.adjacency, grid, layers=3)
    model = parallelize_graph(copy.deepcopy(serial), mesh, permute=True)
    device = mesh.device
    xd, labels_d = x.to(device), labels.to(device)
    reference = None
    if mesh.rank == 0:                      # the plain model alone, on every core
        threads = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)
        out["serial_times"] = _train(serial, x, labels, steps, warmup, torch.device("cpu"))
        torch.set_num_threads(threads)
        if torch.cuda.is_available():
            gpu = copy.deepcopy(serial).cuda()
            xc, lc = x.cuda(), labels.cuda()
            out["serial_cuda_times"] = _train(gpu, xc, lc, steps, warmup, torch.device("cuda"))
        with torch.no_grad():
            reference = {"predictions": serial(x), **dict(serial.named_parameters())}
    dist.barrier()
    marks = []
    times = _train(model, xd, labels_d, steps, warmup, device, barrier=dist.barrier,
                   at_warm=lambda: marks.append(mesh.ledger.snapshot()))
    delta = mesh.ledger.since(marks[0])
    out["times"] = times
    out["bytes_by_axis"] = {a: b // steps for a, b in delta.bytes_by_axis().items()}
    out["bytes_formula_by_axis"] = model.bytes_per_step()
    out["nnz_per_layer"] = [conv.block.nnz for conv in model.convs]
    with torch.no_grad():
        predictions = model(xd).cpu()
    weights = model.plain_state_dict()
    if reference is not None:
        errs = {"predictions": _rel(predictions, reference["predictions"])}
        errs.update({k: _rel(w, reference[k]) for k, w in weights.items()})
        out["rel_err_vs_serial"] = max(errs.values())
        out["worst_tensor"] = max(errs, key=errs.get)
    mesh.close()
    return out


def run(args) -> dict:
    from ..launch import spawn

    nodes = getattr(args, "nodes", 100_000)
    features = args.size or 128
    steps = args.steps or 5
    warmup = args.warmup
    worlds = [int(w) for w in str(getattr(args, "worlds", "4,8")).split(",") if w.strip()]
    cores = os.cpu_count() or 1
    result: dict = {"graph": f"power-law, {nodes} nodes, average degree 10, hubs first",
                    "model": f"GCN 3 layers, {features} features, hidden {features}, 16 classes",
                    "timed_epochs": steps, "warmup_epochs": warmup, "cores": cores,
                    "device": "cuda" if torch.cuda.is_available() else "cpu",
                    "epoch_s": {}, "bytes_by_axis": {}, "bytes_formula_by_axis": {},
                    "rel_err_vs_serial": {}, "nnz_imbalance_by_grid": {}}
    before, after, ratios = [], [], []
    for world in worlds:
        per_rank = spawn(_rank_main, world, args=(world, nodes, features, steps, warmup))
        label = "grid=({},{},{})".format(*GRIDS[world])
        first = per_rank[0]
        result["epoch_s"].setdefault("serial", statistics.median(first["serial_times"]))
        if "serial_cuda_times" in first:
            result["epoch_s_serial_cuda"] = statistics.median(first["serial_cuda_times"])
        result["epoch_s"][label] = max(statistics.median(r["times"]) for r in per_rank)
        result[f"{label}_oversubscribed"] = world > cores
        axes = {a for r in per_rank for a in (*r["bytes_by_axis"], *r["bytes_formula_by_axis"])}
        counted = {a: max(r["bytes_by_axis"].get(a, 0) for r in per_rank) for a in axes}
        formula = {a: max(r["bytes_formula_by_axis"].get(a, 0) for r in per_rank) for a in axes}
        result["bytes_by_axis"][label] = counted
        result["bytes_formula_by_axis"][label] = formula
        ratios += [counted[a] / formula[a] if formula[a] else float("inf") for a in axes]
        result["rel_err_vs_serial"][label] = first["rel_err_vs_serial"]
        result.setdefault("worst_tensor", {})[label] = first["worst_tensor"]
        # per layer: the blocks the ranks hold (ranks holding copies of a block count once each)
        layers = len(first["nnz_per_layer"])
        worst_after = max(max(r["nnz_per_layer"][i] for r in per_rank) /
                          statistics.mean(r["nnz_per_layer"][i] for r in per_rank)
                          for i in range(layers))
        result["nnz_imbalance_by_grid"][label] = {"before": first["nnz_imbalance_before"],
                                                  "after": worst_after}
        before.append(first["nnz_imbalance_before"])
        after.append(worst_after)
    result["nnz_imbalance_before"] = max(before)
    result["nnz_imbalance_after"] = max(after)
    result["max_rel_err_vs_serial"] = max(result["rel_err_vs_serial"].values())
    result["bytes_ratio"] = max(ratios) if ratios else float("nan")
    result["bytes_ratio_min"] = min(ratios) if ratios else float("nan")
    serial = result["epoch_s"]["serial"]
    for label, t in result["epoch_s"].items():
        if label != "serial":
            result[f"{label}_speedup_vs_serial"] = serial / t
    return result
