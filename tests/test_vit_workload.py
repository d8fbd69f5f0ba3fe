"""The ViT forecaster workload: data prepared once, model and metrics built, and a short run under
1D tensor × data parallelism that beats the persistence forecast."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exatrain.train.config import load_config
from harness import interrupted_copy, logged_losses, run_ranks

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vit-forecast.toml"
TINY = ["data.trajectories=10", "data.steps=8", "data.height=16", "data.width=32",
        "model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=4",
        "train.batch_size=8", "train.log_every=10", "train.eval_every=0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("vit")

    def make(*overrides):
        return load_config(EXAMPLE, [*TINY, f"data.path='{root / 'data'}'",
                                     f"run.out_dir='{root / 'runs'}'", *overrides])
    return make


def test_example_config_is_valid():
    config = load_config(EXAMPLE)
    assert config.run.workload == "vit" and config.plan.tensor == [2]
    assert config.plan.resolve(4).tensor == 2 and config.plan.resolve(4).data == 2


def test_prepare_once_and_build(tiny):
    from exatrain.mesh import init
    from exatrain.models.vit import relative_l2_loss
    from exatrain.plan import Plan
    from exatrain.workloads import vit

    config = tiny()
    path = vit.prepare(config)
    stamp = (path / "train.h5").stat().st_mtime_ns
    vit.prepare(config)                                   # present: not simulated again
    assert (path / "train.h5").stat().st_mtime_ns == stamp
    mesh = init(Plan())
    try:
        workload = vit.build(config, mesh)
    finally:
        mesh.close()
    x, y = workload.train_set[0]
    assert x.shape == y.shape == (3, 16, 32)
    assert len(workload.train_set) == 9 * 7 and len(workload.val_set) == 1 * 7
    assert workload.loss_fn is relative_l2_loss
    with torch.no_grad():
        out = workload.model(x[None])
    # residual model with a zero head: the untrained forecast is persistence
    assert torch.equal(out, x[None])
    baseline = workload.baselines["baseline_persistence_rel_l2"]
    assert 0.01 < baseline < 1.0
    sums = workload.metric_sums(out, y[None])
    metrics = workload.finalize({k: float(v) for k, v in sums.items()})
    assert metrics["val_rel_l2"] == pytest.approx(relative_l2_loss(x[None], y[None]).item(),
                                                  rel=1e-5)
    assert workload.flops_per_sample > 0
    with pytest.raises(ValueError, match="patch_size=5"):
        mesh = init(Plan())
        try:
            vit.build(tiny("model.patch_size=5"), mesh)
        finally:
            mesh.close()


def _run(config):
    from exatrain.train.run import run_job
    return run_job(config)


def test_trains_under_tensor_times_data_and_beats_persistence(tiny):
    config = tiny("train.steps=100", "optim.lr=0.002", "schedule.warmup_steps=10")
    summary = run_ranks(4, _run, config)[0]
    assert summary["plan"] == "Plan(data=2, tensor=2)"
    assert summary["val_rel_l2"] < 0.9 * summary["baseline_persistence_rel_l2"], summary
    history = [line for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text()
               .splitlines() if '"loss"' in line]
    assert len(history) == 10


def test_tensor_parallel_checkpoint_resumes_on_the_same_and_on_another_plan(tiny, tmp_path):
    """Saved under data=2 × tensor=2, resumed there (the same curve, exactly) and under plain
    data=2 on the same 4 ranks (the same curve up to rounding): the checkpoint holds full tensors,
    not one rank's shards."""
    from exatrain.train.run import run_job

    config = tiny("train.steps=6", "train.checkpoint_every=3", "train.checkpoint_keep=3",
                  "train.log_every=1", "optim.name='sgd'", "optim.lr=0.05")
    full = Path(run_ranks(4, run_job, config)[0]["run_dir"])

    same = interrupted_copy(full, tmp_path / "same-plan", stopped_at=3, later=6)
    run_ranks(4, run_job, config, str(same))
    assert logged_losses(same) == logged_losses(full)

    other = interrupted_copy(full, tmp_path / "data-only", stopped_at=3, later=6)
    run_ranks(4, run_job, tiny("train.steps=6", "train.log_every=1", "optim.name='sgd'",
                               "optim.lr=0.05", "plan.tensor=[1]"), str(other))
    expected, got = logged_losses(full), logged_losses(other)
    assert got.keys() == expected.keys()
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(expected[step], rel=1e-5)
