"""`exatrain predict` / `et.predict`: a trained CosmoFlow run's predictions, serial and under
space=(1, 1, 2) and data=2, written to HDF5 in sample order with their ids; and its errors."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import exatrain as et
from conftest import TINY
from exatrain.cli import main
from exatrain.train.config import load_config
from exatrain.infer.predict import PredictError, check_plan, predict, replica_batches
from exatrain.train.run import run_job
from harness import rel_err, run_ranks


@pytest.fixture(scope="module")
def trained(cosmo_data, tmp_path_factory):
    """A tiny CosmoFlow run, two steps, serial: its run directory."""
    out = tmp_path_factory.mktemp("predict-runs")
    config = load_config(None, [*TINY, f"data.path={cosmo_data}", f"run.out_dir={out}",
                                "train.steps=2", "train.eval_every=0"])
    return Path(run_job(config)["run_dir"])


def _read(path) -> dict:
    with h5py.File(path, "r") as f:
        return {**{k: f[k][...] for k in f}, "attrs": dict(f.attrs)}


def _predict_rank(run_dir: str, data, out: str, plan: et.Plan, batch_size: int = 0,
                  overrides=()) -> dict:
    return predict(run_dir, data, out, plan, batch_size=batch_size, overrides=overrides,
                   verbose=False)


def test_predict_under_space_equals_serial(trained, cosmo_data, tmp_path):
    """The issue's test: two spawned gloo ranks, each sample split in two along w."""
    space = run_ranks(2, _predict_rank, str(trained), None, str(tmp_path / "space.h5"),
                      et.Plan(space=(1, 1, 2)))
    serial = predict(trained, None, tmp_path / "serial.h5", verbose=False)
    a, b = _read(tmp_path / "serial.h5"), _read(tmp_path / "space.h5")
    assert a["predictions"].shape == (6, 4) and a["attrs"]["plan"] == "Plan()"
    assert b["attrs"]["plan"] == "Plan(space=(1, 1, 2))" and b["attrs"]["world_size"] == 2
    assert rel_err(torch.from_numpy(b["predictions"]), torch.from_numpy(a["predictions"])) <= 1e-5
    assert list(b["sample_id"]) == list(a["sample_id"]) == [str(i).encode() for i in range(6)]
    np.testing.assert_array_equal(b["targets"], a["targets"])
    assert space[0]["mae"] == space[1]["mae"] == pytest.approx(serial["mae"], rel=1e-5)
    # rank 0 read only its half of each of the 6 cubes with their targets (and the 6 targets
    # once more, for the workload's predict-the-mean baseline)
    cube = 16 ** 3 * 4 * 2
    assert space[0]["input_bytes_read_rank0"] == 6 * (cube // 2 + 16) + 6 * 16
    # what the file says: the run, its step, the targets' names, physical values and units
    attrs = a["attrs"]
    assert attrs["step"] == 2 and Path(attrs["run_dir"]) == trained.resolve()
    assert list(attrs["output_names"]) == ["Omega_m", "sigma_8", "n_s", "H0"]
    with h5py.File(Path(cosmo_data) / "val.h5") as f:  # the generator's own record
        low, high, params = f.attrs["param_low"], f.attrs["param_high"], f["params"][...]
    np.testing.assert_allclose(a["predictions_physical"],
                               low + (a["predictions"] + 1) / 2 * (high - low), rtol=1e-6)
    np.testing.assert_allclose(a["targets_physical"], params, rtol=1e-5)
    with h5py.File(tmp_path / "serial.h5") as f:
        assert list(f["predictions_physical"].attrs["units"]) == ["", "", "", "km/s/Mpc"]
    assert serial["mae"] == pytest.approx(np.abs(a["predictions"] - a["targets"]).mean(), rel=1e-6)


def test_predict_under_zero_2_equals_serial(trained, tmp_path):
    """The model state loads into ZeRO-2's layout (each rank steps shards) without an optimizer."""
    run_ranks(2, _predict_rank, str(trained), None, str(tmp_path / "zero.h5"), et.Plan(shard=2),
              0, ["parallel.zero_stage=2"])
    predict(trained, None, tmp_path / "serial.h5", verbose=False)
    a, b = _read(tmp_path / "serial.h5"), _read(tmp_path / "zero.h5")
    assert b["attrs"]["plan"] == "Plan(shard=2)"
    assert rel_err(torch.from_numpy(b["predictions"]), torch.from_numpy(a["predictions"])) <= 1e-5


def test_python_call_on_data_2_writes_one_file_in_sample_order(trained, cosmo_data, tmp_path):
    """et.predict with a 2-rank Plan and no launcher starts its ranks itself. 42 samples in
    global batches of 8: the last (2 samples) leaves replica 1 only a padding sample, whose
    output is dropped; one file, in sample order, no duplicates."""
    data = et.predict(trained, cosmo_data / "train.h5", tmp_path / "data.h5", plan=et.Plan(data=2),
                      batch_size=8, verbose=False)
    serial = predict(trained, cosmo_data / "train.h5", tmp_path / "serial.h5", batch_size=8,
                     verbose=False)
    c, d = _read(tmp_path / "serial.h5"), _read(tmp_path / "data.h5")
    assert d["predictions"].shape == (42, 4) and d["attrs"]["plan"] == "Plan(data=2)"
    np.testing.assert_array_equal(d["index"], np.arange(42))
    assert list(d["sample_id"]) == list(c["sample_id"])
    np.testing.assert_array_equal(d["targets"], c["targets"])
    assert rel_err(torch.from_numpy(d["predictions"]), torch.from_numpy(c["predictions"])) <= 1e-5
    assert data["samples"] == serial["samples"] == 42


def test_cli_predicts_mlperf_files_with_their_names_as_ids(trained, cosmo_data, tmp_path, capfd):
    """One rank, from the command line, on a directory of MLPerf per-sample files."""
    folder = tmp_path / "mlperf"
    folder.mkdir()
    with h5py.File(cosmo_data / "val.h5") as f:
        for i, name in enumerate(["univ_b", "univ_a", "univ_c"]):
            with h5py.File(folder / f"{name}.h5", "w") as g:
                g["full"], g["unitPar"] = f["x"][i], f["y"][i]
    assert main(["predict", str(trained), "--data", str(folder), "--out",
                 str(tmp_path / "p.h5")]) == 0
    text = capfd.readouterr().out
    assert "3 samples" in text and "samples/s" in text and "MAE vs targets" in text
    got = _read(tmp_path / "p.h5")
    assert list(got["sample_id"]) == [b"univ_a", b"univ_b", b"univ_c"]  # the reader's order
    serial = _read(predict(trained, cosmo_data / "val.h5", tmp_path / "v.h5",
                           verbose=False)["out"])
    # the same samples in another batch: equal up to float32 rounding (relative to the largest)
    assert rel_err(torch.from_numpy(got["predictions"]),
                   torch.from_numpy(serial["predictions"][[1, 0, 2]])) <= 1e-5


def test_errors_name_the_value_and_the_fix(trained, tmp_path, capfd):
    empty = tmp_path / "no-checkpoint"
    empty.mkdir()
    (empty / "config.toml").write_text((trained / "config.toml").read_text())
    with pytest.raises(PredictError, match="holds no complete checkpoint.*--resume"):
        predict(empty, out=tmp_path / "x.h5")
    with pytest.raises(PredictError, match="not a run directory"):
        predict(tmp_path / "nowhere")
    with pytest.raises(PredictError, match="--step 7: no complete checkpoint.*has \\[2\\]"):
        predict(trained, step=7)
    small = tmp_path / "cubes8"
    from exatrain.data.cosmoflow_synth import write_cosmoflow
    write_cosmoflow(small, samples=2, size=8, seed=0, val_fraction=0.5)
    with pytest.raises(PredictError, match=r"holds 8×8×8 samples .* takes 16³ samples "
                                           r"\(model.size=16.*--size 16"):
        predict(trained, small, tmp_path / "x.h5")
    assert not (tmp_path / "x.h5").exists()
    # from the command line: exit 2, one line, before any rank starts
    assert main(["predict", str(empty)]) == 2
    assert main(["predict", str(trained), "--data", str(tmp_path / "missing.h5")]) == 2
    assert main(["predict", str(trained), "--nproc", "3", "--set", "plan.space=[1,1,2]"]) == 2
    err = capfd.readouterr().err
    assert "no complete checkpoint" in err and "missing.h5: no such file" in err
    assert "does not divide the world size 3" in err


def test_replica_batches_cover_every_sample_once_and_pad_with_one():
    n, per, replicas = 9, 2, 3
    batches = [replica_batches(n, per, replicas, r) for r in range(replicas)]
    assert {len(b) for b in batches} == {2}  # every replica runs the same number of batches
    kept = [i for b in range(2) for r in range(replicas)
            for i in batches[r][b][:max(0, min(per, n - (b * replicas + r) * per))]]
    assert kept == list(range(n))
    assert batches[1][1] == [8]  # the last sample, in replica 1's short slice of the last batch
    assert batches[2][1] == [8]  # replica 2's slice is empty: one padding sample, dropped
    with pytest.raises(PredictError, match="tensor axis is not supported.*plan.tensor=1"):
        check_plan(et.Plan(tensor=2))


USER_MODULE = '''
from dataclasses import dataclass
import torch.nn.functional as F
from torch import nn
import exatrain as et

@dataclass
class DataOptions:
    path: str = "train.h5"

def build(data: DataOptions) -> et.Task:
    ds = et.data.HDF5Dataset(data.path, x="inputs", y="outputs")
    return et.Task(model=nn.Linear(6, 2), train_set=ds, val_set=ds, loss=F.mse_loss)
'''


def test_a_user_workload_predicts_its_own_hdf5_layout(tmp_path):
    rng = np.random.default_rng(0)
    for name, n, width in (("train.h5", 16, 6), ("new.h5", 5, 6), ("wide.h5", 3, 7)):
        x = rng.normal(size=(n, width)).astype(np.float32)
        with h5py.File(tmp_path / name, "w") as f:
            f["inputs"], f["outputs"] = x, x[:, :2] * 2
    (tmp_path / "mine.py").write_text(USER_MODULE)
    config = load_config(None, [f"run.workload='{tmp_path / 'mine.py'}'",
                                f"data.path='{tmp_path / 'train.h5'}'", f"run.out_dir='{tmp_path}'",
                                "train.steps=2", "train.batch_size=4", "train.log_every=1"])
    run_dir = run_job(config)["run_dir"]
    got = predict(run_dir, tmp_path / "new.h5", tmp_path / "p.h5", verbose=False)
    out = _read(tmp_path / "p.h5")
    assert got["samples"] == 5 and out["predictions"].shape == (5, 2)
    assert list(out["sample_id"]) == [str(i).encode() for i in range(5)]
    with pytest.raises(PredictError, match=r"shape \(7,\) \('inputs'\).*shape \(6,\)"):
        predict(run_dir, tmp_path / "wide.h5", tmp_path / "w.h5", verbose=False)


HEADS_MODULE = '''
from dataclasses import dataclass
import torch
import torch.nn.functional as F
from torch import nn
import exatrain as et

class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.field, self.mask = nn.Linear(16, 2), nn.Linear(16, 1)

    def forward(self, x):
        h = self.trunk(x)
        return {"field": self.field(h), "mask": self.mask(h), "aux": h.square().mean()}

def loss(output, target):
    return (F.mse_loss(output["field"], target[:, :2]) + F.mse_loss(output["mask"], target[:, 2:])
            + 1e-2 * output["aux"])

@dataclass
class DataOptions:
    path: str = "train.h5"

def build(data: DataOptions) -> et.Task:
    ds = et.data.HDF5Dataset(data.path, x="inputs", y="outputs")
    return et.Task(model=TwoHeads(), train_set=ds, val_set=ds, loss=loss)
'''


def test_a_model_of_several_outputs_predicts_each_into_a_dataset_of_its_own(tmp_path):
    """A dict of two heads and a 0-dim auxiliary loss (not per sample, so not written):
    `predictions/field` and `predictions/mask`, each the trained model's
    output for every sample, in sample order, the same under data=2 (7 samples in batches of 4:
    the last replica's slice is a padding sample) as on one rank."""
    import importlib.util

    from exatrain.train.checkpoints import checkpoint

    rng = np.random.default_rng(1)
    for name, n in (("train.h5", 16), ("new.h5", 7)):
        x = rng.normal(size=(n, 6)).astype(np.float32)
        with h5py.File(tmp_path / name, "w") as f:
            f["inputs"], f["outputs"] = x, np.tanh(x[:, :3])
    (tmp_path / "heads.py").write_text(HEADS_MODULE)
    config = load_config(None, [f"run.workload='{tmp_path / 'heads.py'}'",
                                f"data.path='{tmp_path / 'train.h5'}'", f"run.out_dir='{tmp_path}'",
                                "train.steps=3", "train.batch_size=4", "train.eval_every=0"])
    run_dir = run_job(config)["run_dir"]
    new = tmp_path / "new.h5"
    serial = predict(run_dir, new, tmp_path / "one.h5", batch_size=4, verbose=False)
    data = et.predict(run_dir, new, tmp_path / "two.h5", plan=et.Plan(data=2), batch_size=4,
                      verbose=False)
    assert serial["samples"] == data["samples"] == 7
    spec = importlib.util.spec_from_file_location("heads", tmp_path / "heads.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TwoHeads()
    model.load_state_dict(checkpoint.full_model_state(checkpoint.latest(Path(run_dir))))
    with h5py.File(new, "r") as f, torch.no_grad():
        want = model(torch.from_numpy(f["inputs"][...]))
    for path in (tmp_path / "one.h5", tmp_path / "two.h5"):
        with h5py.File(path, "r") as f:
            assert sorted(f["predictions"]) == ["field", "mask"]
            np.testing.assert_array_equal(f["index"][...], np.arange(7))
            assert f["targets"].shape == (7, 3)
            for head in ("field", "mask"):
                got = torch.from_numpy(f[f"predictions/{head}"][...])
                assert got.shape == want[head].shape, (path, head)
                assert rel_err(got, want[head]) <= 1e-6, (path, head)


GRAPHS_MODULE = '''
import sys
sys.path.insert(0, {tests!r})
import torch.nn.functional as F
import exatrain as et
from user_models import GraphNet, Molecules, collate_graphs


def build():
    return et.Task(model=GraphNet(), train_set=Molecules(), val_set=Molecules(), loss=F.mse_loss,
                   collate_fn=collate_graphs)
'''


def test_a_model_on_graphs_predicts_one_row_per_graph_with_its_collate_fn(tmp_path):
    """Molecules of 3 to 7 atoms, batched by the Task's collate_fn: prediction batches them the
    same way and writes one row per graph, in sample order, equal to the trained model's own
    forward (it counted a batch's rows by its first input, the atoms, before)."""
    import sys

    from exatrain.train.checkpoints import checkpoint

    sys.path.insert(0, str(Path(__file__).parent))
    from user_models import GraphNet, Molecules, collate_graphs

    (tmp_path / "graphs.py").write_text(GRAPHS_MODULE.format(tests=str(Path(__file__).parent)))
    config = load_config(None, [f"run.workload='{tmp_path / 'graphs.py'}'",
                                f"run.out_dir='{tmp_path}'", "train.steps=2",
                                "train.batch_size=4", "train.eval_every=0",
                                "train.num_workers=0"])
    run_dir = run_job(config)["run_dir"]
    done = predict(run_dir, out=tmp_path / "graphs.h5", batch_size=3, verbose=False)
    assert done["samples"] == 8
    model = GraphNet()
    model.load_state_dict(checkpoint.full_model_state(checkpoint.latest(Path(run_dir))))
    with torch.no_grad():
        want = model(*collate_graphs([Molecules()[i] for i in range(8)])[0])
    with h5py.File(tmp_path / "graphs.h5", "r") as f:
        np.testing.assert_array_equal(f["index"][...], np.arange(8))
        got = torch.from_numpy(f["predictions"][...])
    assert got.shape == want.shape == (8, 1)
    assert rel_err(got, want) <= 1e-6
