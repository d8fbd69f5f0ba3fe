"""The whole step as one CUDA graph (`parallel.cuda_graphs_scope = "step"`, train/step_graph.py).

No GPU here, so the recording is stood in for by `RecordedOnce`, which behaves as a graph does
towards the code around it: recording runs nothing, every replay runs the recorded step on the
static batch buffers and hands back the same output tensors, overwritten. A wrapper that fed a
replay the wrong batch, kept a learning rate from the recording, or held the last step's loss
past the next replay trains differently from the plain step, which these tests compare it with.
What only a GPU can show (the recording itself) is measured by `exatrain bench device`
(`scripts/gpu-figures.sh graphs`)."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch

from exatrain.errors import ConfigError
from exatrain.plan import Plan
from exatrain.parallel.options import ParallelOptions, cuda_graphs_refusal
from exatrain.train.config import load_config
from exatrain.train.run import setup
from exatrain.train.step import StepResult
from exatrain.train.step_graph import WARMUP_STEPS, WholeStepGraph, step_graph_refusal

STEPS = 8


class RecordedOnce:
    """A CPU stand-in for `CudaGraphCapture` (see the module doc)."""

    def __init__(self):
        self.fn, self.outputs = None, None

    def eager(self, fn):
        return fn()

    def record(self, fn):
        self.fn = fn   # nothing runs while a graph records

    def replay(self):
        out = self.fn()
        fresh = (out.loss, out.grad_norm, out.found_inf)
        if self.outputs is None:
            self.outputs = StepResult(*(None if t is None else t.detach().clone() for t in fresh))
        else:
            for target, t in zip((self.outputs.loss, self.outputs.grad_norm,
                                  self.outputs.found_inf), fresh):
                if t is not None:
                    target.copy_(t)
        return self.outputs


def _train(tiny_config, graphed: bool):
    """STEPS steps of the tiny CosmoFlow, the learning rate warming up over them (a rate kept
    from the recording would show), a loss logged every step."""
    config = tiny_config(f"train.steps={STEPS}", "train.log_every=1", "train.eval_every=0",
                         "train.checkpoint_every=0", "schedule.warmup_steps=8",
                         "schedule.decay='constant'", f"optim.lr={2 ** -9}",
                         "train.clip_grad_norm=1.0", "optim.name='adamw'")
    mesh, trainer = setup(config)
    try:
        wrapper = None
        if graphed:
            wrapper = WholeStepGraph(trainer.train_step, RecordedOnce(), config.train.grad_accum)
            trainer.train_step = wrapper
        trainer.fit()
        losses = [h["loss"] for h in trainer.history if "loss" in h]
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        return losses, weights, wrapper, trainer
    finally:
        mesh.close()


def test_the_recorded_step_trains_as_the_plain_step(tiny_config, one_thread):
    plain_losses, plain, _, _ = _train(tiny_config, graphed=False)
    losses, weights, wrapper, trainer = _train(tiny_config, graphed=True)
    assert (wrapper.eager_steps, wrapper.replays) == (WARMUP_STEPS, STEPS - WARMUP_STEPS)
    # the rates became device tensors at the recording and followed the schedule after it
    assert all(isinstance(g["lr"], torch.Tensor) and g["capturable"]
               for g in trainer.optimizer.param_groups)
    # rates exact in float32 (2^-9 · k/8, a new one every step of the warm-up): the recorded
    # optimizer reads its rate from a float32 tensor where the plain step passes a Python float,
    # and with other rates the two differ by that rounding (measured: 1e-6 relative in the
    # weights after 8 steps)
    assert len(losses) == STEPS and losses == plain_losses, (losses, plain_losses)
    for k in plain:   # measured: bitwise equal
        assert torch.equal(weights[k], plain[k]), k
    # the state it saves is the plain one; a state loaded while recorded lands in the tensors
    # the graph recorded with: its rates, and the moments and step counts (a graph would go on
    # writing into the old ones), here loaded as from a file (new tensors)
    optimizer = trainer.optimizer
    rates = [g["lr"] for g in optimizer.param_groups]
    recorded = {p: dict(st) for p, st in optimizer.state.items()}
    state = copy.deepcopy(optimizer.state_dict())
    assert all(isinstance(g["lr"], float) for g in state["param_groups"])
    state["param_groups"][0]["lr"] = 0.5
    for st in state["state"].values():
        st["exp_avg"] = st["exp_avg"] + 1.0
    wanted = {k: st["exp_avg"].clone() for k, st in state["state"].items()}
    optimizer.load_state_dict(state)
    assert all(g["lr"] is r for g, r in zip(optimizer.param_groups, rates))
    assert float(rates[0]) == 0.5
    for param, st in recorded.items():
        assert all(optimizer.state[param][k] is t for k, t in st.items())
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for k, exp_avg in wanted.items():
        assert torch.equal(optimizer.state[params[k]]["exp_avg"], exp_avg)
    # a batch of another shape (a last, shorter one) runs eagerly; the recording stays
    x, y = next(iter(trainer.sampling.batches(0, trainer.decode)))
    before = wrapper.replays
    result = wrapper(iter([(x[:1], y[:1])]), STEPS, 1e-4, True, False, contextlib.nullcontext())
    assert wrapper.replays == before and wrapper.eager_steps == WARMUP_STEPS + 1
    assert torch.isfinite(result.loss)


def test_a_recorded_run_resumes_recorded_and_plain(tiny_config, one_thread):
    """A recorded run's checkpoints hold the plain form (a float rate): the run resumes
    recorded, and that one's checkpoint resumes plain."""
    _, _, _, trainer = _train(tiny_config, graphed=True)
    run_dir = str(trainer.run_dir)
    for until, graphed in ((STEPS + 4, True), (STEPS + 8, False)):
        config = tiny_config(f"train.steps={until}", "train.log_every=1", "train.eval_every=0",
                             "train.checkpoint_every=0", "optim.name='adamw'")
        mesh, resumed = setup(config, resume_dir=run_dir)
        try:
            assert resumed.step == until - 4
            assert all(isinstance(g["lr"], float) for g in resumed.optimizer.param_groups)
            if graphed:
                resumed.train_step = WholeStepGraph(resumed.train_step, RecordedOnce(), 1)
            summary = resumed.fit()
        finally:
            mesh.close()
        assert summary["steps"] == until and math.isfinite(summary["final_loss"])
        if graphed:
            assert resumed.train_step.replays == 4 - WARMUP_STEPS


