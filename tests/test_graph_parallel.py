"""The 3D-parallel GCN (parallel/graph.py) equals the serial GCN.

One spawned function per world size loops over its grids: (2,1,1), (1,2,1), (1,1,2) on 2 ranks,
(2,2,1) and data=2 × (2,1,1) on 4, (2,2,2) on 8; 37 nodes (divides no grid), 6 input features
and 5 classes (padded on every grid). Per grid, with and without the balancing permutations:

  layer     one forward/backward of a single GraphConv, features requiring a gradient:
            output, input gradient and weight/bias gradients (gathered whole) against serial
  training  a 3-layer GCN, 3 Adam steps on masked cross-entropy: predictions (in the original
            node order) and weights against serial, fp32 relative ≤ 1e-5
  bytes     the ledger's count of one training step equals the docstring formula, per axis
  checkpoint  the trained weights saved as DTensors (as the Trainer does) read back whole
            exactly (the cube's weight layouts need strided DTensor placements)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from harness import rel_err, run_ranks

TOL = 1e-5
NODES, IN, HIDDEN, CLASSES = 37, 6, 8, 5


def _graph(seed: int = 0):
    from exatrain.models.gcn import normalized_adjacency

    gen = torch.Generator().manual_seed(seed)
    # a hub (node 0) and random edges: skewed like the real thing, tiny
    src = torch.cat([torch.zeros(15, dtype=torch.long), torch.randint(0, NODES, (60,), generator=gen)])
    dst = torch.randint(0, NODES, (75,), generator=gen)
    adjacency = normalized_adjacency(torch.stack([src, dst]), NODES)
    x = torch.randn(NODES, IN, generator=gen)
    labels = torch.randint(0, CLASSES, (NODES,), generator=gen)
    labels[torch.rand(NODES, generator=gen) < 0.4] = -1          # unlabelled nodes
    return adjacency, x, labels


def _loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-1)


def _checkpoint_round_trip(model, path) -> float:
    """Save the split model as DTensors (what the Trainer's checkpoints do), read it back as
    whole tensors: worst error against the gathered weights (0 unless a layout is misread)."""
    import torch.distributed.checkpoint as dcp

    from exatrain.parallel.tensor.state import for_checkpoint, full_shape

    dcp.save({"model": for_checkpoint(model, model.state_dict())}, checkpoint_id=str(path))
    whole = {k: torch.zeros(full_shape(p.shape, p.exatrain_layout))
             for k, p in model.named_parameters()}
    dcp.load({"model": whole}, checkpoint_id=str(path))
    errs = []
    for name, w in model.plain_state_dict().items():
        conv = model.convs[int(name.split(".")[1])]
        full = whole[name]
        full = full[:conv.in_features, :conv.out_features] if full.dim() == 2 \
            else full[:conv.out_features]
        errs.append(float((full - w).abs().max()))
    return max(errs)


def graph_cases(plans, folder, steps: int = 3) -> dict:
    from exatrain.mesh import init
    from exatrain.models.gcn import GCN
    from exatrain.parallel.graph import parallelize_graph
    from exatrain.plan import Plan

    adjacency, x, labels = _graph()
    results = {}
    for degrees in plans:
        mesh = init(Plan(**degrees))
        data = mesh.axis("data")
        for permute in (False, True):
            key = f"{degrees} permute={permute}"
            errs: dict[str, float] = {}
            # ---- one layer, input needing a gradient
            torch.manual_seed(1)
            one = GCN(adjacency, IN, HIDDEN, CLASSES, layers=1, dropout=0.0)
            dist_one = parallelize_graph(copy.deepcopy(one), mesh, permute=permute)
            weight = torch.randn(NODES, CLASSES)
            xs, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
            ys, yd = one(xs), dist_one(xd)
            (ys * weight).sum().backward()
            (yd * weight).sum().backward()
            errs["layer out"] = rel_err(yd, ys)
            errs["layer dx"] = rel_err(xd.grad, xs.grad)
            for name, grad in dist_one.plain_state_dict(grads=True).items():
                errs[f"layer d{name}"] = rel_err(grad, dict(one.named_parameters())[name].grad)
            # ---- 3 layers, Adam steps; data replicas take equal shares of the labelled nodes
            torch.manual_seed(2)
            serial = GCN(adjacency, IN, HIDDEN, CLASSES, layers=3, dropout=0.0)
            model = parallelize_graph(copy.deepcopy(serial), mesh, permute=permute)
            labelled = (labels >= 0).nonzero().flatten()
            labelled = labelled[:len(labelled) // 2 * 2]
            shares = torch.full((2, NODES), -1)
            for r in range(2):
                part = labelled[r::2]
                shares[r, part] = labels[part]
            batch = x.expand(data.size if data.size > 1 else 2, -1, -1)
            opt_s = torch.optim.Adam(serial.parameters(), lr=0.05)
            opt_d = torch.optim.Adam(model.parameters(), lr=0.05)
            counted = formula = None
            for step in range(steps):
                _loss(serial(batch), shares).backward()
                opt_s.step()
                opt_s.zero_grad()
                mine = slice(data.rank, data.rank + 1) if data.size > 1 else slice(0, 2)
                mark = mesh.ledger.snapshot()
                _loss(model(batch[mine]), shares[mine]).backward()
                delta = mesh.ledger.since(mark)
                counted = {}
                for (axis, _op, tag), entry in delta.entries.items():
                    counted[axis] = counted.get(axis, 0) + entry.bytes
                formula = model.bytes_per_step()
                opt_d.step()
                opt_d.zero_grad()
            with torch.no_grad():
                errs["trained predictions"] = rel_err(model(x), serial(x))
            for name, w in model.plain_state_dict().items():
                errs[f"trained {name}"] = rel_err(w, dict(serial.named_parameters())[name])
            errs["checkpoint"] = _checkpoint_round_trip(model, f"{folder}/{len(results)}")
            results[key] = {"errs": errs, "counted": counted, "formula": formula}
    return results


def _check(results):
    for per_rank in results:
        for key, r in per_rank.items():
            worst = max(r["errs"], key=r["errs"].get)
            assert r["errs"][worst] <= TOL, (key, worst, r["errs"][worst])
            assert r["counted"] == r["formula"], (key, r["counted"], r["formula"])


def test_graph_conv_on_lines_of_two(tmp_path):
    _check(run_ranks(2, graph_cases, [dict(tensor=(2, 1, 1)), dict(tensor=(1, 2, 1)),
                                      dict(tensor=(1, 1, 2))], str(tmp_path)))


def test_graph_conv_on_a_square_and_with_data(tmp_path):
    _check(run_ranks(4, graph_cases, [dict(tensor=(2, 2, 1)), dict(data=2, tensor=(2, 1, 1))],
                     str(tmp_path)))


def test_graph_conv_on_the_cube(tmp_path):
    # the weights' depth shard lies across the mesh order here: checkpoints need _StridedShard
    _check(run_ranks(8, graph_cases, [dict(tensor=(2, 2, 2))], str(tmp_path)))


def test_balancing_evens_the_nonzeros_of_a_skewed_graph():
    from exatrain.data.graph import generate_graph
    from exatrain.models.gcn import normalized_adjacency
    from exatrain.parallel.graph import balancing_permutations, nnz_imbalance

    arrays = generate_graph(4000, seed=1)
    rows = torch.repeat_interleave(torch.arange(4000), torch.from_numpy(arrays["indptr"]).diff())
    adjacency = normalized_adjacency(torch.stack([rows, torch.from_numpy(arrays["indices"])]), 4000)
    before = nnz_imbalance(adjacency, (2, 2, 2), layers=3)
    after = nnz_imbalance(adjacency, (2, 2, 2), layers=3,
                          permutations=balancing_permutations(4000, seed=0))
    assert before > 1.5 and after < 1.1, (before, after)


def test_bench_graph_writes_its_figures(tmp_path):
    import json

    from exatrain.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "graph", "--worlds", "4", "--nodes", "3000", "--size", "16",
                 "--steps", "1", "--warmup", "0", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in ("max_rel_err_vs_serial", "nnz_imbalance_before", "nnz_imbalance_after",
                "bytes_by_axis", "bytes_formula_by_axis", "epoch_s", "cores"):
        assert key in r, key
    assert r["bytes_ratio"] == r["bytes_ratio_min"] == 1.0       # counted = formula, every axis
    assert r["nnz_imbalance_after"] <= 1.10 < r["nnz_imbalance_before"]
    assert r["max_rel_err_vs_serial"] <= 1e-5
    assert set(r["epoch_s"]) == {"serial", "grid=(2,2,1)"}
