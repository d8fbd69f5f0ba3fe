"""Checkpoint and resume: the remaining loss curve equals an uninterrupted run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exatrain.train.checkpoints import checkpoint
from exatrain.train.run import ResumeError, find_resume_checkpoint, run_job
from harness import interrupted_copy, logged_losses, run_ranks


def test_resume_continues_the_same_curve(tiny_config, tmp_path):
    config = tiny_config("train.steps=6", "train.checkpoint_every=3", "train.checkpoint_keep=3",
                         "model.dropout=0.1")
    full = run_ranks(2, run_job, config)[0]
    full_dir = Path(full["run_dir"])
    assert sorted(p.name for p in (full_dir / "checkpoints").glob("step_*")) == \
        ["step_00000003", "step_00000006"]
    cut = interrupted_copy(full_dir, tmp_path / "interrupted", stopped_at=3, later=6)
    resumed = run_ranks(2, run_job, config, str(cut))[0]
    assert resumed["steps"] == 6
    assert logged_losses(cut) == logged_losses(full_dir)  # exactly, steps 1..6
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
