"""Sub-graph parallelism: et.Branches split over the data ranks trains exactly like serial.

A small conv net with three independent branches (one with BatchNorm) runs three SGD steps under
Plan(data=2) and Plan(data=4) with parallel.branches = "data", for combine "sum" and "concat";
outputs, input gradients and every weight and buffer after the steps equal the serial model's
on the whole batch (relative ≤ 1e-5; measured ~1e-7), and the ledger's bytes equal the module
doc's formula. DeepCAM's ASPP (four branches, concat) is checked the same way on 2 ranks. K-FAC,
which needs every layer on every rank, refuses split branches when it is built.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import exatrain as et
from exatrain.parallel import parallelize, unwrap
from exatrain.parallel.options import ParallelOptions
from harness import max_rel_err_state, rel_err, run_ranks

BATCH, STEPS = 8, 3


def _model(combine: str) -> nn.Module:
    torch.manual_seed(0)
    branches = et.Branches([nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU()),
                            nn.Conv2d(4, 4, 3, padding=2, dilation=2),
                            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Tanh())], combine)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), branches,
                         nn.Conv2d(4 if combine == "sum" else 12, 2, 1))


def _deepcam() -> nn.Module:
    torch.manual_seed(0)
    return et.models.DeepCAM(in_channels=4, num_classes=3, width=4, dropout=0.0)


def _data(model_name: str):
    g = torch.Generator().manual_seed(1)
    c, hw = (4, 16) if model_name == "deepcam" else (3, 8)
    return torch.randn(BATCH, c, hw, hw, generator=g)


def _train(model: nn.Module, x: torch.Tensor, mesh=None) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = None
    for step in range(STEPS):
        xs = x.clone().requires_grad_()
        out = model(xs)
        # the mean over the global batch: each of R replicas averages its BATCH/R samples
        loss = (out ** 2).mean()
        loss.backward()
        if first is None:
            first = {"out": out.detach().clone(), "x_grad": xs.grad.clone()}
        opt.step()
        opt.zero_grad()
    return {**first, "state": {k: v.detach().clone() for k, v in unwrap(model).state_dict().items()}}


def branch_ranks(world: int, name: str, combine: str) -> dict:
    mesh = et.init(et.Plan(data=world))
    try:
        model = _deepcam() if name == "deepcam" else _model(combine)
        model = parallelize(model, mesh, ParallelOptions(branches="data"))
        x = _data(name).chunk(world)[mesh.coord("data")]
        out = _train(model, x, mesh)
        out["branch_bytes"] = mesh.ledger.bytes_by_axis(tag="branch").get("data", 0)
        out["x_bytes"] = x.numel() * 4
        split = [m for m in unwrap(model).modules() if type(m).__name__ == "SplitBranches"]
        out["owners"] = [m.owner for m in split]
        return out
    finally:
        mesh.close()


def _serial(name: str, combine: str) -> dict:
    model = _deepcam() if name == "deepcam" else _model(combine)
    return _train(model, _data(name))


@pytest.mark.parametrize("world", [2, 4])
def test_branches_equal_serial(world):
    for combine in ("sum", "concat"):
        ranks = run_ranks(world, branch_ranks, world, "toy", combine)
        serial = _serial("toy", combine)
        b = BATCH // world
        for r, run in enumerate(ranks):
            mine = slice(r * b, (r + 1) * b)
            assert rel_err(run["out"], serial["out"][mine]) <= 1e-5
            # the data-parallel loss is each replica's mean: its input gradient is R × serial's
            assert rel_err(run["x_grad"], world * serial["x_grad"][mine]) <= 1e-5
            assert max_rel_err_state(run["state"], serial["state"]) <= 1e-5
            # per step: all-gather + reduce-scatter of the branch input (4 channels, 8x8 per
            # sample) and of the combined output, forward and backward: 2P(s(x) + s(y))
            sx = b * 4 * 8 * 8 * 4
            sy = sx * (1 if combine == "sum" else 3)
            assert run["branch_bytes"] == STEPS * 2 * world * (sx + sy), (combine, world)
        # three branches by parameter count (80, 148, 148): the two 3x3 ones apart
        assert ranks[0]["owners"] == [[2 % world, 0, 1]]


def test_deepcam_aspp_split_over_two_ranks_equals_serial():
    ranks = run_ranks(2, branch_ranks, 2, "deepcam", "concat")
    serial = _serial("deepcam", "concat")
    for r, run in enumerate(ranks):
        mine = slice(r * BATCH // 2, (r + 1) * BATCH // 2)
        assert rel_err(run["out"], serial["out"][mine]) <= 1e-5
        assert max_rel_err_state(run["state"], serial["state"]) <= 1e-5
        assert run["branch_bytes"] > 0
    # four branches (1x1 and 3x3 at rates 1, 2, 3; the package's ASPP has no pooling branch):
    # LPT puts two 3x3 on rank 0, the third with the small 1x1 on rank 1
    assert ranks[0]["owners"] == [[1, 0, 1, 0]]


def test_branches_refuse_other_axes_and_bad_combine():
    from exatrain.parallel.branches import check_plan
    with pytest.raises(ValueError, match="space=2"):
        check_plan(et.Plan(data=2, space=(1, 1, 2)))
    with pytest.raises(ValueError, match="combine='max'"):
        et.Branches([nn.Identity()], combine="max")


def kfac_with_branches(mode: str) -> str:
    from exatrain.optim.kfac import KFAC
    mesh = et.init(et.Plan(data=2))
    try:
        model = parallelize(_model("sum"), mesh, ParallelOptions(branches=mode))
        try:
            opt = KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), mesh)
        except ValueError as exc:
            return str(exc)
        return f"built, {len(opt.layers)} layers"
    finally:
        mesh.close()


def test_kfac_refuses_split_branches_before_training():
    # without the refusal, K-FAC fails at the first step: "layer ... ran no forward/backward"
    for message in run_ranks(2, kfac_with_branches, "data"):
        assert "parallel.branches='data'" in message and "'2'" in message
        assert "Set parallel.branches='none'" in message
    # the same model with its branches on every rank: all five convolutions preconditioned
    assert run_ranks(2, kfac_with_branches, "none") == ["built, 5 layers"] * 2
