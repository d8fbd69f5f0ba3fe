"""One composition root (train.job.build): `run.init_from`, `data.stage_to` and
`parallel.precision` take effect through every entry point -- `exatrain run` (train.run.setup),
`et.fit` and a population (Plan(trainer=2)) -- and `exatrain predict` in bf16 keeps its norm
layers in fp32 as training does (parallel.precision.keep_norms_fp32).

Each check looks at what the option changed: the model's weights before the first step equal the
file's; the data were copied under the stage directory and the run read the copy; the norm layers
saw fp32 inputs while the rest ran in bf16."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

import exatrain as et
from conftest import TINY
from exatrain.parallel.data import unwrap
from exatrain.parallel.precision import is_norm
from exatrain.train.checkpoints import checkpoint
from exatrain.train.checkpoints.export import export_run, read_state_dict
from exatrain.train.config import load_config
from harness import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cosmo_weights(cosmo_data, tmp_path_factory) -> Path:
    """A previous tiny CosmoFlow run's weights, exported (another seed, one step trained)."""
    from exatrain.train.run import run_job
    out = tmp_path_factory.mktemp("first")
    summary = run_job(load_config(None, [*TINY, f"data.path={cosmo_data}", f"run.out_dir={out}",
                                         "run.seed=11", "train.steps=1", "train.eval_every=0"]))
    export_run(summary["run_dir"], out / "weights.safetensors")
    return out / "weights.safetensors"


class NormDtypes:
    """The input dtypes every norm layer saw while this is open (after the layers' own forward
    pre-hooks, so the fp32 cast of keep_norms_fp32 shows); and the other layers' output dtypes.
    Forwards under autocast only: the set-up's checks run the plain model in fp32 first (the
    derivative probe, parallel/derivatives.py), which is not the run's precision at work."""

    def __enter__(self):
        self.norms, self.others = set(), set()

        def hook(module, args, output):
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is None or not torch.is_autocast_enabled(first.device.type):
                return
            if is_norm(module):
                self.norms.update(a.dtype for a in args if isinstance(a, torch.Tensor))
            elif isinstance(module, (nn.Linear, nn.Conv3d)) and isinstance(output, torch.Tensor):
                self.others.add(output.dtype)
        self.handle = nn.modules.module.register_module_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _same_weights(model: nn.Module, path: Path) -> None:
    own = unwrap(model).state_dict()
    saved = read_state_dict(path)
    assert saved.keys() == own.keys()
    for key, value in saved.items():
        torch.testing.assert_close(own[key], value, rtol=0, atol=0, msg=key)


def _staged_under(stage: Path, figures: dict) -> Path:
    staged = Path(figures["staged_to"])
    assert staged.is_relative_to(stage) and figures["stage_files"] > 0
    assert figures["stage_copied_bytes"] + figures["stage_reused_bytes"] > 0
    return staged


def _check_trainer(trainer, weights: Path, stage: Path) -> dict:
    """On this rank: init_from, staging and bf16 (norms in fp32) took effect."""
    _same_weights(trainer.model, weights)
    staged = _staged_under(stage, trainer.stage_figures)
    assert Path(trainer.config.data.path) == staged and any(staged.rglob("*.h5"))
    train_set = trainer.workload.train_set
    while not hasattr(train_set, "path"):  # a population's partition: a Subset
        train_set = train_set.dataset
    assert Path(train_set.path).is_relative_to(staged)  # the copy is read
    # bf16: a forward pass of the Trainer's model as its step runs it (a bf16 step itself is
    # left out: on CPU a tiny CosmoFlow's first bf16 step is sometimes non-finite, on main too)
    assert trainer.precision.dtype == torch.bfloat16
    x = torch.stack([train_set[i][0] for i in range(2)])
    with NormDtypes() as seen, torch.no_grad(), trainer.precision.autocast():
        trainer.model(trainer.workload.decode_inputs(x))
    assert seen.norms == {torch.float32} and seen.others == {torch.bfloat16}
    return {"staged": str(staged)}


def test_exatrain_run_applies_init_from_stage_to_and_precision(tiny_config, cosmo_weights,
                                                                tmp_path):
    from exatrain.train.run import setup
    stage = tmp_path / "node-local"
    stage.mkdir()
    mesh, trainer = setup(tiny_config("train.steps=1", "train.eval_every=0",
                                      f"run.init_from={cosmo_weights}", f"data.stage_to={stage}",
                                      "parallel.precision=bf16"))
    try:
        _check_trainer(trainer, cosmo_weights, stage)
    finally:
        mesh.close()


