"""Channel- and filter-parallel convolutions equal serial ones (fp32, relative ≤ 1e-5).

One 4-rank launch checks, under Plan(tensor=4) and Plan(data=2, tensor=2):

* every kind (Conv1d/2d/3d, a strided Conv3d, ConvTranspose1d/2d/3d) with stride 2, dilation 2
  (and padding, output_padding for the transposed ones), groups=1: a filter-parallel layer that gathers its
  output and a channel-parallel layer that scatters its input, against the nn layer: output,
  input gradient, weight and bias gradients (gathered whole);
* a 2D and a 3D CNN (conv → BatchNorm → ReLU → MaxPool → conv, twice, a single conv, Flatten →
  Linear) through `parallelize`: three SGD steps on the replica's half of the batch under data=2,
  every weight and running statistic after them (full state dict) and the losses, against the same
  steps on one process; the pairs and singles found; the ledger's tensor bytes of a step against
  `bytes_per_step()`;
* a transposed pair (ConvTranspose2d -> BatchNorm -> ConvTranspose2d, both stride 2) through
  `parallelize`: two SGD steps on the replica's half, every weight and running statistic against
  one process;
* refusals with the module's name (a `parallel.chanfilt_skip` that names no convolution).

Measured errors: ≤ 1.3e-6 (a transposed conv's bias gradient; the reordered channel sums), ≤ 9e-7
after three SGD steps with momentum; the strided Conv3d ≤ 2.4e-7, the transposed pair ≤ 1.5e-6
after two steps that move its weights by 15 % to 200 %.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from exatrain.plan import Plan
from harness import rel_err, run_ranks

TOL = 1e-5
KINDS = {
    "Conv1d": lambda: nn.Conv1d(4, 8, 3, stride=2, padding=2, dilation=2),
    "Conv2d": lambda: nn.Conv2d(4, 8, 3, stride=2, padding=1, dilation=2),
    "Conv3d": lambda: nn.Conv3d(4, 8, 3, stride=1, padding=2, dilation=2),
    "StridedConv3d": lambda: nn.Conv3d(4, 8, 3, stride=2, padding=1),
    "ConvTranspose1d": lambda: nn.ConvTranspose1d(4, 8, 3, stride=2, padding=1, output_padding=1),
    "ConvTranspose2d": lambda: nn.ConvTranspose2d(4, 8, 3, stride=2, padding=1, dilation=2),
    "ConvTranspose3d": lambda: nn.ConvTranspose3d(4, 8, 2, stride=2),
}
SPATIAL = {"1d": (9,), "2d": (8, 7), "3d": (6, 6, 5)}


def cnn(dim: int) -> nn.Module:
    Conv = {2: nn.Conv2d, 3: nn.Conv3d}[dim]
    BN = {2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dim]
    Pool = {2: nn.MaxPool2d, 3: nn.MaxPool3d}[dim]
    size = 8
    return nn.Sequential(
        nn.Sequential(Conv(3, 8, 3, padding=1), BN(8), nn.ReLU(), Pool(2)),
        nn.Sequential(Conv(8, 8, 3, padding=2, dilation=2), BN(8), nn.LeakyReLU(0.1)),
        Conv(8, 8, 3, stride=2, padding=1, bias=False), BN(8), nn.ReLU(),
        Conv(8, 4, 1),                          # a pair, its channel side's bias whole
        Conv(4, 4, 1),                          # single: filter-parallel, output gathered
        nn.Flatten(), nn.Linear(4 * (size // 4) ** dim, 6))


def _layer_errs(make, x: torch.Tensor, side: str, axis) -> dict:
    from exatrain.parallel.tensor.conv import ChannelParallelConv, FilterParallelConv
    from exatrain.parallel.tensor.state import gather_full, layout_of

    torch.manual_seed(5)
    ref = make()
    layer = FilterParallelConv(ref, axis, gather_output=True) if side == "filter" else \
        ChannelParallelConv(ref, axis, scatter_input=True)
    xr, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yp = ref(xr), layer(xp)
    w = torch.randn_like(yr)
    (yr * w).sum().backward()
    (yp * w).sum().backward()
    return {"out": rel_err(yp, yr), "dx": rel_err(xp.grad, xr.grad),
            "dW": rel_err(gather_full(layer.weight.grad, layout_of(layer.weight)), ref.weight.grad),
            "db": rel_err(gather_full(layer.bias.grad, layout_of(layer.bias)), ref.bias.grad)}


def on_grids(grids, steps: int = 3) -> dict:
    from exatrain.mesh import init
    from exatrain.parallel import parallelize
    from exatrain.parallel.options import ParallelOptions
    from exatrain.parallel.tensor.state import full_state_dict

    out = {}
    for degrees in grids:
        mesh = init(Plan(**degrees))
        axis = mesh.axis("tensor")
        errs = {}
        gen = torch.Generator().manual_seed(0)
        for kind, make in KINDS.items():
            x = torch.randn(3, 4, *SPATIAL[kind[-2:]], generator=gen)
            for side in ("filter", "channel"):
                for k, v in _layer_errs(make, x, side, axis).items():
                    errs[f"{kind}.{side}.{k}"] = v

        found, losses, serial_losses, bytes_ok = {}, {}, {}, {}
        tensor_counted, predicted = {}, {}
        for dim in (2, 3):
            torch.manual_seed(dim)
            plain = cnn(dim)
            serial = copy.deepcopy(plain)
            par = parallelize(plain, mesh)
            tp = par.module.exatrain_tensor if hasattr(par, "module") else par.exatrain_tensor
            found[dim] = tp.summary()
            x = torch.randn(4, 3, *(8,) * dim, generator=gen)
            y = torch.randn(4, 6, generator=gen)
            data = mesh.axis("data")
            half = x.shape[0] // data.size
            mine = slice(data.rank * half, (data.rank + 1) * half)
            opt = torch.optim.SGD(par.parameters(), lr=0.1, momentum=0.9)
            opt_s = torch.optim.SGD(serial.parameters(), lr=0.1, momentum=0.9)
            losses[dim], serial_losses[dim] = [], []
            for _ in range(steps):
                mark = mesh.ledger.snapshot()
                loss = (par(x[mine]) - y[mine]).square().mean()
                opt.zero_grad()
                loss.backward()
                counted = mesh.ledger.since(mark).bytes_by_axis()
                bytes_ok[dim] = counted.get("tensor", 0) == tp.bytes_per_step().get("tensor", 0)
                tensor_counted[dim] = counted.get("tensor", 0)
                opt.step()
                losses[dim].append(float(loss.detach()))
                loss_s = (serial(x) - y).square().mean()
                opt_s.zero_grad()
                loss_s.backward()
                opt_s.step()
                serial_losses[dim].append(float(loss_s))
            from exatrain.tune.chanfilt import conv_terms
            predicted[dim] = conv_terms(cnn(dim), mesh.plan, tuple(x[mine].shape))
            full = full_state_dict(par)
            ref = serial.state_dict()
            for k, v in ref.items():
                errs[f"cnn{dim}.{k}"] = rel_err(full[k].float(), v.float())
        # a transposed pair (filter-parallel ConvTranspose2d -> BatchNorm -> channel-parallel
        # ConvTranspose2d: weight dims 1 and 0 split) through `parallelize`: two SGD steps
        torch.manual_seed(7)
        plain = nn.Sequential(nn.ConvTranspose2d(3, 8, 3, stride=2, padding=1, output_padding=1),
                              nn.BatchNorm2d(8), nn.ReLU(), nn.ConvTranspose2d(8, 4, 2, stride=2))
        serial = copy.deepcopy(plain)
        par = parallelize(plain, mesh)
        tp = par.module.exatrain_tensor if hasattr(par, "module") else par.exatrain_tensor
        found["transposed"] = tp.summary()
        x, w = torch.randn(4, 3, 5, 6, generator=gen), torch.randn(4, 4, 20, 24, generator=gen)
        half = x.shape[0] // mesh.axis("data").size
        mine = slice(mesh.axis("data").rank * half, (mesh.axis("data").rank + 1) * half)
        opt = torch.optim.SGD(par.parameters(), lr=0.01)
        opt_s = torch.optim.SGD(serial.parameters(), lr=0.01)
        for _ in range(2):          # per-sample sums: the replicas' mean is the batch's
            opt.zero_grad()
            ((par(x[mine]) * w[mine]).sum() / half).backward()
            opt.step()
            opt_s.zero_grad()
            ((serial(x) * w).sum() / x.shape[0]).backward()
            opt_s.step()
        full = full_state_dict(par)
        for k, v in serial.state_dict().items():
            if v.is_floating_point():
                errs[f"transposed.{k}"] = rel_err(full[k].float(), v.float())
        refusal = ""
        try:
            parallelize(cnn(2), mesh, ParallelOptions(chanfilt_skip=["nope"]))
        except ValueError as exc:
            refusal = str(exc)
        # nothing left to split but weight-normed layers, which stay whole: they are named
        norm = nn.utils.parametrizations.weight_norm
        normed = nn.Sequential(norm(nn.Linear(6, 8)), nn.ReLU(), norm(nn.Linear(8, 8)),
                               nn.ReLU(), nn.Linear(8, 3))
        try:
            parallelize(normed, mesh)
            kept_refusal = ""
        except ValueError as exc:
            kept_refusal = f"{type(exc).__name__}: {exc}"
        out[str(mesh.plan)] = dict(errs=errs, found=found, losses=losses,
                                   serial_losses=serial_losses, bytes_ok=bytes_ok,
                                   refusal=refusal, kept_refusal=kept_refusal, data=mesh.axis("data").size,
                                   tensor_counted=tensor_counted, predicted=predicted)
        mesh.close()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(4, on_grids, [dict(tensor=4), dict(data=2, tensor=2)])


def test_every_conv_kind_equals_serial(results):
    layers = {f"{kind}.{side}.{k}" for kind in KINDS for side in ("filter", "channel")
              for k in ("out", "dx", "dW", "db")}
    for per_rank in results:
        assert len(per_rank) == 2   # both grids
        for plan, r in per_rank.items():
            # every entry there to compare: each kind both ways, and the trained models' state
            assert layers <= r["errs"].keys(), (plan, sorted(layers - r["errs"].keys()))
            for model in ("cnn2", "cnn3", "transposed"):
                assert any(k.startswith(f"{model}.") and k.endswith(".weight")
                           for k in r["errs"]), (plan, model)
            bad = {k: v for k, v in r["errs"].items() if v > TOL}
            assert not bad, (plan, bad)


def test_cnn_pairs_train_like_serial(results):
    for plan, r in results[0].items():
        for dim in (2, 3):
            f = r["found"][dim]
            assert f["conv_pairs"] == [["0.0", "1.0"], ["2", "5"]], f
            assert f["conv_gathered"] == ["6"], f
            assert r["bytes_ok"][dim], (plan, dim)
            if r["data"] == 1:  # under data=2 each rank's loss is its replica's half
                assert r["losses"][dim] == pytest.approx(r["serial_losses"][dim], rel=1e-5)
        t = r["found"]["transposed"]
        assert t["conv_pairs"] == [["0", "3"]] and t["conv_gathered"] == [], t


def test_planner_terms_equal_the_ledger(results):
    """tune/chanfilt.py's convolution terms: under tensor=4 the Linear stays whole (6 outputs), so
    the tensor axis carries the convolutions' bytes and the seed only: exactly the prediction."""
    r = results[0]["Plan(tensor=4)"]
    for dim in (2, 3):
        p = r["predicted"][dim]
        assert p["pairs"] == [("0.0", "1.0"), ("2", "5")], p
        assert r["tensor_counted"][dim] == p["tensor_bytes"], (dim, r["tensor_counted"], p)


