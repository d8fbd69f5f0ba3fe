"""Graph and molecule data: the generator and reader (our archive and the OGB file layout), clear
errors for bad files, the QM9 conversion of the real qm9pack CSVs, and both workloads training
in-process through the Trainer."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from exatrain.data.graph import GraphFileError, generate_graph, load_graph, write_graph

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_qm9_reader_holds_every_molecule_with_the_csv_values(qm9_dir):
    from exatrain.data.qm9 import HARTREE_EV, MOLECULES, QM9Dataset, load_qm9

    a = load_qm9(qm9_dir)
    assert len(a["index"]) == MOLECULES == 130_831
    # first row of qm9_part1.csv: methane, dsgdb9nsd_000001
    assert a["index"][0] == 1 and a["n_atoms"][0] == 5
    assert a["z"][0, :6].tolist() == [6, 1, 1, 1, 1, 0]
    np.testing.assert_allclose(a["pos"][0, 0], [-0.0126981359, 1.0858041578, 0.0080009958],
                               rtol=1e-6)
    assert a["gap_hartree"][0] == 0.5048 and a["homo_hartree"][0] == -0.3877
    # last row of qm9_part3.csv: dsgdb9nsd_133885, C7H7NO
    assert a["index"][-1] == 133885 and a["n_atoms"][-1] == 16
    assert a["z"][-1, :16].tolist() == [6, 7, 6, 6, 6, 8, 6, 6, 6] + [1] * 7
    assert a["gap_hartree"][-1] == 0.3058 and a["lumo_hartree"][-1] == 0.0742
    atoms, gap = QM9Dataset(a, [0])[0]
    assert atoms.shape == (29, 4) and gap.item() == pytest.approx(0.5048 * HARTREE_EV, rel=1e-6)


def test_generated_graph_round_trips_and_is_skewed(tmp_path):
    info = write_graph(tmp_path / "g", nodes=3000, seed=2)
    graph = load_graph(tmp_path / "g")
    assert graph.num_nodes == 3000 and info["max_degree"] > 10 * info["mean_degree"]
    assert (graph.train_mask ^ graph.val_mask ^ graph.test_mask).all()
    degrees = torch.bincount(graph.edge_index[0], minlength=3000)
    assert degrees[:300].sum() > 3 * degrees[-300:].sum()        # hubs first


def _write_ogb(root, arrays, features=None, edges=None, labels=None):
    """OGB's node-property layout as files: raw/*.csv.gz and split/random/*.csv.gz."""
    raw, split = root / "raw", root / "split" / "random"
    raw.mkdir(parents=True)
    split.mkdir(parents=True)
    rows = np.repeat(np.arange(len(arrays["indptr"]) - 1), np.diff(arrays["indptr"]))
    edge = edges if edges is not None else np.stack([rows, arrays["indices"]], 1)
    feat = features if features is not None else arrays["node_feat"]
    label = labels if labels is not None else arrays["node_label"]
    for name, value, fmt in (("edge", edge, "%d"), ("node-feat", feat, "%.7g"),
                             ("node-label", label[:, None], "%d")):
        with gzip.open(raw / f"{name}.csv.gz", "wt") as f:
            np.savetxt(f, value, fmt=fmt, delimiter=",")
    for mask, name in (("train_mask", "train"), ("val_mask", "valid"), ("test_mask", "test")):
        with gzip.open(split / f"{name}.csv.gz", "wt") as f:
            np.savetxt(f, np.flatnonzero(arrays[mask]), fmt="%d")
    return root


def test_ogb_layout_reads_like_the_archive(tmp_path):
    arrays = generate_graph(200, seed=3)
    graph = load_graph(_write_ogb(tmp_path / "ogb", arrays))
    assert graph.num_nodes == 200
    torch.testing.assert_close(graph.features, torch.from_numpy(arrays["node_feat"]))
    assert torch.equal(graph.labels, torch.from_numpy(arrays["node_label"]))
    assert torch.equal(graph.val_mask, torch.from_numpy(arrays["val_mask"]))
    assert graph.edge_index.shape[1] == len(arrays["indices"])


def test_bad_graph_files_name_the_file(tmp_path):
    arrays = generate_graph(50, seed=4)
    edges = np.stack([np.arange(10), np.arange(10) + 1], 1)
    edges[3, 1] = 77
    with pytest.raises(GraphFileError, match=r"edge\.csv\.gz.*node id 77.*50 nodes"):
        load_graph(_write_ogb(tmp_path / "range", arrays, edges=edges))
    with pytest.raises(GraphFileError, match=r"node-feat\.csv\.gz has 49 rows.*node-label"):
        load_graph(_write_ogb(tmp_path / "rows", arrays, features=arrays["node_feat"][:49]))
    feat = arrays["node_feat"].copy()
    feat[7, 2] = np.nan
    with pytest.raises(GraphFileError, match=r"node-feat\.csv\.gz: 1 NaN.*node 7, feature 2"):
        load_graph(_write_ogb(tmp_path / "nan", arrays, features=feat))
    # the same checks on .npy files and on our archive
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "edge_index.npy", np.array([[0, 1], [1, 60]]))
    np.save(tmp_path / "npy" / "node_feat.npy", arrays["node_feat"])
    np.save(tmp_path / "npy" / "node_label.npy", arrays["node_label"])
    with pytest.raises(GraphFileError, match=r"edge_index\.npy: edge 1 has node id 60"):
        load_graph(tmp_path / "npy")
    bad = dict(arrays, node_feat=feat)
    np.savez(tmp_path / "bad.npz", **bad)
    with pytest.raises(GraphFileError, match=r"bad\.npz: 1 NaN"):
        load_graph(tmp_path / "bad.npz")
    with pytest.raises(FileNotFoundError, match="exatrain data graph"):
        load_graph(tmp_path / "nowhere")


