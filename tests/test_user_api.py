"""Your own model and data: the tutorial's example verbatim (docs/tutorials/own-model.md), user workloads from the CLI, the data
layouts against what the writers wrote, and the errors a newcomer meets first."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import exatrain as et
from exatrain.data.cosmoflow import CosmoFlowDataset
from exatrain.data.cosmoflow_synth import write_cosmoflow
from exatrain.train.config import ConfigError, load_config
from exatrain.train.run import run_job

TUTORIAL = Path(__file__).parents[1] / "docs" / "tutorials" / "own-model.md"


def _readme_code() -> str:
    """The tutorial's example, verbatim (the block that starts `# train_unet.py`)."""
    return next(block for block in re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(), re.S)
                if block.startswith("# train_unet.py\n"))


def test_the_unet_tutorial_runs_as_written_on_one_rank_on_data_2_and_on_space_2(tmp_path):
    code = _readme_code()
    (tmp_path / "train_unet.py").write_text(code)
    # the same script with a Plan that splits each volume in two along w (issue 46: the user's
    # U-Net under space trained differently from one process, and nothing warned)
    fit_end = 'run={"out_dir": "runs", "name": "unet"})'
    assert fit_end in code
    (tmp_path / "train_unet_space.py").write_text(
        code.replace(fit_end, fit_end[:-1] + ", plan=et.Plan(space=(1, 1, 2)))"))
    runs = {}
    for name, command in {"serial": [sys.executable, "train_unet.py"],
                          "data2": [sys.executable, "-m", "exatrain.cli", "run", "train_unet.py",
                                    "--nproc", "2"],
                          "space2": [sys.executable, "-m", "exatrain.cli", "run",
                                     "train_unet_space.py", "--nproc", "2"]}.items():
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        run_dir = max((tmp_path / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
        runs[name] = json.loads((run_dir / "summary.json").read_text())
        assert (run_dir / "config.toml").is_file() and (run_dir / "checkpoints").is_dir()
    serial, data2, space2 = runs["serial"], runs["data2"], runs["space2"]
    assert serial["world_size"] == 1 and data2["world_size"] == space2["world_size"] == 2
    assert serial["val_iou"] > 0.5 and serial["val_accuracy"] > 0.9   # it learned
    for key in ("val_loss", "val_iou", "val_accuracy", "final_loss"):  # parallel = serial
        assert data2[key] == pytest.approx(serial[key], rel=1e-4), key
        assert space2[key] == pytest.approx(serial[key], rel=1e-4), key


def test_metrics_are_ratios_of_sums_over_batches():
    from exatrain.workloads.metrics import metric_functions
    sums_of, finalize = metric_functions({
        "mae": lambda o, y: (o - y).abs(),                      # per element
        "batch_mean": lambda o, y: (o - y).abs().mean(),        # 0-dim: weighted by batch size
        "iou": et.Ratio(lambda o, y: (((o > 0) & (y > 0)).sum(), ((o > 0) | (y > 0)).sum()))})
    out, target = torch.randn(10, 3, dtype=torch.float64), torch.randn(10, 3, dtype=torch.float64)
    total: dict = {}
    for a, b in ((0, 3), (3, 10)):   # unequal batches, as ranks and last batches are
        for k, v in sums_of(out[a:b], target[a:b]).items():
            total[k] = total.get(k, 0) + v
    got = finalize(total)
    assert got["val_mae"] == pytest.approx(float((out - target).abs().mean()), rel=1e-12)
    assert got["val_batch_mean"] == pytest.approx(float((out - target).abs().mean()), rel=1e-12)
    inter, union = ((out > 0) & (target > 0)).sum(), ((out > 0) | (target > 0)).sum()
    assert got["val_iou"] == pytest.approx(int(inter) / int(union), rel=1e-12)


USER_MODULE = '''
from dataclasses import dataclass
import torch.nn.functional as F
from torch import nn
import exatrain as et

@dataclass
class DataOptions:
    path: str = "d.h5"

def build(data: DataOptions, hidden: int = 8, mesh=None) -> et.Task:
    ds = et.data.HDF5Dataset(data.path)
    model = nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 2))
    return et.Task(model=model, train_set=ds, val_set=ds, loss=F.mse_loss,
                   metrics={"mae": lambda o, y: (o - y).abs()})
'''


def test_user_workload_as_module_function_and_as_file_path(tmp_path, monkeypatch):
    (tmp_path / "my_work.py").write_text(USER_MODULE)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype(np.float32)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"], f["y"] = x, x[:, :2] * 2
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    common = ["train.steps=3", "train.batch_size=4", "train.log_every=1", "run.nproc=1",
              f"run.out_dir={tmp_path}/runs", "data.path=d.h5", "model.hidden=4"]
    for spec in ("my_work:build", f"{tmp_path}/my_work.py", "my_work.py:build"):
        config = load_config(None, [f"run.workload={spec}", *common])
        summary = run_job(config)
        assert summary["steps"] == 3 and "val_mae" in summary and "val_loss" in summary
    # the same through the real command line, spawning two ranks
    done = subprocess.run([sys.executable, "-m", "exatrain.cli", "run", "--nproc", "2", "--set",
                           "run.workload=my_work.py:build", *sum((["--set", c] for c in common), [])],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # the run directory is named after the file (the console wraps a long path anywhere)
    assert "my_work-" in done.stderr.replace("\n", "")

    with pytest.raises(ConfigError, match=r"model.hiden.*Did you mean 'hidden'"):
        load_config(None, ["run.workload=my_work:build", "model.hiden=3"])
    with pytest.raises(ConfigError, match=r"data.pth.*Did you mean 'path'"):
        load_config(None, ["run.workload=my_work:build", "data.pth=x"])
    with pytest.raises(ConfigError, match=r"my_work has no function 'buidl'.*Did you mean 'build'"):
        load_config(None, ["run.workload=my_work:buidl"])
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_module'"):
        load_config(None, ["run.workload=no_such_module:build"])
    with pytest.raises(ConfigError, match=r"no such file"):
        load_config(None, ["run.workload=missing.py:build"])


def _mlperf_copies(src: Path, root: Path) -> dict[str, Path]:
    """The exatrain-written train.h5 rewritten in each MLPerf layout."""
    with h5py.File(src / "train.h5") as f:
        cubes, targets = f["x"][...], f["y"][...]
    flat, npy, split = root / "flat", root / "npy" / "train", root / "split" / "train"
    for d in (flat, npy, split, root / "npy" / "validation", root / "split" / "validation"):
        d.mkdir(parents=True)
    for i, (cube, y) in enumerate(zip(cubes, targets)):
        for d in (flat, split):
            with h5py.File(d / f"univ_{i:03d}.hdf5", "w") as f:
                f["full"], f["unitPar"] = cube, y
        np.save(npy / f"univ_{i:03d}_data.npy", cube)
        np.save(npy / f"univ_{i:03d}_label.npy", y)
    return {"flat": flat, "npy": npy, "split": split}


def test_every_layout_reads_the_samples_the_writer_wrote(tmp_path):
    write_cosmoflow(tmp_path / "cf", samples=5, size=8, seed=2)
    reference = CosmoFlowDataset(tmp_path / "cf" / "train.h5")
    copies = _mlperf_copies(tmp_path / "cf", tmp_path)
    for name, path in copies.items():
        ds = CosmoFlowDataset(path)
        assert len(ds) == len(reference) and ds.layout == ("numpy" if name == "npy" else "mlperf")
        for i in range(len(ds)):
            for got, want in zip(ds[i], reference[i]):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        np.testing.assert_array_equal(ds.targets(), reference.targets())
        block = ds.read(1, (slice(0, 4), slice(2, 6), slice(None)))[0]
        torch.testing.assert_close(block, reference[1][0][:, 0:4, 2:6, :], rtol=0, atol=0)
    assert CosmoFlowDataset(copies["npy"]).sample_ids()[0] == "univ_000"

    # generic readers: one HDF5 file, a directory of per-sample files, .npy pair and .npz
    with h5py.File(tmp_path / "cf" / "train.h5") as f:
        x, y = f["x"][...], f["y"][...]
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    np.savez(tmp_path / "xy.npz", x=x, y=y)
    per_sample = tmp_path / "per_sample"
    per_sample.mkdir()
    for i in range(len(x)):
        with h5py.File(per_sample / f"s{i}.h5", "w") as f:
            f["cube"], f["par"] = x[i], y[i]
    for ds in (et.data.HDF5Dataset(tmp_path / "cf" / "train.h5"),
               et.data.HDF5Dataset(per_sample, x="cube", y="par"),
               et.data.NumpyDataset(tmp_path / "x.npy", tmp_path / "y.npy"),
               et.data.NumpyDataset(tmp_path / "xy.npz")):
        assert len(ds) == len(x)
        for i in range(len(x)):
            got_x, got_y = ds[i]
            np.testing.assert_array_equal(got_x.numpy(), x[i].astype(np.float32))
            np.testing.assert_array_equal(got_y.numpy(), y[i])
    with pytest.raises(ValueError, match="no dataset 'volume'.*params, x, y"):
        et.data.HDF5Dataset(tmp_path / "cf" / "train.h5", x="volume")


def test_data_model_size_mismatch_is_refused_at_build(tiny_config, cosmo_data):
    from exatrain.workloads import cosmoflow
    config = tiny_config("model.size=32", "data.size=32")
    mesh = et.init(et.Plan())
    try:
        with pytest.raises(ValueError, match=r"model.size=32[\s\S]*16×16×16[\s\S]*set model.size=16"):
            cosmoflow.build(config, mesh)
        workload = cosmoflow.build(tiny_config(), mesh)   # per-target MAE and baselines
        assert {f"baseline_mae_{n}" for n in ("Omega_m", "sigma_8", "n_s", "H0")} <= set(workload.baselines)
        metrics = workload.finalize({k: torch.tensor(1.0) for k in
                                     workload.metric_sums(torch.zeros(2, 4), torch.ones(2, 4))})
        assert metrics["val_mae_H0"] == pytest.approx(4.0) and "val_mae_Omega_m" in metrics
    finally:
        mesh.close()


def test_training_steps_leave_the_callers_global_rng_stream_alone(tmp_path):
    """The Trainer seeds the global generator per step (dropout replayable on resume) inside
    fork_rng: after fit the caller's stream is where fit's model build left it, not a step seed."""
    script = tmp_path / "rng.py"
    script.write_text(
        "import torch, torch.nn.functional as F\n"
        "from torch import nn\n"
        "from torch.utils.data import TensorDataset\n"
        "import exatrain as et\n"
        "g = torch.Generator().manual_seed(0)\n"
        "data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))\n"
        "et.fit(lambda: nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1)), data, data,\n"
        "       loss=F.mse_loss, train={'steps': 6, 'batch_size': 8, 'eval_every': 0},\n"
        "       run={'out_dir': 'runs', 'name': 'rng', 'seed': 7})\n"
        "print('initial_seed', torch.initial_seed())\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "initial_seed 7\n" in done.stdout, done.stdout[-2000:]


def _fit_then_load_weights(plans: list, out_dir: str) -> list:
    """On every rank: `et.fit` under each Plan, then the run's weights loaded into a fresh
    model as a user does; (its validation loss, the run's val_loss) per Plan."""
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset

    def net():
        return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 2))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 6, generator=g)
    y = torch.tanh(2 * x[:, :2])
    out = []
    for plan in plans:
        summary = et.fit(net, TensorDataset(x[:32], y[:32]), TensorDataset(x[32:], y[32:]),
                         loss=F.mse_loss, plan=et.Plan(**plan),
                         train={"steps": 3, "batch_size": 8, "eval_every": 0, "num_workers": 0},
                         optim={"lr": 0.01}, run={"out_dir": out_dir})
        model = net()
        model.load_state_dict(et.load_weights(summary["run_dir"]))
        with torch.no_grad():
            out.append((float(F.mse_loss(model(x[32:]), y[32:])), summary["val_loss"]))
    return out


def test_the_weights_of_a_sharded_or_split_run_load_into_the_users_model(tmp_path):
    """`et.load_weights(run_dir)`: the run's newest checkpoint whole, under the model's own
    names, whatever Plan trained it; the model that loads them computes the run's val_loss."""
    from harness import run_ranks

    for rank in run_ranks(2, _fit_then_load_weights, [{"shard": 2}, {"tensor": 2}],
                          str(tmp_path)):
        for loaded, reported in rank:
            assert loaded == pytest.approx(reported, rel=1e-5), (loaded, reported)
    with pytest.raises(et.CheckpointError, match="no complete checkpoint at step 7"):
        et.load_weights(next(tmp_path.iterdir()), step=7)


PIPE_SCRIPT = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import exatrain as et


def model():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=g)
    y = x[:, :2] * 2
    et.fit(model, TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:]), loss=F.mse_loss,
           plan=PLAN, train={"steps": 3, "batch_size": 8, "log_every": 1, "eval_every": 0,
                             "checkpoint_every": 0}, optim={"name": "sgd", "lr": 0.05},
           run={"out_dir": "runs", "name": NAME})
