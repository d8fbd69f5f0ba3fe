"""Each tensor-parallel Linear equals nn.Linear: outputs, input and weight gradients (fp32, ≤ 1e-5).

One 4-rank launch checks, for the grids tensor=4, data=2 × tensor=2, (2,1,2), (1,2,2) and
(2,2,1): the 1D column and row layers, the 3D layer in both orientations (with the batch split over
z, ragged batches included), a chained plain → transposed pair, the byte formula against the
ledger, and the exact full-weight state-dict round trip. The 8-rank grid (2,2,2) is in
test_tensor_grid8.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from exatrain.plan import Plan
from harness import rel_err, run_ranks

GRIDS_4 = [dict(tensor=4), dict(data=2, tensor=2), dict(tensor=(2, 1, 2)),
           dict(tensor=(1, 2, 2)), dict(tensor=(2, 2, 1))]
TOL = 1e-5


class MLP(nn.Module):
    def __init__(self, dim=8, hidden=16):
        super().__init__()
        self.fc_in = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc_out(self.act(self.fc_in(x)))


def _compare(layer_fn, linear: nn.Linear, x: torch.Tensor) -> dict:
    """Errors of (output, dx, dW, db) of `layer_fn` against `linear`, gradients gathered whole."""
    from exatrain.parallel.tensor.state import gather_full, layout_of

    ref = copy.deepcopy(linear)
    xr = x.detach().clone().requires_grad_()
    xp = x.detach().clone().requires_grad_()
    layer, forward = layer_fn(linear)
    yr, yp = ref(xr), forward(xp)
    weights = torch.randn_like(yr)          # a loss whose gradient differs per element
    (yr * weights).sum().backward()
    (yp * weights).sum().backward()
    errs = {"out": rel_err(yp, yr), "dx": rel_err(xp.grad, xr.grad),
            "dW": rel_err(gather_full(layer.weight.grad, layout_of(layer.weight)), ref.weight.grad)}
    if ref.bias is not None:
        bias_grad = gather_full(layer.bias.grad, layout_of(layer.bias))
        if getattr(layer.bias, "exatrain_grad_sum_axes", ()):  # 3D: partial over z until synced
            from exatrain.comm import all_reduce
            all_reduce(bias_grad, layer.grid.z)
        errs["db"] = rel_err(bias_grad, ref.bias.grad)
    return errs


class Parallel(nn.Module):
    """Two Linears side by side: b does not read a's output (not a column → row pair)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) + self.b(x)


