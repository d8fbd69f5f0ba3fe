"""CosmoFlow under spatial × data parallelism trains exactly like the serial model.

One 4-rank launch runs, with the Trainer, checkpoints and the spatial HDF5 reader:
  A  data=2 × space=(1, 1, 2), four SGD steps, checkpoints at steps 2 and 4
  B  A resumed from its step-2 checkpoint (same Plan): steps 3..4 repeat A's (to 1e-6: DDP's
     gradient buckets are laid out afresh after a restart, which reorders the 4-rank sums)
  C  space=(2, 2, 1) (the cube split along d and h), four steps, with full activation
     checkpointing (blocks recomputed in backward, halo exchanges included); at 16³ the deepest
     pooling cannot split in two, so that layer gathers the blocks and the rest runs replicated
and the test compares A and C with serial runs in this process (loss and every weight, relative
≤ 1e-5; measured ≤ 2e-7), and resumes A's step-2 checkpoint serially: a checkpoint written under a
spatial Plan has the serial model's state dict and loads under any other Plan.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from exatrain.parallel import unwrap
from exatrain.parallel.spatial import describe_spatial
from exatrain.train.run import setup
from harness import max_rel_err_state, rel_err, run_ranks

SGD = ("optim.name='sgd'", "optim.lr=0.05")


def _report(trainer, mesh) -> dict:
    return {"losses": [l for h in trainer.history if "step_losses" in h for l in h["step_losses"]],
            "state": {k: v.detach().cpu().clone()
                      for k, v in unwrap(trainer.model).state_dict().items()},
            "val_mae": trainer.history[-1].get("val_mae"),
            "input_bytes": trainer.input_bytes,
            "run_dir": str(trainer.run_dir), "rank": mesh.rank,
            "halo_bytes": mesh.ledger.bytes_by_axis(tag="halo").get("space", 0)}


def _cut_at(run_dir: Path, cut: Path, step: int) -> None:
    """A copy of a finished run as if it had stopped right after the checkpoint of `step`."""
    shutil.copytree(run_dir, cut)
    for ckpt in (cut / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)
    (cut / "checkpoints" / "latest").write_text(f"step_{step:08d}")
    lines = [l for l in (cut / "metrics.jsonl").read_text().splitlines()
             if json.loads(l)["step"] <= step]
    (cut / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def spatial_runs(config_a, config_c, cut: str) -> dict:
    import torch.distributed as dist

    out = {}
    mesh, trainer = setup(config_a)
    trainer.fit()
    out["a"] = _report(trainer, mesh)
    if mesh.rank == 0:
        _cut_at(Path(trainer.run_dir), Path(cut), 2)
    dist.barrier()
    mesh, trainer = setup(config_a, cut)
    trainer.fit()
    out["b"] = _report(trainer, mesh)
    mesh, trainer = setup(config_c)
    trainer.fit()
    out["c"] = _report(trainer, mesh)
    out["modes"] = dict(unwrap(trainer.model).spatial_runtime.modes())
    out["describe"] = describe_spatial(trainer.model)
    mesh.close()
    return out


def _serial(config, resume: str | None = None) -> dict:
    mesh, trainer = setup(config, resume)
    try:
        trainer.fit()
        return _report(trainer, mesh)
    finally:
        mesh.close()


def test_cosmoflow_space_times_data_equals_serial(tiny_config, tmp_path):
    steps = ("train.steps=4", "train.checkpoint_every=2", "train.checkpoint_keep=3", *SGD)
    ranks = run_ranks(4, spatial_runs, tiny_config(*steps, "plan.space=[1,1,2]"),
                      tiny_config(*steps, "plan.space=[2,2,1]",
                                  "parallel.activation_checkpointing='full'"),
                      str(tmp_path / "cut"))
    serial = _serial(tiny_config(*steps))
    for r in ranks:
        for run in (r["a"], r["c"]):
            assert len(run["losses"]) == 4
            assert rel_err(torch.tensor(run["losses"]), torch.tensor(serial["losses"])) <= 1e-5
            assert max_rel_err_state(run["state"], serial["state"]) <= 1e-5
            assert abs(run["val_mae"] - serial["val_mae"]) <= 1e-5 * serial["val_mae"]
        a, b = r["a"], r["b"]
        # resumed under the same Plan: the same curve
        assert rel_err(torch.tensor(b["losses"]), torch.tensor(a["losses"][2:])) <= 1e-6
        assert max_rel_err_state(b["state"], a["state"]) <= 1e-6
        # halos were exchanged; every step's input was a block, delivered as stored (int16):
        # 4 steps × 4 samples of this data replica, half of each 16³×4 cube + 16 B targets (the
        # serial process takes whole cubes, all 8 per step)
        assert a["halo_bytes"] > 0
        cube = 16 ** 3 * 4 * 2
        assert a["input_bytes"] == 4 * 4 * (cube // 2 + 16)
        assert serial["input_bytes"] == 4 * 8 * (cube + 16)
    # the deepest pooling (2³ -> 1³) cannot split in two: it and the dense head run replicated
    # (blocks of Conv3d, BatchNorm3d, LeakyReLU, MaxPool3d: the 4th block's conv is features.12)
    modes = ranks[0]["modes"]
    assert modes["features.0"] is False and modes["features.12"] is False
    assert modes["features.15"] is True and modes["head.1"] is True
    pool = next(l for l in ranks[0]["describe"].splitlines() if l.startswith("features.15"))
    assert "MaxPool3d" in pool and "gather" in pool
    assert "output length 1 does not divide into 2 equal blocks" in ranks[0]["describe"]
    # a spatial checkpoint resumes serially: steps 3..4 match the spatial run
    cut = tmp_path / "cut-serial"
    _cut_at(Path(ranks[0]["a"]["run_dir"]), cut, 2)
    resumed = _serial(tiny_config(*steps), str(cut))
    assert rel_err(torch.tensor(resumed["losses"]), torch.tensor(ranks[0]["a"]["losses"][2:])) <= 1e-5
    assert max_rel_err_state(resumed["state"], serial["state"]) <= 1e-5
