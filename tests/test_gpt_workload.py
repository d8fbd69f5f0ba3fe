"""The GPT workload: corpus preparation, model sizing, metrics, FLOPs, and a short run that learns
more than byte frequencies."""

from __future__ import annotations

import math

import pytest
import torch

from exatrain.models.gpt import GPTConfig, flops_per_token, gpt_loss
from exatrain.train.config import load_config
from exatrain.train.run import run_job
from exatrain.workloads import gpt as gpt_workload


def _config(tmp_path, *overrides):
    return load_config(None, ["run.workload='gpt'", f"data.path='{tmp_path}/text'",
                              "data.max_bytes=150000", f"run.out_dir='{tmp_path}/runs'",
                              *overrides])


def test_prepare_writes_the_corpus_once(tmp_path):
    config = _config(tmp_path)
    path = gpt_workload.prepare(config)
    files = {name: (path / name).stat().st_mtime_ns for name in ("train.bin", "val.bin", "meta.json")}
    assert (path / "train.bin").stat().st_size + (path / "val.bin").stat().st_size == 150_000
    gpt_workload.prepare(config)
    assert {name: (path / name).stat().st_mtime_ns for name in files} == files


def test_build_sizes_metrics_and_flops(tmp_path):
    config = _config(tmp_path, "model.block_size=64", "data.val_samples=10")
    gpt_workload.prepare(config)
    workload = gpt_workload.build(config, mesh=None)
    cfg = workload.model.config
    assert (cfg.n_layer, cfg.n_embd, cfg.block_size, cfg.vocab_size) == (4, 128, 64, 256)
    assert workload.loss_fn is gpt_loss and workload.tokens_per_sample == 64
    assert workload.flops_per_sample == 64 * flops_per_token(cfg, 64)
    assert len(workload.val_set) == 10
    x, y = workload.train_set[0]
    assert x.shape == (64,) and torch.equal(x[1:], y[:-1])
    assert 0 < workload.baselines["baseline_unigram_loss"] < math.log(256)
    # uniform logits: cross entropy ln 256 nats = 8 bits per byte
    sums = workload.metric_sums(torch.zeros(2, 64, 256), y.expand(2, 64))
    metrics = workload.finalize(sums)
    assert metrics["val_loss"] == pytest.approx(math.log(256))
    assert metrics["val_bits_per_byte"] == pytest.approx(8.0)
    # a preset, with fields overriding it
    options = gpt_workload.ModelOptions(preset="10m", block_size=128)
    assert gpt_workload.model_config(options) == GPTConfig.preset("10m", block_size=128)


def test_build_errors_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="exatrain data text --out"):
        gpt_workload.build(_config(tmp_path, "data.generate=false"), mesh=None)
    config = _config(tmp_path, "model.vocab_size=100")
    gpt_workload.prepare(config)
    with pytest.raises(ValueError, match="model.vocab_size=100"):
        gpt_workload.build(config, mesh=None)


def test_a_short_run_beats_the_unigram_baseline(tmp_path):
    """40 steps of a 0.1M-parameter GPT: validation loss below byte-frequency prediction."""
    config = _config(tmp_path, "model.block_size=32", "model.n_layer=2", "model.n_embd=64",
                     "train.steps=40", "train.batch_size=16", "optim.lr=0.003",
                     "train.log_every=20", "data.val_samples=64")
    summary = run_job(config)
    assert summary["val_loss"] < summary["baseline_unigram_loss"] < math.log(256)
    assert summary["val_bits_per_byte"] == pytest.approx(summary["val_loss"] / math.log(2))
    assert summary["tokens_per_s"] == pytest.approx(32 * summary["samples_per_s"])
    assert 0 < summary["mfu"] < 1 and summary["model_flops_per_s"] > 0
    assert summary["peak_activation_bytes"] > 0 and summary["state_bytes"] > 0
