"""Checkpoint and resume: the remaining loss curve equals an uninterrupted run's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from exatrain.train import checkpoint
from exatrain.train.run import ResumeError, find_resume_checkpoint, run_job
from harness import run_ranks


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def test_resume_continues_the_same_curve(tiny_config, tmp_path):
    config = tiny_config("train.steps=6", "train.checkpoint_every=3", "train.checkpoint_keep=3",
                         "model.dropout=0.1")
    full = run_ranks(2, run_job, config)[0]
    full_dir = Path(full["run_dir"])
    assert sorted(p.name for p in (full_dir / "checkpoints").glob("step_*")) == \
        ["step_00000003", "step_00000006"]
    # Make an interrupted copy: it stopped right after the step-3 checkpoint.
    cut = tmp_path / "interrupted"
    shutil.copytree(full_dir, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    (cut / "checkpoints" / "latest").write_text("step_00000003")
    lines = [l for l in (cut / "metrics.jsonl").read_text().splitlines()
             if json.loads(l)["step"] <= 3]
    (cut / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    resumed = run_ranks(2, run_job, config, str(cut))[0]
    assert resumed["steps"] == 6
    assert _losses(cut) == _losses(full_dir)  # exactly, steps 1..6
    assert resumed["val_mae"] == pytest.approx(full["val_mae"], rel=1e-6)


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(ResumeError, match="holds no complete checkpoint"):
        find_resume_checkpoint(tmp_path)
    with pytest.raises(ResumeError, match="no such run directory"):
        find_resume_checkpoint(tmp_path / "nope")


def test_a_partial_checkpoint_is_never_taken_for_a_good_one(tmp_path):
    root = checkpoint.checkpoint_dir(tmp_path)
    (root / "step_00000004.partial").mkdir(parents=True)  # a crash mid-save
    assert checkpoint.latest(tmp_path) is None
    good = root / "step_00000002"
    good.mkdir()
    (good / checkpoint.STATE_FILE).write_text(json.dumps({"step": 2}))
    assert checkpoint.latest(tmp_path) == good