def test_a_plain_step_keeping_the_previous_loss_would_be_caught(tiny_config, one_thread):
    """The stand-in is strict enough: a wrapper that handed out the replay's own loss tensor
    (no copy) logs the last loss for every step of an interval."""
    class Uncopied(WholeStepGraph):
        def __call__(self, *args, **kwargs):
            result = super().__call__(*args, **kwargs)
            if self.replays and isinstance(self.capture, RecordedOnce):
                result.loss = self.capture.outputs.loss
            return result

    config = tiny_config(f"train.steps={STEPS}", "train.log_every=4", "train.eval_every=0",
                         "train.checkpoint_every=0", "optim.name='adamw'")
    mesh, trainer = setup(config)
    try:
        trainer.train_step = Uncopied(trainer.train_step, RecordedOnce(), 1)
        trainer.fit()
        interval = [h["step_losses"] for h in trainer.history if "step_losses" in h][-1]
    finally:
        mesh.close()
    assert len(set(interval)) == 1   # every step of the interval reads the last one's loss


def test_the_whole_step_is_refused_by_name_where_it_cannot_be_recorded():
    step = ParallelOptions(cuda_graphs=True, cuda_graphs_scope="step")
    refusal = cuda_graphs_refusal(Plan(data=2), step, "cuda")
    assert "2 ranks" in refusal and "cuda_graphs_scope='compiled'" in refusal
    assert cuda_graphs_refusal(Plan(), step, "cuda") is None           # compile not needed
    assert "needs a GPU" in cuda_graphs_refusal(Plan(), step, "cpu")
    assert "kfac" in cuda_graphs_refusal(Plan(), step, "cuda", "kfac")
    checkpointed = ParallelOptions(cuda_graphs=True, cuda_graphs_scope="step",
                                   activation_checkpointing="full")
    assert "activation_checkpointing='none'" in cuda_graphs_refusal(Plan(), checkpointed, "cuda")
    params = [torch.nn.Parameter(torch.zeros(2))]
    fused = torch.optim.AdamW(params, fused=True)
    assert step_graph_refusal(fused, True, None) is None
    assert "optim.impl='fused'" in step_graph_refusal(torch.optim.AdamW(params, foreach=True),
                                                      True, None)
    assert "train.on_nonfinite='stop'" in step_graph_refusal(fused, False, None)
    assert "fault_tolerance" in step_graph_refusal(fused, True, object())


def test_a_run_whose_verdict_is_read_on_the_host_is_refused_before_its_first_step(
        tiny_config, one_thread):
    config = tiny_config("train.steps=2", "train.on_nonfinite='skip'", "optim.name='adamw'")
    mesh, trainer = setup(config)
    try:
        trainer.train_step = WholeStepGraph(trainer.train_step, RecordedOnce(), 1)
        with pytest.raises(ConfigError, match="train.on_nonfinite='stop'"):
            trainer.fit()
        assert trainer.step == 0
    finally:
        mesh.close()


def test_a_scope_that_does_not_exist_is_named(tiny_config):
    with pytest.raises(ConfigError, match="cuda_graphs_scope.*compiled"):
        load_config(None, ["parallel.cuda_graphs_scope='whole'"])