def _population_rank(config) -> dict:
    from exatrain.population.run import setup_population
    mesh, trainer, member = setup_population(config)
    try:
        return {"trainer": member.trainer_id,
                **_check_trainer(trainer, Path(config.run.init_from), Path(config.data.stage_to))}
    finally:
        mesh.close()


def test_a_population_applies_init_from_stage_to_and_precision(tiny_config, cosmo_weights,
                                                               tmp_path):
    stage = tmp_path / "node-local"
    stage.mkdir()
    config = tiny_config("plan.trainer=2", "train.steps=1", "train.eval_every=0",
                         "population.strategy=none", f"run.init_from={cosmo_weights}",
                         f"data.stage_to={stage}", "parallel.precision=bf16")
    ranks = run_ranks(2, _population_rank, config)
    # both trainers start from the file's weights (not their own seeds'), reading one copy
    assert [r["trainer"] for r in ranks] == [0, 1]
    assert ranks[0]["staged"] == ranks[1]["staged"]


# ---------------------------------------------------------------------- et.fit
def _user_data(path: Path, n: int, seed: int) -> et.data.HDF5Dataset:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f["x"], f["y"] = x, x.sum(1, keepdims=True)
    return et.data.HDF5Dataset(path)


def _user_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))


def test_fit_applies_init_from_stage_to_and_precision(tmp_path):
    train, val = _user_data(tmp_path / "train.h5", 16, 0), _user_data(tmp_path / "val.h5", 4, 1)
    common = dict(loss=nn.functional.mse_loss, plan=et.Plan(),
                  train={"steps": 2, "batch_size": 4, "eval_every": 0})
    first = et.fit(_user_model, train, val, run={"out_dir": str(tmp_path / "runs"), "seed": 5},
                   optim={"lr": 0.05}, **common)
    weights = tmp_path / "first.safetensors"
    export_run(first["run_dir"], weights)

    stage = tmp_path / "node-local"
    stage.mkdir()
    config = load_config(None, [f"data.stage_to={stage}"])  # a [data] section, as a TOML has
    with NormDtypes() as seen:
        # lr 1e-12: the weights stay what the run started from, which its checkpoint then shows
        summary = et.fit(_user_model, train, val, config=config,
                         run={"out_dir": str(tmp_path / "runs"), "init_from": str(weights)},
                         optim={"lr": 1e-12, "weight_decay": 0.0},
                         parallel={"precision": "bf16"}, **common)
    assert seen.norms == {torch.float32} and seen.others == {torch.bfloat16}
    assert summary["precision"] == "bf16"
    started = checkpoint.full_model_state(checkpoint.latest(summary["run_dir"]))
    torch.manual_seed(0)  # the run's seed: what it would have started from without init_from
    fresh = _user_model().state_dict()
    for key, value in read_state_dict(weights).items():
        torch.testing.assert_close(started[key], value, rtol=0, atol=1e-8, msg=key)
        assert (fresh[key] - value).abs().max() > 1e-3, key
    # each data set's file copied under the stage directory (its figures summed)
    staged = [Path(p) for p in summary["staged_to"].split(", ")]
    assert [p.name for p in staged] == ["train.h5", "val.h5"]
    assert all(p.is_relative_to(stage) and p.is_file() for p in staged)
    assert summary["stage_files"] == 2 and summary["stage_copied_bytes"] > 0


# ---------------------------------------------------------------------- prediction
def test_bf16_prediction_keeps_norms_in_fp32(tiny_config, tmp_path):
    from exatrain.infer.predict import predict
    from exatrain.train.run import run_job
    run_dir = run_job(tiny_config("train.steps=1", "train.eval_every=0"))["run_dir"]
    with NormDtypes() as seen:
        out = predict(run_dir, out=tmp_path / "p.h5", overrides=["parallel.precision=bf16"],
                      verbose=False)
    assert seen.norms == {torch.float32} and seen.others == {torch.bfloat16}
    with h5py.File(out["out"], "r") as f:
        assert f.attrs["precision"] == "bf16" and np.isfinite(f["predictions"][:]).all()


def test_init_from_takes_a_compiled_models_state_dict(tmp_path):
    """`torch.save(torch.compile(model).state_dict())` keys every weight under `_orig_mod.`:
    read as the plain module's keys, as `run.init_from` loads them."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    path = tmp_path / "compiled.pt"
    torch.save(torch.compile(model).state_dict(), path)
    state = read_state_dict(path)
    assert list(state) == list(model.state_dict())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
