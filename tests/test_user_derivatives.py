"""A user's model whose forward differentiates (forces as -dE/dx of a learned energy, a
physics-informed residual), trained by `et.fit` as a user calls it: where a Plan cannot give the
second derivatives its training needs, it is refused before the first step, naming the axis and
the Plans that can; a derivative taken where evaluation turns gradients off is refused on one
process too. The Plans that train such a model as one process does (data, ZeRO-1/2, 1D tensor)
are cells of tests/test_user_models_every_axis.py (`mlp_forces`)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from harness import run_ranks


class Potential2D(nn.Module):
    """A learned energy density on a 2D grid; the output is its gradient with respect to the
    field (a force on every grid point)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x):
        with torch.enable_grad():
            x.requires_grad_(True)
            energy = self.c2(torch.tanh(self.c1(x)))
            return -torch.autograd.grad(energy.sum(), x, create_graph=self.training)[0]


class ForcesWithoutEnableGrad(nn.Module):
    """Forces written the way a training loop alone would run them: no torch.enable_grad()."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        x.requires_grad_(True)
        energy = self.net(x)
        return torch.cat([energy, -torch.autograd.grad(energy.sum(), x, create_graph=True)[0]], 1)


def _fit(make, data, plan: dict, out_dir: str) -> str:
    """`et.fit` of `make` on `data`; the refusal's message, or "" where it trained."""
    import exatrain as et

    try:
        et.fit(make, data, data, loss=F.mse_loss, plan=et.Plan(**plan),
               train={"steps": 2, "batch_size": 4, "log_every": 1, "eval_every": 0,
                      "num_workers": 0},
               optim={"name": "sgd", "lr": 0.05}, run={"out_dir": out_dir})
        return ""
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"


def _grid():
    x = torch.randn(8, 2, 16, 16, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, -0.5 * x)


def _refused_on_two_ranks(out_dir: str) -> dict:
    from user_models import build, dataset

    forces = lambda: build("mlp_forces")   # noqa: E731
    found = {name: _fit(forces, dataset("mlp_forces"), plan, os.path.join(out_dir, name))
             for name, plan in (("shard2", {"shard": 2}), ("pipe2", {"pipe": 2}),
                                ("tensor3d", {"tensor": (1, 2, 1)}))}
    found["space121"] = _fit(Potential2D, _grid(), {"space": (1, 2, 1)},
                             os.path.join(out_dir, "space"))
    return found


def test_a_forward_that_differentiates_is_refused_where_the_plan_cannot_differentiate_it_again(
        tmp_path, one_thread):
    """FSDP2 frees a block's gathered weights when the derivative's backward (inside the forward)
    ends; pipe's stages, 3D tensor's matrix multiply and space's halo convolutions cannot
    differentiate their backward. Without the refusal: FSDP2 failed in the first backward
    ("setStorage: ... storage of size 0"), pipe failed to trace, 3D tensor failed in the
    first backward ("A view was created in no_grad mode"), space refused `sum` as a block
    reduction."""
    for found in run_ranks(2, _refused_on_two_ranks, str(tmp_path)):
        common = ("ParallelizeError: ForceMLP.forward calls torch.autograd.grad",
                  "training needs second derivatives",
                  "Data, shard with ZeRO-1/2 and 1D tensor parallelism (plan.tensor=N)")
        for case, words in (("shard2", "parallel.zero_stage=2 (or 1) trains it"),
                            ("pipe2", "pipe=2: the derivative runs back through every stage"),
                            ("tensor3d", "tensor=(1, 2, 1) (3D): its matrix multiply")):
            for word in (*common, words):
                assert word in found[case], (case, found[case])
        for word in ("ParallelizeError: Potential2D.forward calls torch.autograd.grad",
                     "space=(1, 2, 1): the halo convolutions"):
            assert word in found["space121"], found["space121"]


def test_a_derivative_taken_without_gradients_on_is_refused_before_the_first_step(
        tmp_path, one_thread):
    """exatrain evaluates without gradients: a forward whose torch.autograd.grad needs them would
    train every step and fail at the first evaluation; it is refused at set-up, naming the fix."""
    from exatrain.errors import ModelCodeError
    from user_models import dataset

    message = _fit(ForcesWithoutEnableGrad, dataset("mlp_forces"), {}, str(tmp_path))
    for word in (ModelCodeError.__name__, "ForcesWithoutEnableGrad.forward calls "
                 "torch.autograd.grad, which failed where gradients are off",
                 "`with torch.enable_grad():`", "create_graph=self.training"):
        assert word in message, message
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("metrics.jsonl")), \
        "refused after training started"


def test_the_planner_ranks_only_the_plans_that_can_train_a_forward_that_differentiates():
    """`et.plans` traces the model under fake tensors and refuses, as training does, the Plans
    without second derivatives: the forces model on 4 ranks keeps data and ZeRO-1/2, and no
    FSDP2 Plan (ranked before, and refused by the run)."""
    import exatrain as et
    from user_models import build

    ranked, refused = et.plans(build("mlp_forces"), sample_shape=(6,), world=4, batch=16,
                               refused=True)
    assert ranked and all(p["plan"].startswith(("Plan(data=", "Plan(shard=")) for p in ranked)
    assert all(p["options"] in ("zero1", "zero2") for p in ranked if "shard=" in p["plan"]), ranked
    fsdp = [r for r in refused if r["plan"] == "Plan(shard=4)" and r["options"] == ""]
    assert fsdp and "calls torch.autograd.grad" in fsdp[0]["reason"] and \
        "parallel.zero_stage=2 (or 1) trains it" in fsdp[0]["reason"], fsdp
    plain = et.plans(build("mlp"), sample_shape=(6,), world=4, batch=16)   # the same MLP
    assert any(p["plan"] == "Plan(shard=4)" and p["options"] == "" for p in plain), plain