def test_data_graph_command(tmp_path):
    from exatrain.cli import main

    assert main(["data", "graph", "--out", str(tmp_path / "g"), "--nodes", "400"]) == 0
    assert load_graph(tmp_path / "g").num_nodes == 400


def test_gcn_and_qm9_workloads_learn_through_the_trainer(tmp_path, qm9_dir):
    from exatrain.train.config import load_config
    from exatrain.train.run import run_job

    torch.set_num_threads(1)
    gcn = load_config(EXAMPLES / "gcn.toml", [
        f"data.path={tmp_path}/graph", "data.nodes=3000", "plan.tensor=[1]", "train.steps=30",
        "train.eval_every=0", f"run.out_dir={tmp_path}/runs", "train.checkpoint_every=0"])
    from exatrain.workloads import gcn as gcn_workload
    gcn_workload.prepare(gcn)
    summary = run_job(gcn)
    assert summary["val_accuracy"] > 0.8 > 3 * summary["majority_class_accuracy"]
    qm9 = load_config(EXAMPLES / "qm9.toml", [
        f"data.path={qm9_dir}", "data.train_molecules=640", "data.val_molecules=64",
        "train.steps=20", "train.eval_every=0", "model.features=16", "model.interactions=1",
        f"run.out_dir={tmp_path}/runs"])
    summary = run_job(qm9)
    assert summary["val_gap_mae_ev"] < 1.5 * summary["baseline_mae"]   # runs; learning: README
    assert summary["published_schnet_gap_mae_ev"] == 0.063


def test_schnet_sees_each_molecule_alone(qm9_dir):
    """A molecule's prediction does not depend on the batch around it (padding, pair building,
    scatters) nor on rotating it (distances only)."""
    from exatrain.data.qm9 import QM9Dataset, load_qm9
    from exatrain.models.schnet import SchNet

    data = QM9Dataset(load_qm9(qm9_dir), [0, 5, 130_830, 77])
    torch.manual_seed(0)
    model = SchNet(features=16, interactions=2, rbf=8)
    batch = model(data.atoms)
    alone = torch.cat([model(data.atoms[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-6)
    angle = torch.tensor(0.7)
    rotation = torch.tensor([[angle.cos(), -angle.sin(), 0], [angle.sin(), angle.cos(), 0],
                             [0, 0, 1]])
    turned = data.atoms.clone()
    turned[..., 1:] = turned[..., 1:] @ rotation.T
    torch.testing.assert_close(model(turned), batch, rtol=1e-5, atol=1e-5)


def test_schnet_equals_its_formula_over_an_edge_list():
    """The dense, masked SchNet against the paper's formula written over an explicit edge list
    (pairs i ≠ j of real atoms within the cutoff), for a padded batch of two molecules."""
    import math as _math
    from exatrain.models.schnet import SchNet, shifted_softplus

    torch.manual_seed(1)
    model = SchNet(features=8, interactions=2, rbf=6, cutoff=2.5).double()
    atoms = torch.zeros(2, 5, 4, dtype=torch.float64)
    atoms[0, :4, 0] = torch.tensor([6.0, 1.0, 8.0, 1.0])
    atoms[1, :3, 0] = torch.tensor([7.0, 1.0, 1.0])
    atoms[..., 1:] = torch.randn(2, 5, 3, dtype=torch.float64) * 1.2
    expected = []
    for b in range(2):
        n = int((atoms[b, :, 0] > 0).sum())
        z, pos = atoms[b, :n, 0].long(), atoms[b, :n, 1:]
        x = model.embedding(z)
        for block in model.interactions:
            m = torch.zeros_like(x)
            for i in range(n):
                for j in range(n):
                    d = (pos[i] - pos[j]).norm()
                    if i == j or d >= model.cutoff:
                        continue
                    e = torch.exp(-model.gamma * (d - model.centres) ** 2)
                    w = block.filter2(shifted_softplus(block.filter1(e))) * \
                        0.5 * (torch.cos(d * _math.pi / model.cutoff) + 1.0)
                    m[i] += block.into(x)[j] * w
            x = x + block.out2(shifted_softplus(block.out1(m)))
        y = model.head2(shifted_softplus(model.head1(x))).mean()
        expected.append(y * model.target[1] + model.target[0])
    torch.testing.assert_close(model(atoms), torch.stack(expected), rtol=1e-10, atol=1e-12)