class NormBetween(nn.Module):
    """A normalisation over the hidden features between the two Linears: on a split hidden
    dimension it would run silently and be wrong, so the pair must be refused."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.a(x)
        return self.b(h / h.norm(dim=-1, keepdim=True))


def layers_on_grids(grids, batches=(4, 5, 3)) -> dict:
    from exatrain.mesh import init
    from exatrain.parallel.tensor import parallelize_tensor
    from exatrain.parallel.tensor.linear1d import ColumnParallelLinear, RowParallelLinear
    from exatrain.parallel.tensor.linear3d import Grid3D, Linear3D, gather_batch, scatter_batch
    from exatrain.parallel.tensor.state import full_state_dict, load_full_state_dict

    results = {}
    for degrees in grids:
        mesh = init(Plan(**degrees))
        plan = mesh.plan
        errs: dict[str, float] = {}
        torch.manual_seed(1)                                # same weights and inputs everywhere
        linear = nn.Linear(8, 12)
        for batch in batches:                               # ragged over z included
            x = torch.randn(batch, 3, 8)
            if plan.tensor_3d:
                grid = Grid3D(mesh.axis("tensor_x"), mesh.axis("tensor_y"), mesh.axis("tensor_z"),
                              mesh.axis("tensor"))
                for transpose in (False, True):
                    def make(lin, transpose=transpose):
                        layer = Linear3D.from_linear(lin, grid, transpose=transpose)
                        def forward(inp):
                            local = scatter_batch(inp, grid.z)
                            return gather_batch(layer(local), grid.z, inp.shape[0])
                        return layer, forward
                    for k, v in _compare(make, linear, x).items():
                        errs[f"3d{'T' if transpose else ''}.{k}.b{batch}"] = v
            else:
                axis = mesh.axis("tensor")
                def column(lin):
                    layer = ColumnParallelLinear.from_linear(lin, axis, gather_output=True)
                    return layer, layer
                def row(lin):
                    layer = RowParallelLinear.from_linear(lin, axis, scatter_input=True)
                    return layer, layer
                for name, make in (("column", column), ("row", row)):
                    for k, v in _compare(make, linear, x).items():
                        errs[f"{name}.{k}.b{batch}"] = v

        # easy mode on a small model: a chained pair inside, single layers around it
        torch.manual_seed(2)
        model = nn.Sequential(nn.Linear(8, 8), MLP(), nn.Linear(8, 4))
        serial = copy.deepcopy(model)
        par = parallelize_tensor(model, mesh)
        assert model[0].weight.shape == (8, 8), "the input model must not change"
        tp = par.exatrain_tensor
        x = torch.randn(5, 3, 8)                            # 5: ragged over z
        mesh.ledger.reset()
        y = par(x.clone().requires_grad_())
        y.square().sum().backward()
        counted = {a: b for a, b in mesh.ledger.bytes_by_axis().items()}
        ys = serial(x.clone().requires_grad_())
        ys.square().sum().backward()
        errs["model.out"] = rel_err(y, ys)
        full_grads = {}
        from exatrain.parallel.tensor.state import gather_full, layout_of
        for n, p in par.named_parameters():
            full_grads[n] = gather_full(p.grad, layout_of(p))
        for n, p in serial.named_parameters():
            errs[f"model.grad.{n}"] = rel_err(full_grads[n], p.grad)

        # full-weight round trip: load a full state dict into the grid, save it back
        torch.manual_seed(3)
        other = nn.Sequential(nn.Linear(8, 8), MLP(), nn.Linear(8, 4))
        full = {k: v.clone() for k, v in other.state_dict().items()}
        load_full_state_dict(par, full)
        back = full_state_dict(par)
        exact = back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)
        local_shapes = {n: tuple(p.shape) for n, p in par.named_parameters()}
        # structures that look like pairs but are not: refused on the first training forward
        refusals = {}
        for cls in (Parallel, NormBetween):
            bad = parallelize_tensor(cls(), mesh)
            try:
                bad(torch.randn(4, 8, requires_grad=True))
                refusals[cls.__name__] = ""
            except ValueError as exc:
                refusals[cls.__name__] = str(exc)
            torch.manual_seed(4)
            plain = cls()
            reference = copy.deepcopy(plain)
            unpaired = parallelize_tensor(plain, mesh, pairs=False)   # each Linear on its own
            xi = torch.randn(4, 8)
            errs[f"model.unpaired.{cls.__name__}"] = rel_err(unpaired(xi), reference(xi))
        if not plan.tensor_3d:
            # sequence parallelism with an attention that cannot be split: refused, not wrong
            from exatrain.models.gpt import GPT, GPTConfig
            from exatrain.train.config import ParallelOptions
            two_heads = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2,
                                      n_embd=32))
            try:
                parallelize_tensor(two_heads, mesh, ParallelOptions(sequence_parallel=True))
                refusals["sequence_parallel"] = ""
            except ValueError as exc:
                refusals["sequence_parallel"] = str(exc)
            # and with one that can: the bytes of a step still match the formula
            torch.manual_seed(5)
            gpt = parallelize_tensor(
                GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)),
                mesh, ParallelOptions(sequence_parallel=True))
            mark = mesh.ledger.snapshot()
            tokens = torch.randint(0, 64, (3, 16))
            gpt(tokens).square().mean().backward()
            errs["sp.bytes_mismatch"] = float(
                mesh.ledger.since(mark).bytes_by_axis() != gpt.exatrain_tensor.bytes_per_step())
        results[str(plan)] = {"refusals": refusals, "errs": errs, "counted": counted,
                              "formula": tp.bytes_per_step(),
                              "split": tp.summary()["split"], "chained": tp.summary()["chained"],
                              "exact_round_trip": exact, "local_shapes": local_shapes}
    return results


@pytest.fixture(scope="module")
def grid_results():
    return run_ranks(4, layers_on_grids, GRIDS_4)


def test_parallel_linears_equal_nn_linear(grid_results):
    for rank, per_plan in enumerate(grid_results):
        assert len(per_plan) == len(GRIDS_4)
        for plan, r in per_plan.items():
            worst = max(r["errs"], key=r["errs"].get)
            assert r["errs"][worst] <= TOL, (rank, plan, worst, r["errs"][worst])
            # every kind of layer was checked on every grid
            kinds = {k.split(".")[0] for k in r["errs"]}
            assert kinds >= ({"3d", "3dT"} if "tensor=(" in plan else {"column", "row"}) | {"model"}


def test_easy_mode_splits_and_chains(grid_results):
    r = grid_results[0]["Plan(tensor=(2, 1, 2))"]
    assert r["chained"] == ["1"]
    assert sorted(r["split"]) == ["0", "1.fc_in", "1.fc_out", "2"]
    # 3D weight (out, in) = (16, 8) for fc_in: out over x=2 and z=2, in over y=1 -> (4, 8)
    assert r["local_shapes"]["1.fc_in.weight"] == (4, 8)
    # fc_out is transposed: out=8 over y=1 and z=2, in=16 over x=2 -> (4, 8)
    assert r["local_shapes"]["1.fc_out.weight"] == (4, 8)
    assert grid_results[0]["Plan(tensor=4)"]["local_shapes"]["1.fc_out.weight"] == (8, 4)


def test_false_pairs_are_refused_with_a_fix(grid_results):
    for per_plan in grid_results:
        for plan, r in per_plan.items():
            assert "not computed from the column" in r["refusals"]["Parallel"], plan
            assert "LinalgVectorNormBackward" in r["refusals"]["NormBetween"], plan
            assert "pairs=False" in r["refusals"]["Parallel"]
            if "tensor=(" not in plan and "tensor=2" not in plan:   # 2 heads split over 4: no
                assert "blocks.0.attn" in r["refusals"]["sequence_parallel"], plan


def test_bytes_counted_equal_formula(grid_results):
    for per_plan in grid_results:
        for plan, r in per_plan.items():
            assert r["counted"] == r["formula"], (plan, r["counted"], r["formula"])
            assert r["counted"], plan


def test_full_weight_round_trip_is_exact(grid_results):
    for per_plan in grid_results:
        for plan, r in per_plan.items():
            assert r["exact_round_trip"], plan


# ------------------------------------------------------------------ no process group needed
def test_find_pairs_on_the_models():
    from exatrain.models.gpt import GPT, GPTConfig
    from exatrain.models.vit import ViTForecaster
    from exatrain.parallel.tensor import find_pairs

    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    pairs = {name: (cols, row) for name, _m, cols, row in find_pairs(gpt)}
    assert pairs["blocks.0.attn"] == (["q_proj", "k_proj", "v_proj"], "out_proj")
    assert pairs["blocks.1.mlp"] == (["fc_in"], "fc_out")
    assert len(pairs) == 4                      # lm_head stands alone
    vit = ViTForecaster(img_size=(8, 16), patch_size=4, embed_dim=32, depth=1, num_heads=4)
    assert sorted(n for n, *_ in find_pairs(vit)) == ["blocks.0.attn", "blocks.0.mlp"]
    # a module with a norm between its Linears is not chained
    odd = nn.Module()
    odd.a, odd.norm, odd.b = nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)
    assert find_pairs(odd) == []


def test_clone_tree_shares_storage_not_objects():
    from exatrain.parallel.tensor import clone_tree

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight                   # tied
    copy_ = clone_tree(model)
    assert copy_ is not model and copy_[0] is not model[0]
    assert copy_[0].weight is not model[0].weight
    assert copy_[0].weight.data_ptr() == model[0].weight.data_ptr()
    assert copy_[1].weight is copy_[0].weight           # still tied in the copy
    copy_.register_forward_hook(lambda *a: None)
    assert not model._forward_hooks

