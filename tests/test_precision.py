"""Mixed precision: bf16/fp16 runs track fp32; fp16 loss scaling skips overflowing steps.

Tolerances over 20 AdamW steps of a tiny GPT on the stdlib corpus (serial, CPU autocast; the loss
falls from 5.5 to 3.3 nats): per-step training loss relative to fp32 — bf16 ≤ 2e-3 (measured
1.1e-4; 2.4e-4 after 30 steps), fp16 ≤ 5e-4 (measured 2.1e-5); final validation loss — bf16
≤ 1e-3 (measured 3e-5; 1.8e-4 after 30 steps), fp16 ≤ 2e-4 (measured 1.1e-5).
Weights are not compared: AdamW turns the rounding of near-zero gradients into ±lr steps (see
test_shard.py), so elementwise weight differences say little about precision.
The sharded mixed-precision paths (FSDP2 bf16 policy, ZeRO-2 fp16) are checked in test_shard.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from exatrain.data.text import write_text_corpus
from exatrain.models.gpt import GPT, GPTConfig
from exatrain.train.config import load_config
from exatrain.parallel.precision import DynamicLossScaler, Precision, keep_norms_fp32
from exatrain.train.run import setup

GPT_TINY = ["run.workload='gpt'", "data.generate=false", "model.block_size=32", "model.n_layer=2",
            "model.n_embd=64", "model.n_head=4", "model.bias=false", "train.batch_size=8",
            "train.log_every=1", "data.val_samples=32", "optim.lr=0.003"]



@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """This file's own 200 kB slice: with it no fp16 step overflows at the initial loss scale, so
    the fp16 curve can be compared with fp32's step by step (a skipped step would shift it)."""
    path = tmp_path_factory.mktemp("text200k")
    write_text_corpus(path, max_bytes=200_000, val_fraction=0.1)
    return path


def _config(corpus, tmp_path, *overrides):
    return load_config(None, [*GPT_TINY, f"data.path='{corpus}'",
                              f"run.out_dir='{tmp_path}/runs'", *overrides])


def _fit(config, before=None):
    mesh, trainer = setup(config)
    try:
        if before:
            before(trainer)
        summary = trainer.fit()
        losses = [l for h in trainer.history if "step_losses" in h for l in h["step_losses"]]
        return trainer, summary, torch.tensor(losses)
    finally:
        mesh.close()


def test_bf16_and_fp16_track_fp32(corpus, tmp_path):
    runs = {p: _fit(_config(corpus, tmp_path, "train.steps=20", f"parallel.precision='{p}'"))
            for p in ("fp32", "bf16", "fp16")}
    ref_losses, ref_val = runs["fp32"][2], runs["fp32"][1]["val_loss"]
    for precision, (loss_tol, val_tol) in {"bf16": (2e-3, 1e-3), "fp16": (5e-4, 2e-4)}.items():
        _trainer, summary, losses = runs[precision]
        assert ((losses - ref_losses).abs() / ref_losses).max() <= loss_tol, precision
        assert summary["val_loss"] == pytest.approx(ref_val, rel=val_tol), precision
        assert summary["precision"] == precision
    assert runs["fp16"][1]["skipped_steps"] == 0
    assert runs["fp16"][1]["loss_scale"] == 2.0 ** 16
    # the run really computed in reduced precision: it differs from fp32
    assert not torch.equal(runs["bf16"][2], ref_losses)


def test_fp16_overflow_skips_the_step_and_halves_the_scale(corpus, tmp_path):
    """A loss scale of 2^40 overflows fp16 gradients: every step is skipped, nothing moves."""
    initial = {}

    def huge_scale(trainer):
        trainer.scaler.scale = 2.0 ** 40
        initial.update({k: v.clone() for k, v in trainer.model.state_dict().items()})

    config = _config(corpus, tmp_path, "train.steps=3", "parallel.precision='fp16'",
                     "train.checkpoint_every=3")
    trainer, summary, losses = _fit(config, before=huge_scale)
    assert summary["skipped_steps"] == 3 and summary["loss_scale"] == 2.0 ** 37
    assert all(torch.equal(v, initial[k]) for k, v in trainer.model.state_dict().items())
    assert torch.isfinite(losses).all()  # the (unscaled) loss itself was fine
    # the scaler's state is part of the checkpoint, for an exact resume
    state = json.loads((Path(summary["run_dir"]) / "checkpoints" / "step_00000003" /
                        "trainer_state.json").read_text())
    assert state["loss_scaler"] == {"scale": 2.0 ** 37, "good_steps": 0, "skipped_steps": 3}


def test_loss_scaler_grows_after_clean_steps_and_refuses_to_vanish():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2, min_scale=1.0)
    assert scaler.scale_loss(torch.tensor(1.5)).item() == 12.0
    assert scaler.update(False) and scaler.scale == 8.0      # found_inf False: a clean step
    assert scaler.update(False) and scaler.scale == 16.0
    assert not scaler.update(True) and scaler.scale == 8.0   # not finite: skip, halve
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 8.0)
    scaler.unscale_([p])
    assert torch.equal(p.grad, torch.ones(3))
    with pytest.raises(FloatingPointError, match="loss scale fell below"):
        for _ in range(5):
            scaler.update(True)
    off = DynamicLossScaler(enabled=False)
    assert off.scale_loss(torch.tensor(2.0)).item() == 2.0 and off.update(False)
    assert not off.update(True)


def test_norms_and_loss_stay_fp32_under_autocast():
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_embd=32, n_head=2))
    assert keep_norms_fp32(model) == 3 and keep_norms_fp32(model) == 3  # idempotent
    x = torch.randint(0, 256, (2, 16))
    with Precision("bf16", "cpu").autocast():
        h = model.wte(x)
        assert model.blocks[0].ln_1(h.bfloat16()).dtype == torch.float32
        assert model.blocks[0].attn.q_proj(h).dtype == torch.bfloat16
        logits = model(x)
    assert logits.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="parallel.precision='fp4'"):
        Precision("fp4", "cpu")
    assert Precision("fp8", "cpu").dtype == torch.bfloat16  # float8 Linears, the rest in bf16


def test_the_loss_sees_low_precision_outputs_widened_and_float64_ones_whole():
    """Under bf16/fp16 the loss runs on float32 outputs; a float64 model's outputs keep their
    digits (cast to float32, its loss and gradients would carry float32's 1e-8 only)."""
    from exatrain.parallel.nested import fp32

    out = fp32({"half": torch.ones(2, dtype=torch.bfloat16), "f16": torch.ones(2).half(),
                "f64": torch.ones(2, dtype=torch.float64), "ids": torch.ones(2, dtype=torch.int64)})
    assert {k: v.dtype for k, v in out.items()} == {
        "half": torch.float32, "f16": torch.float32, "f64": torch.float64, "ids": torch.int64}
