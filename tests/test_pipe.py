"""Pipeline parallelism equals serial training: every schedule, 2 and 4 stages, GPT through the
Trainer and a plain sequential CNN through `parallelize`; uneven stages; checkpoints that move
between stage counts; the errors a user meets.

Tolerance: fp32, relative 1e-5 on losses and weights after three SGD steps (measured ~3e-7: the
micro-batch sums reorder the gradient reduction). GPT is built without biases: the key
projection's bias gets a gradient that is zero up to rounding (softmax ignores a per-row
constant), so its relative error measures only noise.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from exatrain.launch.local import RankFailed
from exatrain.parallel import unwrap
from exatrain.parallel.pipe.model import transport_refusal
from exatrain.train.config import load_config
from exatrain.train.run import run_job, setup
from harness import interrupted_copy, logged_losses, rel_err, run_ranks

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


def _gpt(corpus, tmp_path, *overrides):
    return load_config(None, [
        "run.workload='gpt'", f"data.path='{corpus}'", "data.generate=false",
        "data.val_samples=8", f"run.out_dir='{tmp_path}/runs'", "model.n_layer=4",
        "model.n_embd=32", "model.n_head=2", "model.block_size=16", "model.bias=false",
        "train.batch_size=8", "train.steps=3", "train.log_every=1", "train.eval_every=3",
        "optim.name='sgd'", "optim.lr=0.1", "schedule.warmup_steps=0", *overrides])


def _fit(config) -> dict:
    mesh, trainer = setup(config)
    try:
        summary = trainer.fit()
        return {"losses": [l for h in trainer.history if "step_losses" in h for l in h["step_losses"]],
                "state": {k: v.detach().clone() for k, v in unwrap(trainer.model).state_dict().items()},
                "summary": summary, "history": trainer.history,
                "pipe_bytes": mesh.ledger.bytes_by_axis().get("pipe", 0),
                "stage": mesh.axis("pipe").rank}
    finally:
        mesh.close()


def _check(ranks: list[dict], serial: dict, tol: float = 1e-5) -> None:
    state, held = {}, {}   # held: stage -> its layers' names (the same on its data replicas)
    for r in ranks:
        assert rel_err(torch.tensor(r["losses"]), torch.tensor(serial["losses"])) <= tol
        assert r["summary"]["val_loss"] == pytest.approx(serial["summary"]["val_loss"], rel=tol)
        assert held.setdefault(r["stage"], r["state"].keys()) == r["state"].keys()
        state.update(r["state"])
    assert len(held) > 1, held.keys()
    for a in held:   # stages hold disjoint layers, at every world size
        for b in held:
            assert a == b or not held[a] & held[b], (a, b, sorted(held[a] & held[b]))
    assert state.keys() == serial["state"].keys()  # the serial names, every layer once
    for key, value in serial["state"].items():
        assert rel_err(state[key], value) <= tol, key


def test_gpt_every_schedule_two_and_four_stages_equals_serial(corpus, tmp_path):
    serial = _fit(_gpt(corpus, tmp_path))
    for schedule in SCHEDULES:
        ranks = run_ranks(2, _fit, _gpt(corpus, tmp_path, "plan.pipe=2", "parallel.microbatches=4",
                                         f"parallel.pipe_schedule='{schedule}'"))
        _check(ranks, serial)
        timeline = ranks[0]["history"][0]
        assert 0.0 <= timeline["bubble_fraction"] < 1.0 and timeline["bubble_formula"] > 0
        # sends counted on the pipe axis: activations forward, gradients back, every micro-batch
        stages = 2 if schedule in ("gpipe", "1f1b") else 4
        activation = 2 * 16 * 32 * 4  # micro-batch 2 x block 16 x width 32, fp32
        sent = sum(r["pipe_bytes"] for r in ranks)
        per_step = 2 * 4 * (stages - 1) * activation  # 2 directions x 4 micro-batches x boundaries
        assert sent >= 3 * per_step  # three training steps (evaluation sends forward only, too)
    for schedule in ("1f1b", "interleaved"):
        ranks = run_ranks(4, _fit, _gpt(corpus, tmp_path, "plan.pipe=4", "parallel.microbatches=4",
                                         f"parallel.pipe_schedule='{schedule}'"))
        _check(ranks, serial)


def test_uneven_stages_and_pipe_with_data(corpus, tmp_path):
    serial = _fit(_gpt(corpus, tmp_path))
    # stage 0 = embeddings and 3 blocks, stage 1 = the last block and the head
    uneven = run_ranks(2, _fit, _gpt(corpus, tmp_path, "plan.pipe=2", "parallel.pipe_split=[6]",
                                     "parallel.microbatches=2"))
    _check(uneven, serial)
    assert len(uneven[0]["state"]) > 2 * len(uneven[1]["state"])
    with_data = run_ranks(4, _fit, _gpt(corpus, tmp_path, "plan.pipe=2", "plan.data=2",
                                        "parallel.microbatches=2"))
    _check(with_data, serial)


def _sequential_cnn() -> nn.Module:
    """A model written the way people write them: one nn.Sequential, no exatrain in sight."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(16, 10))


