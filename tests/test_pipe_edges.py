"""Pinned torch.distributed.pipelining behaviour, on 2 spawned ranks.

1F1B with fewer micro-batches than pipeline ranks is refused before any step, with the fix (torch
2.13 raises only inside the first step). Stages whose output is a view (a Flatten, alone or after
a convolution), which torch's split backward (stage_backward_input) detaches in place, train under
zero-bubble with the serial loss.
"""

from __future__ import annotations

import torch
from torch import nn

from harness import run_ranks


def _model_and_data(flatten_stage):
    """The same weights and batch on every rank and in the serial check."""
    torch.manual_seed(0)
    if flatten_stage == "alone":
        return (nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Flatten(), nn.Linear(256, 8),
                              nn.Linear(8, 3)), torch.randn(8, 2, 8, 8), torch.randn(8, 3))
    model = (nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Flatten(), nn.Linear(256, 8),
                           nn.Linear(8, 8), nn.Linear(8, 3)) if flatten_stage else
             nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                           nn.Linear(256, 3)))
    return model, torch.randn(8, 2, 8, 8), torch.randn(8, 3)


def _attempt(schedule: str, split: list, microbatches: int, flatten_stage: bool):
    from exatrain.mesh import init
    from exatrain.parallel import parallelize
    from exatrain.parallel.options import ParallelOptions
    from exatrain.plan import Plan

    model, x, y = _model_and_data(flatten_stage)
    mesh = init(Plan(pipe=2))
    options = ParallelOptions(pipe_schedule=schedule, microbatches=microbatches, pipe_split=split,
                              pipe_balance="params")
    try:
        pipelined = parallelize(model, mesh, options, example=x)
        return float(pipelined.train_step(x, y, nn.functional.mse_loss))
    except ValueError as exc:
        return str(exc)


def _cases():
    return [_attempt("1f1b", [1], 1, False), _attempt("zero_bubble", [2, 3, 4], 4, True),
            _attempt("zero_bubble", [1, 2, 3], 4, "alone")]


def test_refused_before_any_step_with_the_fix():
    serial = {}
    for kind in (True, "alone"):
        model, x, y = _model_and_data(kind)
        serial[kind] = nn.functional.mse_loss(model(x), y).item()
    for few_micro, after_conv, alone in run_ranks(2, _cases):
        assert "microbatches=1 < plan.pipe=2" in few_micro and "or use gpipe" in few_micro
        assert abs(after_conv - serial[True]) <= 1e-5 * serial[True]
        assert isinstance(alone, float), alone
        assert abs(alone - serial["alone"]) <= 1e-5 * serial["alone"]
