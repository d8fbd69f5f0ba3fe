"""Activation checkpointing is bit-identical to none in fp32 and lowers peak memory; memory
accounting counts what is there (16Ψ for AdamW in fp32) and the ZeRO formulas are the paper's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from exatrain.models.cosmoflow import CosmoFlow
from exatrain.models.gpt import GPT, GPTConfig
from exatrain.parallel.blocks import find_blocks
from exatrain.parallel.compile import apply_checkpointing_and_compile
from exatrain.train.config import ParallelOptions, load_config
from exatrain.observe.memory_meters import StepPeak, state_bytes, zero_state_formula
from exatrain.train.run import setup

# activations dominate this model: 16 × 128 tokens through 2 blocks of width 64
GPT_ACT = ["run.workload='gpt'", "data.generate=false", "model.block_size=128", "model.n_layer=2",
           "model.n_embd=64", "model.n_head=4", "model.dropout=0.1", "train.batch_size=16",
           "train.steps=3", "train.log_every=1", "data.val_samples=8"]



def _run(corpus, tmp_path, *overrides):
    config = load_config(None, [*GPT_ACT, f"data.path='{corpus}'",
                                f"run.out_dir='{tmp_path}/runs'", *overrides])
    mesh, trainer = setup(config)
    try:
        summary = trainer.fit()
        losses = [l for h in trainer.history if "step_losses" in h for l in h["step_losses"]]
        return summary, losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}
    finally:
        mesh.close()


def test_activation_checkpointing_is_bit_identical_and_saves_memory(corpus, tmp_path):
    """fp32, dropout on (the recomputation must redraw the same masks), three AdamW steps."""
    runs = {mode: _run(corpus, tmp_path, f"parallel.activation_checkpointing='{mode}'")
            for mode in ("none", "full", "selective")}
    none_summary, none_losses, none_state = runs["none"]
    for mode in ("full", "selective"):
        summary, losses, state = runs[mode]
        assert losses == none_losses, mode  # bit-identical
        assert state.keys() == none_state.keys(), mode  # no wrapper names in the state dict
        assert all(torch.equal(state[k], none_state[k]) for k in state), mode
        assert summary["val_loss"] == none_summary["val_loss"], mode
    peak = {mode: runs[mode][0]["peak_activation_bytes"] for mode in runs}
    assert runs["none"][0]["peak_activation_source"] == "cpu_tracked_storages"
    assert peak["full"] < peak["selective"] < peak["none"], peak
    assert peak["full"] < 0.6 * peak["none"], peak


def test_state_bytes_count_adamw_as_16_bytes_per_parameter(corpus, tmp_path):
    summary, _, state = _run(corpus, tmp_path, "model.dropout=0.0", "train.steps=1")
    numel = sum(v.numel() for v in state.values())
    assert summary["param_bytes"] == 4 * numel and summary["grad_bytes"] == 4 * numel
    # exp_avg + exp_avg_sq, plus one scalar `step` per parameter tensor
    assert 8 * numel <= summary["optimizer_bytes"] <= 8 * numel + 8 * len(state)
    assert summary["state_bytes"] / zero_state_formula(0, numel, 1) == pytest.approx(1, abs=1e-3)
    assert summary["offloaded_bytes"] == 0


def test_state_bytes_count_shared_storage_once():
    flat = torch.zeros(10)
    a, b = nn.Parameter(flat[:4]), nn.Parameter(flat[4:])  # views of one storage
    holder = nn.Module()
    holder.a, holder.b = a, b
    a.grad = torch.zeros(4)
    opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    b.grad = torch.zeros(6)
    opt.step()
    counted = state_bytes(holder, opt)
    assert counted["params"] == 40 and counted["grads"] == 16 + 24
    assert counted["optimizer"] == 40  # two momentum buffers
    assert counted["total"] == 120


def test_zero_formulas_are_the_papers():
    psi, n = 1000, 4
    assert zero_state_formula(0, psi, n) == 16 * psi
    assert zero_state_formula(1, psi, n) == 8 * psi + 8 * psi / n
    assert zero_state_formula(2, psi, n) == 4 * psi + 12 * psi / n
    assert zero_state_formula(3, psi, n) == 16 * psi / n
    assert zero_state_formula(1, psi, n, mixed=True) == 4 * psi + 12 * psi / n
    assert zero_state_formula(2, psi, n, mixed=True) == 2 * psi + 14 * psi / n
    with pytest.raises(ValueError, match="stage 4"):
        zero_state_formula(4, psi, n)


def test_cpu_peak_tracker_sees_allocations_and_frees():
    peak = StepPeak(torch.device("cpu"))
    with peak.track():
        a = torch.empty(1000)            # 4000 B
        b = torch.empty(2000)            # 8000 B: 12000 live
        a.add_(1)                        # in place: nothing new
        v = b.view(40, 50)               # a view: nothing new
        del a
        c = torch.empty(500)             # 2000 B: 10000 live
        del b, v, c
    assert peak.bytes == 12000 and peak.source == "cpu_tracked_storages"


def test_blocks_are_found_without_model_knowledge():
    gpt = GPT(GPTConfig(block_size=16, n_layer=3, n_embd=32, n_head=2))
    assert [b for _, _, b in find_blocks(gpt)] == list(gpt.blocks)
    cosmo = CosmoFlow(size=32, base_channels=4)
    assert [n for _, n, _ in find_blocks(cosmo)] == ["features", "head"]
    wrapped = apply_checkpointing_and_compile(
        gpt, ParallelOptions(activation_checkpointing="full"))
    assert all(type(b).__name__ == "CheckpointWrapper" for b in wrapped.blocks)
    assert list(wrapped.state_dict()) == list(
        GPT(GPTConfig(block_size=16, n_layer=3, n_embd=32, n_head=2)).state_dict())
    with pytest.raises(ValueError, match="activation_checkpointing='none'"):
        apply_checkpointing_and_compile(nn.ReLU(), ParallelOptions(activation_checkpointing="full"))
