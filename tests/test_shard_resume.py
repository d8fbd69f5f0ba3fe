"""Checkpoints move between ZeRO stages, shard degrees and world sizes and continue the curve.

Saved under ZeRO-3 on 4 ranks and under hybrid ZeRO-2 (data 2 × shard 2); resumed on 2 ranks under
plain data parallelism, ZeRO-1 and ZeRO-3. The resumed steps' losses equal the uninterrupted run's
within relative 1e-5 (a different Plan sums gradients in another order; AdamW without biases, as
in test_shard.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from exatrain.train.run import setup
from harness import run_ranks
from test_shard import ADAMW, gpt_config


def resume_rank(jobs: list) -> list:
    """Each job: (config, resume_dir or None); all on this rank in one process group."""
    out, mesh = [], None
    for config, resume in jobs:
        mesh, trainer = setup(config, resume)
        summary = trainer.fit()
        out.append({"summary": summary, "history": trainer.history})
    mesh.close()
    return out


def _step_losses(history) -> dict:
    return {h["step"]: h["loss"] for h in history if "loss" in h}


def _cut_after(run_dir: Path, tmp: Path, step: int, name: str) -> Path:
    """A copy of `run_dir` as if it stopped right after the checkpoint at `step`."""
    cut = tmp / name
    shutil.copytree(run_dir, cut)
    for p in (cut / "checkpoints").glob("step_*"):
        if int(p.name.split("_")[1]) > step:
            shutil.rmtree(p)
    (cut / "checkpoints" / "latest").write_text(f"step_{step:08d}")
    return cut


def test_checkpoint_moves_between_stages_and_world_sizes(corpus, tmp_path):
    """Save under ZeRO-3 on 4 ranks / hybrid ZeRO-2, resume under DP, ZeRO-1, ZeRO-3 on 2 ranks:
    the remaining losses continue the uninterrupted curve (relative 1e-5)."""
    out = tmp_path / "runs"
    common = ["train.steps=6", "train.checkpoint_every=3", "train.checkpoint_keep=3", *ADAMW]
    saved = {"zero3x4": ["plan.shard=4", "parallel.zero_stage=3"],
             "zero2_hybrid": ["plan.data=2", "plan.shard=2", "parallel.zero_stage=2"]}
    full = run_ranks(4, resume_rank, [(gpt_config(corpus, out, *common, *o), None)
                                      for o in saved.values()])[0]
    runs = dict(zip(saved, full))
    resumes = {"zero3x4->dp2": ("zero3x4", ["plan.data=2"]),
               "zero3x4->zero1x2": ("zero3x4", ["plan.shard=2", "parallel.zero_stage=1"]),
               "zero2_hybrid->zero3x2": ("zero2_hybrid", ["plan.shard=2", "parallel.zero_stage=3"])}
    jobs = []
    for name, (source, overrides) in resumes.items():
        cut = _cut_after(Path(runs[source]["summary"]["run_dir"]), tmp_path, 3, name)
        jobs.append((gpt_config(corpus, out, *common, *overrides), str(cut)))
    resumed = run_ranks(2, resume_rank, jobs)[0]
    for (name, (source, _)), result in zip(resumes.items(), resumed):
        assert result["summary"]["steps"] == 6, name
        before, after = _step_losses(runs[source]["history"]), _step_losses(result["history"])
        assert sorted(after) == [4, 5, 6], name  # it resumed at step 3
        for step in (4, 5, 6):
            assert after[step] == pytest.approx(before[step], rel=1e-5), (name, step)
        assert result["summary"]["val_loss"] == pytest.approx(runs[source]["summary"]["val_loss"],
                                                              rel=1e-5), name
