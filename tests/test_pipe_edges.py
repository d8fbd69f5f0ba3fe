"""Pinned torch.distributed.pipelining behaviour, on 2 spawned ranks.

1F1B with fewer micro-batches than pipeline ranks is refused before any step, with the fix (torch
2.13 raises only inside the first step). Stages whose output is a view (a Flatten, alone or after
a convolution), which torch's split backward (stage_backward_input) detaches in place, train under
zero-bubble with the serial loss.
"""

from __future__ import annotations

import copy

import pytest
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


class TiedAutoencoder(nn.Module):
    """A decoder using the encoder's weight, transposed: a weight used outside its layer."""

    def __init__(self):
        super().__init__()
        self.enc, self.mid = nn.Linear(6, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.enc(x))))
        return nn.functional.linear(h, self.enc.weight.t())


def test_a_weight_two_stages_train_is_refused_by_name_and_a_frozen_one_is_split():
    """Two stages on different ranks would each train a copy of a tied weight (the model then
    trains differently from serial, silently): refused, naming the parameter, both stages and
    the stage starts; GPT's tied head likewise. Frozen, the same weight is only read: split."""
    import pytest

    from exatrain.models.gpt import GPT, GPTConfig
    from exatrain.parallel.pipe.split import PipeSplitError, split_model

    with pytest.raises(PipeSplitError) as caught:
        split_model(TiedAutoencoder(), 2, torch.randn(4, 6))
    text = str(caught.value)
    assert "'enc.weight' is used by stage 0 and, as 'enc.weight', by stage 1" in text, text
    assert "parallel.pipe_split=[1]" in text and "0=enc, 1=mid" in text and "untie it" in text
    gpt = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16,
                        tie_weights=True))
    with pytest.raises(PipeSplitError, match="'wte.weight' is used by stage 0 and, as "
                                             "'lm_head.weight', by stage 1"):
        split_model(gpt, 2, torch.randint(0, 64, (2, 8)))
    frozen = TiedAutoencoder()
    frozen.enc.requires_grad_(False)
    stages, starts = split_model(frozen, 2, torch.randn(4, 6))
    assert len(stages) == 2 and starts == [1]


def test_a_batchnorm_given_one_value_per_channel_is_refused_with_the_fix():
    """Under pipe, BatchNorm normalises each micro-batch: a micro-batch of one sample without
    spatial dims has no statistics (torch raised from inside the first step). Found when the
    stages' shapes are, before any step; a BatchNorm3d of one volume is fine."""
    import contextlib

    import pytest

    from exatrain.errors import ParallelizeError
    from exatrain.parallel.pipe.model import stage_shapes
    from exatrain.parallel.pipe.split import split_model

    flat = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    stages, _ = split_model(flat, 2, torch.randn(1, 6))
    with pytest.raises(ParallelizeError) as caught:
        stage_shapes(stages, torch.randn(1, 6), contextlib.nullcontext, microbatches=4)
    text = str(caught.value)
    assert "parallel.microbatches=4" in text and "micro-batches of 1 sample" in text, text
    assert "fewer micro-batches" in text and "GroupNorm/LayerNorm" in text, text
    volumes = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(),
                            nn.Conv3d(4, 1, 1))
    stages, _ = split_model(volumes, 2, torch.randn(1, 1, 4, 4, 4))
    assert len(stage_shapes(stages, torch.randn(1, 1, 4, 4, 4), contextlib.nullcontext, 4)) == 2


class Gated(nn.Module):
    """A trained gate read at the top of forward and used at its end only."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.ones(2))
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 2)

    def forward(self, x):
        g = self.gate
        return self.fc2(torch.tanh(self.fc1(x))) * g


def test_a_weight_read_early_but_used_by_one_stage_is_that_stages_alone():
    """An attribute the traced forward reads before the cut but uses only after it belongs to
    the stage that uses it (which reads it itself): not refused as shared."""
    from exatrain.parallel.pipe.split import split_model

    stages, starts = split_model(Gated(), 2, torch.randn(4, 6))
    holders = [i for i, stage in enumerate(stages)
               if "gate" in dict(stage.named_parameters())]
    assert starts == [1] and holders == [1], (starts, holders)


def test_micro_batch_outputs_join_per_sample_tensors_and_keep_per_model_ones():
    """Pipelined evaluation's join: batch-leading tensors concatenated, a floating 0-dim one
    averaged, a per-model (K,) tensor and an integer 0-dim one kept as the first gave them."""
    from exatrain.parallel.nested import join_microbatches

    chunks = [{"y": torch.full((2, 3), float(i)), "aux": torch.tensor(float(i)),
               "per_model": torch.arange(5.0), "count": torch.tensor(7)} for i in range(3)]
    joined = join_microbatches(chunks, micro=2)
    assert joined["y"].shape == (6, 3) and joined["y"][4:].eq(2).all()
    assert float(joined["aux"]) == 1.0
    assert torch.equal(joined["per_model"], torch.arange(5.0))
    assert joined["count"].dtype == torch.int64 and int(joined["count"]) == 7


def test_setting_the_pipeline_up_steps_no_state_of_the_model():
    """The stage shapes' fake pass and the time-balanced split's timed layers run forwards in
    training mode before the first step: afterwards BatchNorm's statistics and its count
    (which fake execution stepped in place), a spectral norm's vectors and the random stream
    are as they were, so the run starts from the state one process starts from."""
    import contextlib

    from exatrain.parallel.pipe.model import stage_shapes
    from exatrain.parallel.pipe.split import layer_costs, trace_layers

    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(6, 8)),
                          nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    x = torch.randn(4, 6)
    before, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    stage_shapes([model], x, contextlib.nullcontext)
    assert len(layer_costs(trace_layers(model, x), x)) == 4
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert torch.equal(torch.get_rng_state(), rng)


def _spectral_fit(plan: dict, train: dict, out_dir: str) -> dict:
    import torch.nn.functional as F

    import exatrain as et
    from harness import logged_losses

    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 6, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.tanh(x[:, :2]))

    def model():
        torch.manual_seed(5)
        return nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(6, 32)), nn.GELU(),
                             nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 2))
    summary = et.fit(model, data, data, loss=F.mse_loss, plan=et.Plan(**plan),
                     train={"steps": 4, "batch_size": 8, "log_every": 1, "eval_every": 0,
                            "num_workers": 0, **train},
                     parallel={"microbatches": 4}, optim={"name": "sgd", "lr": 0.1},
                     run={"out_dir": out_dir})
    return {"losses": logged_losses(summary["run_dir"]), "val_loss": summary["val_loss"]}


def test_a_spectral_norm_iterates_once_per_micro_batch_as_with_gradient_accumulation(tmp_path):
    """A layer that updates state in its forward (a spectral norm's power iteration) does so
    once per micro-batch under pipe: the run equals one process accumulating the gradients of as
    many micro-batches, as the pipeline guide says. (That setting the pipeline up iterates it no
    extra time is the test above: here one extra iteration moves the losses by only 2e-7.)"""
    (serial,) = run_ranks(1, _spectral_fit, {}, {"grad_accum": 4}, str(tmp_path / "serial"))
    runs = run_ranks(2, _spectral_fit, {"pipe": 2}, {}, str(tmp_path / "pipe"))
    for run in runs:
        assert list(run["losses"]) == [1, 2, 3, 4]
        for step, loss in serial["losses"].items():
            assert run["losses"][step] == pytest.approx(loss, rel=1e-6), step
        assert run["val_loss"] == pytest.approx(serial["val_loss"], rel=1e-6)