'''


def test_fit_under_pipe_traces_from_the_training_set_like_the_cli(tmp_path):
    """et.fit(..., plan=et.Plan(pipe=2)) in a script under `exatrain run SCRIPT --nproc 2`
    traces the stages on a batch of the training set (as `run.workload` jobs do) and trains
    like the same script on one process."""
    losses = {}
    for name, plan, nproc in (("serial", "None", 1), ("pipe", "et.Plan(pipe=2)", 2)):
        (tmp_path / f"{name}.py").write_text(PIPE_SCRIPT.replace("PLAN", plan)
                                             .replace("NAME", repr(name)))
        done = subprocess.run([sys.executable, "-m", "exatrain.cli", "run", f"{name}.py",
                               "--nproc", str(nproc)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        (run_dir,) = (tmp_path / "runs").glob(f"{name}-*")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == nproc
        losses[name] = [json.loads(line)["loss"] for line in
                        (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses["pipe"]) == 3
    assert losses["pipe"] == pytest.approx(losses["serial"], rel=1e-5)


def test_a_script_writing_one_hdf5_file_from_every_rank_is_told_why_and_what_to_do(tmp_path):
    """The tutorial's first trip-up: every rank runs the script, so every rank writes its data
    file; HDF5's lock refuses the second writer. The CLI names the cause and the fix (exit 2),
    not "internal error". The collision is made certain by holding the file open for writing."""
    (tmp_path / "make_data.py").write_text(
        "import h5py\nimport numpy as np\n\n"
        "if __name__ == '__main__':\n"
        "    with h5py.File('volumes.h5', 'w') as f:\n"
        "        f['x'] = np.zeros((4, 3), np.float32)\n")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import h5py, sys, time\n"
         "f = h5py.File('volumes.h5', 'w'); print('open', flush=True); sys.stdin.read()"],
        cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        done = subprocess.run([sys.executable, "-m", "exatrain.cli", "run", "make_data.py",
                               "--nproc", "2"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
    finally:
        holder.communicate("", timeout=60)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "internal error" not in done.stderr
    assert "open for writing" in done.stderr and "Every rank runs your whole script" in done.stderr
    assert "unable to lock file" in done.stderr   # the original message is kept


# the README's first example without its `__main__` guard (and with one loader worker per rank,
# the worker that used to import the script again and hang)
GUARDLESS = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import exatrain as et

torch.manual_seed(0)
x = torch.randn(256, 8)
y = x @ torch.randn(8, 1)
summary = et.fit(lambda: nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)),
                 TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:]),
                 loss=F.mse_loss, train={"steps": 6, "batch_size": 16, "log_every": 1,
                                         "num_workers": 1, "checkpoint_every": 0},
                 run={"out_dir": "runs", "name": NAME})
print(f"val_loss {summary['val_loss']:.6f}")
'''


