"""Pipeline stages compose with every other axis: each equals serial training over three SGD steps.

Each pipeline stage goes through apply.py's steps (tensor, space, shard, data), and every stage's
gradients are reduced once, after the schedule (pipe/model.py). Compared with one process: the
three losses and the final validation loss (relative ≤ 1e-5; each step's loss depends on every
weight after the steps before it); CosmoFlow also every weight, gathered from the stages.

  4 ranks  GPT        Plan(pipe=2, tensor=2), Plan(pipe=2, tensor=(1, 1, 2))
                      Plan(pipe=2, shard=2) under ZeRO-1 (zero-bubble: its weight pass adds to
                      .grad past every hook), ZeRO-2 (interleaved) and ZeRO-3 (FSDP2, 1F1B);
                      ZeRO-3 with a looped schedule refused with the fix
           CosmoFlow  Plan(pipe=2, space=(1, 1, 2)) under zero-bubble, 4 stages: the spatial
                      gather inside a stage, stages wholly after it (replicated, grads ÷ S)
  8 ranks  GPT        Plan(pipe=2, shard=2, tensor=2) (ZeRO-3 over the tensor-parallel stages),
                      Plan(pipe=2, data=2, tensor=(1, 1, 2))
           CosmoFlow  Plan(pipe=2, space=(1, 1, 2), data=2)

A checkpoint written under Plan(pipe=2, tensor=2, shard=2) resumes serially and under
Plan(data=2) with the same next losses (relative ≤ 1e-5). The 3D cases pin that the sum over
tensor_z runs once per step on the accumulated gradient, not once per micro-batch.
"""

from __future__ import annotations

import pytest
import torch

from exatrain.parallel import unwrap
from harness import max_rel_err_state, rel_err, run_ranks
from test_pipe import _gpt, resumes_alike

MB = "parallel.microbatches=2"
ZERO_BUBBLE = ("parallel.pipe_schedule='zero_bubble'", "parallel.pipe_virtual_stages=2")
GPT_4 = (("plan.pipe=2", "plan.tensor=2", MB),
         ("plan.pipe=2", "plan.tensor=[1,1,2]", MB),
         ("plan.pipe=2", "plan.shard=2", "parallel.zero_stage=1", MB, *ZERO_BUBBLE),
         ("plan.pipe=2", "plan.shard=2", "parallel.zero_stage=2", MB,
          "parallel.pipe_schedule='interleaved'", "parallel.pipe_virtual_stages=2"),
         ("plan.pipe=2", "plan.shard=2", "parallel.zero_stage=3", MB))
GPT_8 = (("plan.pipe=2", "plan.shard=2", "plan.tensor=2", "parallel.zero_stage=3", MB),
         ("plan.pipe=2", "plan.data=2", "plan.tensor=[1,1,2]", MB))
COSMO_4 = ("plan.pipe=2", "plan.space=[1,1,2]", MB, *ZERO_BUBBLE)
COSMO_8 = ("plan.pipe=2", "plan.space=[1,1,2]", "plan.data=2", MB)
# 16³ -> 2³: blocks of 1 along w at the end. No BatchNorm: under pipe its statistics are per
# micro-batch, which one process with the whole batch does not reproduce (see parallel/apply.py).
COSMO = ("train.steps=3", "optim.name='sgd'", "optim.lr=0.05", "schedule.warmup_steps=0",
         "train.eval_every=3", "model.conv_layers=3", "model.batchnorm=false")


def fit(config, whole_state: bool = False) -> dict:
    from exatrain.train.run import setup

    mesh, trainer = setup(config)
    try:
        summary = trainer.fit()
        out = {"losses": [l for h in trainer.history if "step_losses" in h
                          for l in h["step_losses"]],
               "val": summary.get("val_loss", summary.get("val_mae"))}
        if whole_state:  # this rank's layers, DTensors (FSDP2) gathered whole
            out["state"] = {k: (v.full_tensor() if type(v).__name__ == "DTensor" else v)
                            .detach().clone() for k, v in unwrap(trainer.model).state_dict().items()}
        return out
    finally:
        mesh.close()


def refusal(config) -> str:
    try:
        fit(config)
    except ValueError as err:
        return str(err)
    return ""


def _check(ranks, serial, label):
    for per_rank in ranks:
        assert len(per_rank["losses"]) == 3, label
        err = rel_err(torch.tensor(per_rank["losses"]), torch.tensor(serial["losses"]))
        assert err <= 1e-5, (label, err)
        assert per_rank["val"] == pytest.approx(serial["val"], rel=1e-5), label
    print(f"{label}: losses {err:.1e}")


def _check_state(ranks, serial, label):
    state = {}
    for per_rank in ranks:
        state.update(per_rank["state"])
    assert state.keys() == serial["state"].keys(), label
    err = max_rel_err_state(state, serial["state"])
    assert err <= 1e-5, (label, err)


def test_gpt_pipe_composes_with_tensor_and_shard(corpus, tmp_path):
    serial = fit(_gpt(corpus, tmp_path / "serial"))
    # one launch per case: a second Plan's meshes in the same rank processes can meet a stale
    # process group (see test_shard_hybrid.py)
    for ranks, cases in ((4, GPT_4), (8, GPT_8)):
        for case in cases:
            _check(run_ranks(ranks, fit, _gpt(corpus, tmp_path / str(ranks), *case)), serial, case)
    looped_zero3 = _gpt(corpus, tmp_path / "r", "plan.pipe=2", "plan.shard=2", MB, *ZERO_BUBBLE,
                        "parallel.zero_stage=3")
    for message in run_ranks(4, refusal, looped_zero3):  # before any step, with the fix
        assert "zero_stage=3" in message and "zero_stage=2" in message and "'1f1b'" in message


def test_cosmoflow_pipe_composes_with_space_and_data(tiny_config):
    serial = fit(tiny_config(*COSMO), whole_state=True)
    for ranks, case in ((4, COSMO_4), (8, COSMO_8)):
        runs = run_ranks(ranks, fit, tiny_config(*COSMO, *case), True)
        _check(runs, serial, case)
        _check_state(runs, serial, case)


def test_checkpoint_from_pipe_tensor_shard_resumes_serially_and_under_data(corpus, tmp_path):
    """Written under Plan(pipe=2, tensor=2, shard=2) at step 2 (ZeRO-2: the optimizer state is
    Shard(0) chunks of tensor-parallel pieces of one stage's layers, stored as DTensors on the
    (shard, tensor) mesh); resumed on one rank and under Plan(data=2): the same losses at steps 3
    and 4 (step 4's depends on the restored SGD momentum)."""
    resumes_alike(corpus, tmp_path, (MB, "parallel.zero_stage=2"),
                  (8, ("plan.pipe=2", "plan.tensor=2", "plan.shard=2")),
                  {"serial": (1, ()), "data": (2, ("plan.data=2",))})