def test_unknown_names_are_refused(results):
    for plan, r in results[0].items():
        assert "'nope' is no convolution" in r["refusal"] and "0.0" in r["refusal"], plan


def test_a_model_whose_splittable_layers_stay_whole_is_refused_naming_them(results):
    for plan, r in results[0].items():
        for words in ("TensorSplitError", "0, 2 stay whole", "weight or spectral norm",
                      "(8, 3)", "tensor=1"):
            assert words in r["kept_refusal"], (plan, words, r["kept_refusal"])


# ------------------------------------------------------------------ the switch from space to tensor
def _tiny_cosmoflow() -> nn.Module:
    """16³, 4 conv blocks of 4 -> 32 channels with BatchNorm (test_tensor_conv_models.py's)."""
    from exatrain.models.cosmoflow import CosmoFlow
    with torch.device("meta"):
        return CosmoFlow(size=16, base_channels=4, conv_layers=4, batchnorm=True)


def test_switch_point_byte_rule_and_weight_fallback():
    """switch.py's rule, by hand (s = 4 bytes, t = 2; convolutions features.0/4/8/12 see
    C_in -> C_out = 4->4, 4->8, 8->16, 16->32, each at 16³, 8³, 4³, 2³ in and out, kernel 3
    so r = 1):
    tensor_k = N·(C_in·V_in + C_out·V_out)·s/2, space_k = |W_k|·s/2 + 2·N·C_in·V_in^(2/3)·s.
    N = 1: features.4 12288 > 3776, features.8 3072 <= 7936: switch at features.8.
    N = 8: features.8 24576 > 15104, features.12 6144 <= 31744: switch at features.12.
    No example: the convolutions from features.8 on hold 17280 of 18576 weights (>= 90 %),
    from features.12 only 13824."""
    from exatrain.parallel.tensor.switch import space_bytes, switch_point, tensor_bytes
    from exatrain.parallel.tensor.switch import conv_shapes

    model = _tiny_cosmoflow()
    for n, first in ((1, "features.8"), (8, "features.12")):
        example = torch.empty(n, 4, 16, 16, 16, device="meta")
        assert switch_point(model, 2, example) == first, n
        shapes = conv_shapes(model, example)
        c = shapes["features.8"]
        assert tensor_bytes(c, 4) == n * (8 * 4 ** 3 + 16 * 4 ** 3) * 4 / 2
        assert space_bytes(c, 4, 2) == pytest.approx(16 * 8 * 27 * 4 / 2 + 2 * n * 8 * 4 ** 2 * 4)
    assert switch_point(model, 2) == "features.8"