def test_a_script_without_a_main_guard_trains_under_exatrain_run_as_under_torchrun(tmp_path):
    """`exatrain run SCRIPT --nproc 2` runs a script with no `if __name__ == "__main__":` (its
    ranks' loader workers fork, as under torchrun, instead of importing it again) and ends
    where the same script ends on one process."""
    losses = {}
    for name, command in (("serial", [sys.executable, "serial.py"]),
                          ("data2", [sys.executable, "-m", "exatrain.cli", "run", "data2.py",
                                     "--nproc", "2"])):
        (tmp_path / f"{name}.py").write_text(GUARDLESS.replace("NAME", repr(name)))
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        (run_dir,) = (tmp_path / "runs").glob(f"{name}-*")
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["num_workers"] == 1 and summary["world_size"] == (2 if name == "data2" else 1)
        losses[name] = [json.loads(line)["loss"] for line in
                        (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        losses[name].append(summary["val_loss"])
    assert len(losses["data2"]) == 7
    assert losses["data2"] == pytest.approx(losses["serial"], rel=1e-5)


def test_a_guardless_script_is_refused_before_any_rank_where_workers_would_import_it(tmp_path):
    """Where loader workers start by spawn (macOS, Windows; here the caller's start method set
    to it), each would run a guard-less script's training again: refused in one line before any
    rank starts, naming the script and the fix. A script with the guard is not refused."""
    from exatrain.train.fit import script_refusal

    (tmp_path / "bare.py").write_text(GUARDLESS.replace("NAME", "'bare'"))
    (tmp_path / "guarded.py").write_text("import exatrain\n\nif '__main__' == __name__:\n    pass\n")
    assert script_refusal(tmp_path / "bare.py", "fork") is None
    assert script_refusal(tmp_path / "guarded.py", "spawn") is None
    done = subprocess.run(
        [sys.executable, "-c", "import multiprocessing, sys\n"
         "multiprocessing.set_start_method('spawn')\n"
         "from exatrain.cli import main\n"
         "sys.exit(main(['run', 'bare.py', '--nproc', '2']))"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = [l for l in done.stderr.splitlines() if l.startswith("exatrain:")]
    assert "bare.py has no `if __name__ == \"__main__\":` guard" in line, line
    assert "'spawn'" in line and "under the guard" in line, line
    assert not (tmp_path / "runs").exists()   # no rank started
