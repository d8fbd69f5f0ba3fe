"""GPT and ViT under 1D, 3D and hybrid tensor plans train like serial: three Trainer steps.

Each plan runs the real Trainer (micro-batches sampled per data replica, loss, backward, global
gradient-norm clipping at 0.05, below every gradient norm here, so the clipping factor tests the
global norm; optimizer step) on `exatrain.parallelize(model, mesh)`; the serial run is
the same Trainer on one process. Compared: the three losses and every weight after the third step,
gathered whole (`full_state_dict`).

Tolerances. SGD with momentum: relative 1e-5 per tensor (measured ≤ 8.3e-7: the reordered sums
of the split matrix multiplies), with an absolute 1e-7 for the attention's key bias, whose
gradient is zero in exact arithmetic (softmax ignores it), so both runs move it by rounding noise.
AdamW: its first steps move each weight by ≈ lr·g/(|g| + eps), so gradient components that are
tiny next to eps amplify rounding differences (see test_data_parallel.py); it runs unclipped
(clipping to 0.05 pushes more components towards eps: measured 2.5e-4 then), measured 8.4e-5
under tensor=(2, 1, 2), checked at 3e-4; the key biases (pure noise that Adam normalises to
steps of ≈ lr) are checked only against the bound 3·lr.

This file spawns 4 ranks once; the 8-rank grids are in test_tensor_grid8.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from harness import rel_err, run_ranks

GPT_SHAPE = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
VIT_SHAPE = dict(img_size=(8, 16), patch_size=4, in_channels=3, out_channels=3, embed_dim=32,
                 depth=2, num_heads=4, residual=False)


def make_workload(name: str):
    """A tiny model, data and loss; identical on every rank and in the serial run."""
    from exatrain.models.gpt import GPT, GPTConfig, gpt_loss
    from exatrain.models.vit import ViTForecaster, relative_l2_loss
    from exatrain.workloads.base import Workload

    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(GPTConfig(**GPT_SHAPE))
        tokens = torch.randint(0, 64, (40, 17), generator=gen)
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        loss_fn = gpt_loss
    else:
        model = ViTForecaster(**VIT_SHAPE)
        x = torch.randn(40, 3, 8, 16, generator=gen)
        data = TensorDataset(x, x.roll(1, dims=-1) + 0.1 * torch.randn(x.shape, generator=gen))
        loss_fn = relative_l2_loss
    val = torch.utils.data.Subset(data, range(32, 40))

    def metric_sums(out, y):
        return {"sq": F.mse_loss(out.float(), y.float(), reduction="sum")
                if out.shape == y.shape else out.float().square().sum(),
                "n": torch.tensor(float(y.numel()))}

    return Workload(model=model, train_set=torch.utils.data.Subset(data, range(32)), val_set=val,
                    loss_fn=loss_fn, metric_sums=metric_sums,
                    finalize=lambda s: {"val": s["sq"] / s["n"]})


def config_for(optim: str, batch: int, *overrides: str):
    from exatrain.train.config import load_config

    opt = ["optim.name='sgd'", "optim.lr=0.05"] if optim == "sgd" else \
        ["optim.name='adamw'", "optim.lr=0.003"]
    return load_config(None, ["train.steps=3", f"train.batch_size={batch}", "train.log_every=1",
                              "train.eval_every=0", "schedule.warmup_steps=0",
                              "schedule.decay='constant'", "train.clip_grad_norm=0.05", *opt,
                              *overrides])


def train(degrees: dict, name: str, optim: str, batch: int, overrides=()) -> dict:
    """Three Trainer steps under `degrees`; returns losses and the full weights (every rank)."""
    from exatrain.mesh import init
    from exatrain.parallel import parallelize
    from exatrain.parallel.tensor.state import full_state_dict
    from exatrain.plan import Plan
    from exatrain.train.trainer import Trainer

    mesh = init(Plan(**degrees))
    try:  # closed after each case, as et.fit closes its mesh
        config = config_for(optim, batch, *overrides)
        workload = make_workload(name)
        model = parallelize(workload.model, mesh, config.parallel)
        trainer = Trainer(mesh, workload, config, model)
        summary = trainer.fit()
        losses = [l for h in trainer.history if "step_losses" in h for l in h["step_losses"]]
        tp = getattr(model, "exatrain_tensor", None)
        state = full_state_dict(model) if tp is not None else \
            {k: v.detach().clone() for k, v in model.state_dict().items()}
        return {"losses": losses, "state": state, "val": summary["val"],
                "layout": tp.summary() if tp is not None else None}
    finally:
        mesh.close()


def train_plans(cases) -> list:
    """Run several (degrees, name, optim, batch, overrides) cases in one launch."""
    return [train(*case) for case in cases]


def serial(name: str, optim: str, batch: int, overrides=()) -> dict:
    from exatrain.mesh import init
    from exatrain.plan import Plan

    mesh = init(Plan())
    try:
        return train({}, name, optim, batch, overrides)
    finally:
        mesh.close()


def state_error(state: dict, reference: dict, atol: float) -> tuple[float, str]:
    """Worst per-tensor error, relative to the tensor's largest reference entry, of the entries
    that miss `atol` (a tensor that is rounding noise in both runs passes on atol alone)."""
    assert state.keys() == reference.keys()
    worst, where = 0.0, ""
    for key, ref in reference.items():
        diff = (state[key].double() - ref.double()).abs().max().item()
        if diff > atol:
            err = diff / max(ref.double().abs().max().item(), 1e-30)
            if err > worst:
                worst, where = err, key
    return worst, where


def check(result: dict, reference: dict, rtol: float, atol: float, label) -> float:
    """Losses and weights within rtol; weights also pass within atol (absolute).

    atol exists for the attention's key bias: softmax is invariant to it, so its gradient is
    zero in exact arithmetic and both runs move it by rounding noise (≈ 1e-9 with SGD).
    Returns the worst relative error over the other tensors (for the record).
    """
    assert len(result["losses"]) == 3, label
    loss_err = rel_err(torch.tensor(result["losses"]), torch.tensor(reference["losses"]))
    state_err, where = state_error(result["state"], reference["state"], atol)
    assert loss_err <= rtol and state_err <= rtol, (label, loss_err, state_err, where)
    assert abs(result["val"] - reference["val"]) <= rtol * abs(reference["val"]), label
    signal = {k: v for k, v in reference["state"].items() if not k.endswith("k_proj.bias")}
    return max(loss_err, state_error({k: result["state"][k] for k in signal}, signal, 0.0)[0])


ADAMW_RTOL = 3e-4

CASES_4 = [
    (dict(tensor=4), "gpt", "sgd", 8, ()),
    (dict(data=2, tensor=2), "gpt", "sgd", 8, ("parallel.sequence_parallel=true",)),
    (dict(tensor=(2, 1, 2)), "gpt", "sgd", 5, ()),              # 5: ragged over z
    (dict(tensor=(1, 2, 2)), "gpt", "sgd", 8, ()),
    (dict(tensor=4), "vit", "sgd", 8, ()),
    (dict(tensor=(2, 1, 2)), "vit", "sgd", 5, ()),
    (dict(data=2, tensor=(1, 2, 1)), "vit", "sgd", 8, ()),
    (dict(data=2, tensor=(1, 1, 2)), "gpt", "sgd", 8, ("train.grad_accum=2",)),  # no_sync
    (dict(tensor=(2, 1, 2)), "gpt", "sgd", 8, ("parallel.activation_checkpointing='full'",
                                               "parallel.sequence_parallel=false")),
    (dict(tensor=(2, 1, 2)), "gpt", "adamw", 8, ("train.clip_grad_norm=0",)),
]


@pytest.fixture(scope="module")
def results():
    return run_ranks(4, train_plans, CASES_4)


@pytest.fixture(scope="module")
def references():
    return {case[1:]: serial(*case[1:]) for case in CASES_4}   # same config, one process


def test_tensor_plans_train_like_serial(results, references):
    for rank, per_rank in enumerate(results):
        for case, result in zip(CASES_4, per_rank):
            degrees, name, optim, batch, overrides = case
            if optim == "sgd":
                err = check(result, references[case[1:]], 1e-5, 1e-7, (rank, case))
                if rank == 0:
                    print(f"SGD {case}: worst relative error {err:.2e}")
            else:
                ref = references[case[1:]]
                noise = {k for k in ref["state"] if k.endswith("k_proj.bias")}
                kept = {k: v for k, v in result["state"].items() if k not in noise}
                ref_kept = {k: v for k, v in ref["state"].items() if k not in noise}
                err = check(dict(result, state=kept), dict(ref, state=ref_kept), ADAMW_RTOL,
                            0.0, (rank, case))
                # the key biases: pure rounding noise amplified by Adam, at most ~lr per step
                noise_diff = max((result["state"][k] - ref["state"][k]).abs().max().item()
                                 for k in noise)
                if rank == 0:
                    print(f"AdamW {case}: worst relative error {err:.2e} (key biases excluded); "
                          f"key biases differ by {noise_diff:.2e} (bound 3·lr = 9e-03)")
                assert noise_diff <= 3 * 0.003


def test_every_transformer_linear_is_split(results):
    gpt_1d = results[0][0]["layout"]
    assert sorted(gpt_1d["chained"]) == ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn",
                                         "blocks.1.mlp"]
    assert "lm_head" in gpt_1d["split"] and gpt_1d["whole"] == []
    assert results[0][1]["layout"]["sequence_parallel_regions"] == ["blocks"]
    vit_3d = results[0][5]["layout"]
    assert {"patch_embed", "head"} <= set(vit_3d["split"]) and vit_3d["whole"] == []