def test_trainer_example_places_the_switch_where_the_planner_does():
    """Under space × tensor the Trainer's example (`train.job.pipeline_example`: the whole
    samples of one replica's batch, on meta, from one block) gives `conv_selection` the byte
    rule's switch, the planner's (`tune.chanfilt.conv_terms`), not the weight fallback;
    `parallel.chanfilt_from` moves it, `parallel.chanfilt_skip` keeps a convolution whole."""
    from types import SimpleNamespace

    from exatrain.parallel.options import ParallelOptions
    from exatrain.parallel.tensor.switch import conv_selection
    from exatrain.train.job import pipeline_example
    from exatrain.tune.chanfilt import conv_terms

    model = _tiny_cosmoflow()
    plan = Plan(space=(1, 1, 2), tensor=2)
    workload = SimpleNamespace(train_set=[(torch.zeros(4, 16, 16, 8), torch.zeros(4))],
                               decode_inputs=lambda x: x, input_blocks=True,  # reads blocks
                               collate_fn=None)   # samples stacked
    config = SimpleNamespace(train=SimpleNamespace(batch_size=8))
    example = pipeline_example(workload, config, plan)
    assert example.is_meta and tuple(example.shape) == (8, 4, 16, 16, 16)
    assert pipeline_example(workload, config, Plan(tensor=2)) is None   # no space: no switch
    assert conv_selection(model, plan, ParallelOptions(), example) == {"features.12"}
    assert conv_terms(model, plan, tuple(example.shape))["switch"] == "features.12"
    assert conv_selection(model, plan, ParallelOptions()) == {"features.8", "features.12"}
    moved = ParallelOptions(chanfilt_from="features.4")
    assert conv_selection(model, plan, moved, example) == {"features.4", "features.8",
                                                          "features.12"}
    assert conv_terms(model, plan, tuple(example.shape), chanfilt_from="features.4")["switch"] \
        == "features.4"
    skip = ParallelOptions(chanfilt_from="features.4", chanfilt_skip=["features.8"])
    assert conv_selection(model, plan, skip, example) == {"features.4", "features.12"}
