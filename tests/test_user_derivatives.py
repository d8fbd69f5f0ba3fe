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


class NormedForces(nn.Module):
    """The forces of an energy MLP with a BatchNorm."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(),
                                 nn.Linear(16, 1))

    def forward(self, x):
        with torch.enable_grad():
            x.requires_grad_(True)
            energy = self.net(x)
            return torch.cat([energy, -torch.autograd.grad(energy.sum(), x,
                                                            create_graph=self.training)[0]], 1)


class PenaltyInTraining(nn.Module):
    """A gradient penalty taken in training only (evaluation returns the prediction alone, as
    a 0-dim second output of zero)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 7))

    def forward(self, x):
        if not self.training:
            return self.net(x)
        x.requires_grad_(True)
        out = self.net(x)
        slope = torch.autograd.grad(out.sum(), x, create_graph=True)[0]
        return out + 0.0 * slope.square().mean()


class NormedPenalty(PenaltyInTraining):
    """The penalty behind a BatchNorm, which a training forward of one sample cannot run."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 7))


class FailsAlone(ForcesWithoutEnableGrad):
    """Takes its derivative right, and asserts what a one-sample batch breaks."""

    def forward(self, x):
        with torch.enable_grad():
            out = super().forward(x)
        assert len(x) > 1, "needs pairs of samples"
        return out


def _fit(make, data, plan: dict, out_dir: str, parallel: dict | None = None,
         optim: str = "sgd") -> str:
    """`et.fit` of `make` on `data`; the refusal's message, or "" where it trained."""
    import exatrain as et

    try:
        et.fit(make, data, data, loss=F.mse_loss, plan=et.Plan(**plan),
               train={"steps": 2, "batch_size": 4, "log_every": 1, "eval_every": 0,
                      "num_workers": 0},
               optim={"name": optim, "lr": 0.05}, run={"out_dir": out_dir},
               parallel=parallel or {})
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
    found["penalty"] = _fit(PenaltyInTraining, dataset("mlp_forces"), {"shard": 2},
                            os.path.join(out_dir, "penalty"))
    found["normed_penalty"] = _fit(NormedPenalty, dataset("mlp_forces"), {"shard": 2},
                                   os.path.join(out_dir, "normed_penalty"))
    found["batchnorm"] = _fit(NormedForces, dataset("mlp_forces"), {"data": 2},
                              os.path.join(out_dir, "bn"))
    found["kfac"] = _fit(forces, dataset("mlp_forces"), {"data": 2}, os.path.join(out_dir, "k"),
                         optim="kfac")
    found["compile"] = _fit(forces, dataset("mlp_forces"), {"data": 2},
                            os.path.join(out_dir, "c"), parallel={"compile": True})
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
        common = ("forward differentiates its outputs (torch.autograd.grad",
                  "training needs second derivatives", "Data parallelism, shard with ZeRO-1/2 "
                  "and 1D tensor parallelism (plan.tensor=N) give them as one process does")
        for case, model, words in (
                ("shard2", "ForceMLP", "parallel.zero_stage=2 (or 1) trains it"),
                ("pipe2", "ForceMLP", "pipe=2: the derivative runs back through every stage"),
                ("tensor3d", "ForceMLP", "tensor=(1, 2, 1) (3D): its matrix multiply"),
                ("space121", "Potential2D", "space=(1, 2, 1): its halo exchanges"),
                # a derivative taken in training only (FSDP2 failed inside torch before)
                ("penalty", "PenaltyInTraining", "parallel.zero_stage=2 (or 1) trains it"),
                ("normed_penalty", "NormedPenalty", "parallel.zero_stage=2 (or 1) trains it"),
                ("batchnorm", "NormedForces", "parallel.batchnorm='global'"),
                ("kfac", "ForceMLP", "optim.name='kfac'"),
                ("compile", "ForceMLP", "parallel.compile=true: torch.compile's AOTAutograd")):
            for word in (f"ParallelizeError: {model}.forward", *common, words):
                assert word in found[case], (case, found[case])