def _cnn_steps(pipe: int, schedule: str = "1f1b"):
    import exatrain as et
    from exatrain.parallel.options import ParallelOptions

    torch.manual_seed(0)
    model = _sequential_cnn()
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    mesh = et.init(et.Plan(pipe=pipe))
    x, y = x.to(mesh.device), y.to(mesh.device)  # a GPU's, with EXATRAIN_SHARE_GPU=1
    try:
        options = ParallelOptions(pipe_schedule=schedule, microbatches=4)
        piped = et.parallelize(model, mesh, options, example=x)
        opt = torch.optim.SGD(piped.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            if pipe == 1:
                loss = nn.functional.cross_entropy(piped(x), y)
                loss.backward()
                losses.append(loss.item())
            else:
                losses.append(piped.train_step(x, y, nn.functional.cross_entropy))
            opt.step()
            opt.zero_grad()
        return {"losses": losses,
                "state": {k: v.detach().cpu() for k, v in unwrap(piped).state_dict().items()}}
    finally:
        mesh.close()


def test_sequential_cnn_every_schedule_equals_serial():
    serial = _cnn_steps(1)
    if os.environ.get("EXATRAIN_SHARE_GPU") == "1":  # CUDA tensors over gloo: refused by name
        with pytest.raises(RankFailed, match=r"plan.pipe = 2 on CUDA tensors over gloo"):
            run_ranks(2, _cnn_steps, 2, "1f1b")
        return
    for schedule in SCHEDULES:
        ranks = run_ranks(2, _cnn_steps, 2, schedule)
        state = {**ranks[0]["state"], **ranks[1]["state"]}
        assert state.keys() == serial["state"].keys()
        assert rel_err(torch.tensor(ranks[0]["losses"]), torch.tensor(serial["losses"])) <= 1e-5
        for key, value in serial["state"].items():
            assert rel_err(state[key], value) <= 1e-5, (schedule, key)


def test_a_pipeline_of_cuda_tensors_over_gloo_is_refused_by_name():
    """Ranks sharing one GPU talk over gloo, whose send and receive read host memory: a pipeline
    of CUDA activations would crash its ranks, so it is refused before the first step."""
    why = transport_refusal("cuda", "gloo", stages=2, rank=3)
    assert why.startswith("rank 3: plan.pipe = 2 on CUDA tensors over gloo")
    assert "unset EXATRAIN_SHARE_GPU" in why
    for allowed in (("cpu", "gloo", 2), ("cuda", "nccl", 2), ("cuda", "gloo", 1)):
        assert transport_refusal(*allowed, rank=0) is None, allowed


def resumes_alike(corpus, tmp_path, common, written: tuple, resumed: dict) -> None:
    """A run of 4 steps checkpointed at 2, written on `written` = (ranks, overrides), then cut back
    to step 2 and resumed under each of `resumed` {name: (ranks, overrides)}: the same losses at
    steps 3 and 4 (step 4's depends on the SGD momentum restored from the checkpoint)."""
    common = ("train.steps=4", "train.checkpoint_every=2", "train.checkpoint_keep=3", *common)
    ranks, overrides = written
    full = Path(run_ranks(ranks, run_job, _gpt(corpus, tmp_path, *common, *overrides))[0]["run_dir"])
    expected = logged_losses(full)
    for name, (ranks, overrides) in resumed.items():
        cut = interrupted_copy(full, tmp_path / name, stopped_at=2, later=4)
        config = _gpt(corpus, tmp_path, *common, *overrides)
        if ranks == 1:
            run_job(config, str(cut))
        else:
            run_ranks(ranks, run_job, config, str(cut))
        resumed_losses = logged_losses(cut)
        for step in (3, 4):
            assert resumed_losses[step] == pytest.approx(expected[step], rel=1e-5), (name, step)


def test_checkpoint_moves_between_stage_counts(corpus, tmp_path):
    """Written with 2 stages at step 2; resumed serially and with 4 stages."""
    resumes_alike(corpus, tmp_path, ("parallel.microbatches=4",), (2, ("plan.pipe=2",)),
                  {"serial": (1, ()), "four": (4, ("plan.pipe=4",))})


def test_errors_name_the_value_and_the_fix():
    from exatrain.parallel.pipe import PipeSplitError, split_model
    from exatrain.parallel.pipe.model import check_microbatches

    with pytest.raises(PipeSplitError, match="layer"):
        split_model(nn.Linear(4, 4), 2, torch.randn(2, 4))
    with pytest.raises(PipeSplitError, match="pipe_split"):
        split_model(_sequential_cnn(), 2, torch.randn(2, 3, 8, 8), starts=[9])
    with pytest.raises(PipeSplitError, match="too few"):
        split_model(_sequential_cnn(), 9, torch.randn(2, 3, 8, 8))
    with pytest.raises(ValueError, match="microbatches=3 does not divide"):
        check_microbatches(8, 3)

    class Branchy(nn.Module):  # control flow on values: cannot be cut into a fixed sequence
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) if x.sum() > 0 else self.b(x)

    with pytest.raises(PipeSplitError, match="Branchy"):
        split_model(Branchy(), 2, torch.randn(2, 4))
