"""Elastic re-formation (train/resilience/elastic.py): the Plan that fits the ranks left, the
accumulation that keeps the global batch at the micro-batch that fitted, and a 2-rank run
continued on 1 rank equal to the uninterrupted 2-rank run. The run across two network-namespace
hosts under torchrun --nnodes 1:2 is in test_elastic_hosts.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exatrain.plan import Plan, PlanError
from exatrain.train.config import PlanOptions
from exatrain.train.resilience.elastic import checkpoint_state, keep_micro_batch, plan_for_world
from exatrain.train.run import run_job
from harness import interrupted_copy, logged_losses, rel_err, run_ranks


def test_data_takes_the_ranks_left_and_a_plan_that_cannot_shrink_is_refused_by_name(monkeypatch):
    assert plan_for_world(PlanOptions(tensor=[2]), 4) == Plan(data=2, tensor=2)
    assert plan_for_world(PlanOptions(tensor=[2]), 2) == Plan(tensor=2)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(PlanError) as refused:
        plan_for_world(PlanOptions(space=[1, 2, 2]), 2)
    text = str(refused.value)
    assert "re-formed on 2 ranks" in text and "space=(1, 2, 2)" in text
    assert "multiple of 4 ranks" in text and "--nnodes MIN:MAX" in text
    with pytest.raises(PlanError, match="set plan.data = 0"):  # a fixed data degree
        plan_for_world(PlanOptions(data=2), 1)


def test_fewer_replicas_accumulate_to_the_micro_batch_that_fitted(tiny_config):
    config = tiny_config("train.batch_size=12")
    assert keep_micro_batch(config, Plan(data=1), {"micro_batch": 4}) == 4
    assert config.train.grad_accum == 3                      # 12 = 1 replica x 3 x 4
    config.train.grad_accum = 1
    assert keep_micro_batch(config, Plan(data=1), {"micro_batch": 5}) == 4  # 12/5 won't split
    config.train.grad_accum = 1
    assert keep_micro_batch(config, Plan(data=3), {"micro_batch": 2}) == 2
    assert config.train.grad_accum == 2
    config.train.grad_accum = 1                              # growing back: no accumulation
    assert keep_micro_batch(config, Plan(data=3), {"micro_batch": 6}) == 4
    assert config.train.grad_accum == 1
    assert keep_micro_batch(config, Plan(data=1), {}) == 12  # no checkpoint: the config's


def _continue_on_one_rank(config, run_dir: str) -> dict:
    """What a formation on 1 rank does: keep the checkpoint's micro-batch, resume, train on."""
    from exatrain.train.checkpoints import checkpoint
    keep_micro_batch(config, Plan(data=1), checkpoint_state(checkpoint.latest(run_dir)))
    assert config.train.grad_accum == 2
    return run_job(config, run_dir)


def test_two_ranks_continued_on_one_equal_the_uninterrupted_two(tiny_config, tmp_path):
    """Steps 4-6 of a 2-rank run, redone on 1 rank with 2 micro-batches of the same 4 samples
    a rank took: the same losses and val_mae (SGD, no BatchNorm, whose statistics would be the
    micro-batch's). Measured: the losses of steps 4-6 equal to the last digit, val_mae 7e-8
    relative; bar 1e-5 for both."""
    config = tiny_config("train.steps=6", "train.checkpoint_every=3", "train.checkpoint_keep=3",
                         "optim.name='sgd'", "optim.lr=0.05", "model.batchnorm=false")
    full = run_ranks(2, run_job, config)[0]
    cut = interrupted_copy(Path(full["run_dir"]), tmp_path / "cut", stopped_at=3, later=6)
    resumed = run_ranks(1, _continue_on_one_rank, config, str(cut))[0]
    assert resumed["steps"] == 6 and resumed["world_size"] == 1
    before, after = logged_losses(full["run_dir"]), logged_losses(cut)
    assert sorted(after) == list(range(1, 7))
    assert rel_err(torch.tensor([after[s] for s in range(4, 7)]),
                   torch.tensor([before[s] for s in range(4, 7)])) <= 1e-5
    assert resumed["val_mae"] == pytest.approx(full["val_mae"], rel=1e-5)