def test_a_derivative_taken_without_gradients_on_is_refused_before_the_first_step(
        tmp_path, one_thread):
    """exatrain evaluates without gradients: a forward whose torch.autograd.grad needs them would
    train every step and fail at the first evaluation; it is refused at set-up, naming the fix."""
    from exatrain.errors import ModelCodeError
    from user_models import dataset

    message = _fit(ForcesWithoutEnableGrad, dataset("mlp_forces"), {}, str(tmp_path))
    for word in (ModelCodeError.__name__, "ForcesWithoutEnableGrad.forward differentiates "
                 "(torch.autograd.grad), which failed where gradients are off",
                 "`with torch.enable_grad():`", "create_graph=self.training"):
        assert word in message, message
    assert not list(tmp_path.rglob("*.pt")) and not list(tmp_path.rglob("metrics.jsonl")), \
        "refused after training started"
    # a forward that takes its derivative right and fails for a reason of its own on the
    # set-up's one sample is not blamed on the derivative: it trains on batches of 4
    assert _fit(FailsAlone, dataset("mlp_forces"), {}, str(tmp_path / "alone")) == ""


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
    assert fsdp and "differentiates its outputs" in fsdp[0]["reason"] and \
        "parallel.zero_stage=2 (or 1) trains it" in fsdp[0]["reason"], fsdp
    plain = et.plans(build("mlp"), sample_shape=(6,), world=4, batch=16)   # the same MLP
    assert any(p["plan"] == "Plan(shard=4)" and p["options"] == "" for p in plain), plain


def _second_derivatives_on_two_ranks() -> list[float]:
    """Forces of an energy through every 1D tensor collective (a column layer gathering its
    output, a row layer scattering its input, then a column -> row pair), trained on a loss of
    the forces and the energy: each parameter's gradient's error against one process."""
    import copy

    from exatrain.mesh import init
    from exatrain.parallel.tensor.linear1d import ColumnParallelLinear, RowParallelLinear
    from exatrain.parallel.tensor.state import gather_full, layout_of
    from exatrain.plan import Plan

    mesh = init(Plan(tensor=2))
    try:
        torch.manual_seed(0)
        plain = [nn.Linear(6, 16), nn.Linear(16, 8), nn.Linear(8, 16), nn.Linear(16, 1)]
        x0, target = torch.randn(5, 6), torch.randn(5, 6)
        axis = mesh.axis("tensor")
        split = [ColumnParallelLinear.from_linear(copy.deepcopy(plain[0]), axis, gather_output=True),
                 RowParallelLinear.from_linear(copy.deepcopy(plain[1]), axis, scatter_input=True),
                 ColumnParallelLinear.from_linear(copy.deepcopy(plain[2]), axis),
                 RowParallelLinear.from_linear(copy.deepcopy(plain[3]), axis)]

        def step(layers):
            x = x0.clone().requires_grad_(True)
            h = x
            for i, layer in enumerate(layers):
                h = layer(h) if i == len(layers) - 1 else torch.tanh(layer(h))
            forces = -torch.autograd.grad(h.sum(), x, create_graph=True)[0]
            (((forces - target) ** 2).sum() + (h ** 2).sum()).backward()

        step(plain)
        step(split)
        errors = []
        for ref, layer in zip(plain, split):
            for want, got in zip(ref.parameters(), layer.parameters()):
                full = gather_full(got.grad, layout_of(got))
                errors.append(float((full - want.grad).norm() / want.grad.norm()))
        return errors
    finally:
        mesh.close()


def test_second_derivatives_cross_every_1d_tensor_collective_as_one_process(one_thread):
    """Each collective's backward is its dual Function under create_graph=True, so the loss's
    backward differentiates the forces' backward through them. Before: this chain failed in
    the loss's backward ("A view was created in no_grad mode ..."); the MLP of
    test_user_models_every_axis (column layers only) trained 7.8e-3 off in its weights."""
    for errors in run_ranks(2, _second_derivatives_on_two_ranks):
        assert len(errors) == 8 and max(errors) <= 1e-5, errors


def test_fp8_and_whole_step_cuda_graphs_are_refused_and_the_advice_fits_the_model():
    """Settings that only a GPU runs are refused for a forward that differentiates, by name:
    fp8's matmuls (a backward that casts to float8) and the recorded whole step; a model that
    cannot be split over `tensor` (DimeNet++) is not told to use it."""
    import dataclasses

    import exatrain as et
    from exatrain.parallel.derivatives import derivative_refusal
    from exatrain.parallel.options import ParallelOptions

    plain = ParallelOptions()
    assert derivative_refusal("Energy", et.Plan(data=2), options=plain) is None
    fp8 = derivative_refusal("Energy", et.Plan(data=2),
                             options=dataclasses.replace(plain, precision="fp8"))
    assert "parallel.precision='fp8'" in fp8 and "'bf16' trains it" in fp8
    graphs = derivative_refusal("Energy", et.Plan(data=2), options=dataclasses.replace(
        plain, cuda_graphs=True, cuda_graphs_scope="step"))
    assert "parallel.cuda_graphs_scope='step'" in graphs
    assert derivative_refusal("Energy", et.Plan(data=2), options=dataclasses.replace(
        plain, cuda_graphs=True)) is None   # scope "compiled" needs parallel.compile, refused itself
    assert "1D tensor parallelism" in derivative_refusal("Energy", et.Plan(shard=2))
    assert "1D tensor" not in derivative_refusal("Energy", et.Plan(shard=2), tensor_ok=False)
