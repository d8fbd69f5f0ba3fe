"""A training step reads nothing from the device between read points (log, evaluation and
checkpoint steps, every STOP_CHECK_EVERY steps with several ranks, the last step).

`HostReads` counts every read of a tensor's value into Python (`item`, `tolist`, `__bool__`,
`__float__`, `cpu`, ...) on the training thread, by step. On a CPU such a read costs nothing,
but the same code on a GPU would make the host wait for the device: counting them here proves
the GPU step free of them. The counter itself is checked against reads planted on purpose.
"""

from __future__ import annotations

import pytest
import torch

from exatrain.observe.host_reads import HostReads
from exatrain.train.run import setup
from exatrain.train.trainer import STOP_CHECK_EVERY
from harness import run_ranks

STEPS = 12
LOG_EVERY = 6   # read points: 6 and 12 (and every STOP_CHECK_EVERY with several ranks)


def _reads_by_step(config, plant_read_at: int = 0) -> tuple[dict, dict, dict]:
    """Train `config` on this rank counting host reads per step; optionally plant one."""
    mesh, trainer = setup(config)
    if plant_read_at:
        forward = trainer.model.forward

        def reading_forward(x):  # a step that reads its output: the counter must see it
            out = forward(x)
            if mesh.ledger.step == plant_read_at:
                out.sum().item()
            return out
        trainer.model.forward = reading_forward
    counter = HostReads(lambda: mesh.ledger.step)
    try:
        with counter:
            summary = trainer.fit()
    finally:
        mesh.close()
    return dict(counter.by_step), counter.where, summary


def _quiet_steps(world_size: int) -> list[int]:
    reads = {LOG_EVERY * k for k in range(1, STEPS // LOG_EVERY + 1)} | {STEPS}
    if world_size > 1:
        reads |= {s for s in range(1, STEPS + 1) if s % STOP_CHECK_EVERY == 0}
    return [s for s in range(1, STEPS + 1) if s not in reads]


def _config(tiny_config, *extra):
    return tiny_config(f"train.steps={STEPS}", f"train.log_every={LOG_EVERY}",
                       "train.eval_every=0", "train.checkpoint_every=0", *extra)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_one_rank_step_reads_nothing_between_read_points(tiny_config, one_thread, precision):
    config = _config(tiny_config, "plan.data=1", "run.nproc=1", f"parallel.precision='{precision}'")
    by_step, where, summary = _reads_by_step(config)
    quiet = _quiet_steps(1)
    assert summary["steps"] == STEPS and len(quiet) == STEPS - 2
    assert sum(by_step.get(s, 0) for s in quiet) == 0, {s: where[s] for s in quiet if s in where}
    # the read points do read (the losses, the verdict, the times): the counter is live
    assert by_step.get(LOG_EVERY, 0) > 0 and by_step.get(STEPS, 0) > 0


def test_the_counter_sees_a_read_planted_in_a_step(tiny_config, one_thread):
    config = _config(tiny_config, "plan.data=1", "run.nproc=1")
    by_step, where, _ = _reads_by_step(config, plant_read_at=3)
    assert by_step.get(3) == 1, by_step
    assert "item" in where[3][0]


def _two_rank_reads(config):
    by_step, where, summary = _reads_by_step(config)
    return by_step, where, summary["steps"]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_data_parallel_step_reads_nothing_between_read_points(tiny_config, precision):
    """The default job's Plan (data = 2) on two gloo ranks."""
    config = _config(tiny_config, "plan.data=2", "run.nproc=2", f"parallel.precision='{precision}'")
    results = run_ranks(2, _two_rank_reads, config)
    quiet = _quiet_steps(2)
    for rank, (by_step, where, steps) in enumerate(results):
        assert steps == STEPS
        assert sum(by_step.get(s, 0) for s in quiet) == 0, (rank, {s: where[s] for s in quiet
                                                                  if s in where})


def test_a_nonfinite_step_is_skipped_on_the_device_and_named_at_the_read_point(tiny_config,
                                                                                one_thread):
    """Deferred verdict: a NaN at step 3 skips steps 3.. in the optimizer's kernel, and the read
    point at step 6 raises NonFiniteLoss naming step 3; the weights are those after step 2."""
    from exatrain.train import NonFiniteLoss
    config = _config(tiny_config, "plan.data=1", "run.nproc=1")
    mesh, trainer = setup(config)
    assert trainer.defers_verdict
    forward, weights = trainer.model.forward, {}

    def poisoned(x):
        out = forward(x)
        if mesh.ledger.step == 3:
            weights.update({k: v.detach().clone() for k, v in trainer.model.named_parameters()})
            out = out * torch.nan
        return out
    trainer.model.forward = poisoned
    try:
        with pytest.raises(NonFiniteLoss, match=r"step 3: loss nan.*skipped it and every step "
                                                r"after it up to step 6"):
            trainer.fit()
        assert trainer.step == LOG_EVERY
        # the parameters (not BatchNorm's running statistics, which every forward moves)
        for key, value in trainer.model.named_parameters():
            assert torch.equal(value, weights[key]), key
    finally:
        mesh.close()


def test_a_nonfinite_gradient_under_a_finite_loss_is_caught_without_the_norm(tiny_config,
                                                                              one_thread):
    """With nothing clipped, the CPU step checks its gradients' finiteness instead of taking their
    norm: an inf gradient at step 2 (the loss finite) is skipped on the device and named at the
    read point, as a gradient (no norm was computed)."""
    from exatrain.train import NonFiniteLoss
    config = _config(tiny_config, "plan.data=1", "run.nproc=1", "train.clip_grad_norm=0")
    mesh, trainer = setup(config)
    assert trainer.defers_verdict and trainer.train_step.finiteness_only
    first = next(trainer.model.parameters())
    first.register_hook(lambda grad: grad * torch.inf if mesh.ledger.step == 2 else grad)
    try:
        with pytest.raises(NonFiniteLoss, match=r"step 2: loss [0-9.]+ / a gradient is not "
                                                r"finite.*up to step 6"):
            trainer.fit()
        assert trainer.last_step.grad_norm is None
        assert torch.isfinite(first).all()
    finally:
        mesh.close()
