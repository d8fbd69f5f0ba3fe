"""Spatial parallelism, layer by layer: every distributed layer equals the serial layer.

For each layer and split, the same weights and input run serially (the whole batch) and on the
spatial ranks (each rank its block); we compare the forward output, the input gradient and the
weight gradients (summed over the data × space ranks, as the data-parallel all-reduce does) at
relative error ≤ 1e-5 (float32; measured ≤ 5e-6). One spawned launch per world size runs every
case under several Plans (2 ranks: 1D/2D/3D splits along one dim; 4 ranks: 2D splits, a 3D split
of two dims, 4 blocks along one dim, and data × space), with and without overlapping the interior
convolution with the halo transfer. The launch also checks the halo bytes the ledger counted
against the analytic halo volume, and the error messages.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import nn

from harness import rel_err, run_ranks

TOL = 1e-5
SHAPES = {1: (2, 4, 32), 2: (2, 4, 16, 16), 3: (2, 4, 8, 8, 8)}


def _conv(nd, *a, **k):
    return (nn.Conv1d, nn.Conv2d, nn.Conv3d)[nd - 1](*a, **k)


def _convt(nd, *a, **k):
    return (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[nd - 1](*a, **k)


def _maxpool(nd, *a, **k):
    return (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)[nd - 1](*a, **k)


def _avgpool(nd, *a, **k):
    return (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)[nd - 1](*a, **k)


def _bn(nd, c):
    return (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[nd - 1](c)


def _flat(nd, shape, channels, pooled):
    return channels * math.prod(s // pooled for s in shape[2:])


def _instancenorm(nd, *a, **k):
    return (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[nd - 1](*a, **k)


LINEAR = {1: "linear", 2: "bilinear", 3: "trilinear"}


class ChannelsLastNorm(nn.Module):
    """A ConvNeXt-style norm over channels: permute to channels-last, LayerNorm(C), permute back."""

    def __init__(self, channels: int, rms: bool = False):
        super().__init__()
        self.norm = nn.RMSNorm(channels) if rms else nn.LayerNorm(channels)

    def forward(self, x):
        nd = x.dim() - 2
        y = self.norm(x.permute(0, *range(2, 2 + nd), 1))
        return y.permute(0, nd + 1, *range(1, nd + 1))


def cases(nd: int, parts: int) -> dict:
    """name -> factory of a serial module for `nd` spatial dims; `parts` = largest split degree."""
    shape = SHAPES[nd]
    out = {
        "conv_k3": lambda: _conv(nd, 4, 4, 3, padding=1),
        "conv_k5_stride2": lambda: _conv(nd, 4, 4, 5, stride=2, padding=2),
        "conv_k3_dilation2": lambda: _conv(nd, 4, 4, 3, padding=2, dilation=2),
        "conv_k1_stride2": lambda: _conv(nd, 4, 4, 1, stride=2),
        "conv_k3_stride2_grouped": lambda: _conv(nd, 4, 6, 3, stride=2, padding=1, groups=2),
        "maxpool_k3_stride2": lambda: _maxpool(nd, 3, stride=2, padding=1),
        "maxpool_k2": lambda: _maxpool(nd, 2),
        "avgpool_k3": lambda: _avgpool(nd, 3, stride=1, padding=1),
        "avgpool_k2": lambda: _avgpool(nd, 2),
        "batchnorm": lambda: _bn(nd, 4),
        "groupnorm": lambda: nn.GroupNorm(2, 4),
        "instancenorm_affine": lambda: (nn.InstanceNorm1d, nn.InstanceNorm2d,
                                        nn.InstanceNorm3d)[nd - 1](4, affine=True),
        "conv_instancenorm": lambda: nn.Sequential(  # (a bias before a norm gets no gradient)
            _conv(nd, 4, 4, 3, padding=1, bias=False),
            (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[nd - 1](4), nn.ReLU()),
        "convtranspose_k2_stride2": lambda: _convt(nd, 4, 4, 2, stride=2),
        "convtranspose_k3_stride2": lambda: _convt(nd, 4, 4, 3, stride=2, padding=1, output_padding=1),
        "upsample_nearest": lambda: nn.Upsample(scale_factor=2, mode="nearest"),
        # a one-cell halo; align_corners=True maps blocks at a non-integer offset, still one cell
        "upsample_linear": lambda: nn.Upsample(scale_factor=2, mode=LINEAR[nd]),
        "upsample_linear_align_corners": lambda: nn.Upsample(scale_factor=2, mode=LINEAR[nd],
                                                             align_corners=True),
        "upsample_linear_x1.5": lambda: nn.Upsample(scale_factor=1.5, mode=LINEAR[nd]),
        "upsample_linear_x3_align_corners": lambda: nn.Upsample(scale_factor=3, mode=LINEAR[nd],
                                                                align_corners=True),
        # reflect / replicate at the global boundary, circular wraps between first and last block
        "conv_reflect": lambda: _conv(nd, 4, 4, 3, padding=1, padding_mode="reflect"),
        "conv_replicate_k5_stride2": lambda: _conv(nd, 4, 4, 5, stride=2, padding=2,
                                                   padding_mode="replicate"),
        "conv_circular": lambda: _conv(nd, 4, 4, 3, padding=1, padding_mode="circular"),
        "conv_circular_k5_stride2": lambda: _conv(nd, 4, 4, 5, stride=2, padding=2,
                                                  padding_mode="circular"),
        "conv_reflect_dilation2": lambda: _conv(nd, 4, 4, 3, padding=2, dilation=2,
                                                padding_mode="reflect"),
        "instancenorm_running_stats": lambda: nn.Sequential(
            _conv(nd, 4, 4, 3, padding=1, bias=False),
            _instancenorm(nd, 4, affine=True, track_running_stats=True)),
        "layernorm_channels_last": lambda: nn.Sequential(
            _conv(nd, 4, 4, 3, padding=1), ChannelsLastNorm(4), nn.GELU()),
        "rmsnorm_channels_last": lambda: ChannelsLastNorm(4, rms=True),
        "pointwise_chain": lambda: nn.Sequential(nn.LeakyReLU(0.1), nn.Softmax(dim=1), nn.GELU()),
        "conv_bn_pool_flatten_linear": lambda: nn.Sequential(
            _conv(nd, 4, 4, 3, padding=1, bias=False), _bn(nd, 4), nn.ReLU(), _maxpool(nd, 2),
            _conv(nd, 4, 4, 3, padding=1), nn.Flatten(), nn.Linear(_flat(nd, shape, 4, 2), 5),
            nn.Tanh(), nn.Linear(5, 3)),
        "global_avgpool_head": lambda: nn.Sequential(
            _conv(nd, 4, 4, 3, padding=1), nn.ReLU(),
            (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)[nd - 1](1),
            nn.Flatten(), nn.Linear(4, 3)),
        "global_maxpool_head": lambda: nn.Sequential(
            _conv(nd, 4, 4, 3, padding=1), nn.ReLU(),
            (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)[nd - 1](1),
            nn.Flatten(), nn.Linear(4, 3)),
        # blocks shrink below the split: the deep layers gather and run replicated
        "deep_stack_gathers_early": lambda: nn.Sequential(
            *[m for i in range(3) for m in (_conv(nd, 4, 4, 3, padding=1),
                                             nn.LeakyReLU(0.01), _maxpool(nd, 2))],
            nn.Flatten(), nn.Linear(_flat(nd, shape, 4, 8), 3)),
    }
    if nd == 2:
        out["conv_k4_same_padding"] = lambda: nn.Conv2d(4, 4, 4, padding="same")
        out["conv_k3x5_mixed"] = lambda: nn.Conv2d(4, 4, (3, 5), stride=(1, 2), padding=(1, 2))
        out["conv_k4_same_circular"] = lambda: nn.Conv2d(4, 4, 4, padding="same",
                                                         padding_mode="circular")
        out["upsampling_bilinear2d"] = lambda: nn.UpsamplingBilinear2d(scale_factor=2)
        out["upsample_bilinear_size"] = lambda: nn.Upsample(size=(24, 40), mode="bilinear")
    if parts == 2:  # valid (unpadded) convolution: output 14 / 6, splits in two, not in four
        out["conv_k3_valid"] = lambda: _conv(nd, 4, 4, 3)
    return out


def _run_case(mesh, make, shape, overlap: bool, data: int) -> dict:
    from exatrain.comm import all_reduce
    from exatrain.parallel.spatial import gather_output, parallelize_spatial, split_input

    torch.manual_seed(0)
    serial = make()
    dist = parallelize_spatial(serial, mesh, overlap=overlap)  # a copy, before any step
    x = torch.randn(shape, requires_grad=True)
    y = serial(x)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    per = shape[0] // data
    r = mesh.axis("data").rank
    rows = slice(r * per, (r + 1) * per)
    xb = split_input(x.detach()[rows], mesh).requires_grad_()
    yb = dist(xb)
    split_out = yb.dim() == y.dim() and yb.dim() > 2
    gb = split_input(g[rows], mesh) if split_out else g[rows]
    (yb * gb).sum().backward()
    errs = {"output": rel_err(gather_output(yb.detach(), mesh) if split_out else yb, y[rows]),
            "input_grad": rel_err(gather_output(xb.grad, mesh), x.grad[rows])}
    for (name, p), (_, q) in zip(dist.named_parameters(), serial.named_parameters()):
        grad = p.grad.clone()
        all_reduce(grad, mesh.axis("data", "space"))
        errs[f"grad {name}"] = rel_err(grad, q.grad)
    for (name, b), (_, c) in zip(dist.named_buffers(), serial.named_buffers()):
        if b.is_floating_point():
            errs[f"buffer {name}"] = rel_err(b, c)
    return errs


OVERLAP_CASES = ("conv_k3", "conv_k5_stride2", "conv_k3_dilation2")


def check_layers(plans: list[tuple]) -> dict:
    """On each rank: the cases of every (data, space, dims, names) plan; {case: {what: rel err}}.

    `dims` are the model dimensionalities to run, `names` the cases (None: all).
    """
    from exatrain.mesh import init
    from exatrain.plan import Plan

    results = {}
    for i, (data, space, dims, names) in enumerate(plans):
        mesh = init(Plan(data=data, space=space))
        if i == 0:  # counted bytes, error messages and dropout masks, under the first plan
            results["_halo"] = _halo_bytes(mesh)
            results["_errors"] = _error_messages(mesh)
            results["_dropout"] = _dropout_masks(mesh)
        if space[0] > 1:
            results["_dims"] = _dims_message(mesh)
        for nd in dims:
            shape = (SHAPES[nd][0] * data,) + SHAPES[nd][1:]
            for name, make in cases(nd, max(space)).items():
                if names is not None and name not in names:
                    continue
                for overlap in ((False, True) if name in OVERLAP_CASES else (False,)):
                    key = f"{name} {nd}D data={data} space={space}" + (" overlap" if overlap else "")
                    results[key] = _run_case(mesh, make, shape, overlap, data)
    mesh.close()
    return results


def _analytic_halo(shape, parts, coords, k, s, p, d) -> int:
    """Input elements a rank's outputs read that it neither owns nor gets as zero padding."""
    need, own = 1, 1
    for n, P, c in zip(shape[2:], parts, coords):
        b = n // P
        m = ((n + 2 * p - d * (k - 1) - 1) // s + 1) // P
        lo, hi = c * m * s - p, ((c + 1) * m - 1) * s - p + d * (k - 1)
        need *= min(hi, n - 1) - max(lo, 0) + 1
        own *= b
    return (need - own) * shape[0] * shape[1]


def _halo_bytes(mesh) -> dict:
    """Counted halo bytes of one Conv2d k3 forward + backward against the analytic volume."""
    from exatrain.comm import all_reduce
    from exatrain.parallel.spatial import parallelize_spatial, split_input

    torch.manual_seed(0)
    shape = (2, 3, 16, 16)
    layer = parallelize_spatial(nn.Conv2d(3, 4, 3, padding=2, dilation=2), mesh)
    x = split_input(torch.randn(shape), mesh).requires_grad_()
    before = mesh.ledger.snapshot()
    layer(x).sum().backward()
    delta = mesh.ledger.since(before)
    counted = sum(e.bytes for (axis, op, tag), e in delta.entries.items()
                  if op == "recv" and tag == "halo")
    parts = mesh.plan.space[1:]
    coords = (mesh.coords["space_h"], mesh.coords["space_w"])
    analytic = 2 * 4 * _analytic_halo((1,) + shape[1:], parts, coords, 3, 1, 2, 2) * shape[0]
    both = torch.tensor([counted, analytic], dtype=torch.float64)
    all_reduce(both, mesh.axis("space"))
    return {"counted": int(both[0]), "analytic": int(both[1])}


def _error_messages(mesh) -> dict:
    from exatrain.parallel.spatial import SpatialSplitError, parallelize_spatial, split_input

    out = {}
    try:
        parallelize_spatial(nn.Sequential(OrderedDict(
            conv=nn.Conv2d(3, 4, 3, padding=1), pad=nn.ZeroPad2d(1),
            out=nn.Conv2d(4, 4, 3, padding=1))), mesh)
    except SpatialSplitError as err:
        out["unsupported"] = str(err)
    try:
        parallelize_spatial(nn.Upsample(scale_factor=2, mode="bicubic"), mesh)
    except SpatialSplitError as err:
        out["bicubic"] = str(err)
    # a LayerNorm over the (split) width, not over channels: refused at the first forward
    model = parallelize_spatial(nn.Sequential(OrderedDict(
        conv=nn.Conv2d(3, 4, 3, padding=1), norm=nn.LayerNorm(16))), mesh)
    try:
        model(split_input(torch.randn(2, 3, 16, 16), mesh))
    except SpatialSplitError as err:
        out["layernorm"] = str(err)
    try:
        parallelize_spatial(nn.Sequential(OrderedDict(
            conv=nn.Conv2d(3, 4, 3, padding=1), dense=nn.Linear(16, 2))), mesh)
    except SpatialSplitError as err:
        out["dense"] = str(err)
    model = parallelize_spatial(nn.Sequential(OrderedDict(
        stem=nn.Conv2d(3, 4, 3, padding=1),
        down=nn.Sequential(OrderedDict(conv=nn.Conv2d(4, 4, 3, stride=2))))), mesh)
    try:
        model(split_input(torch.randn(2, 3, 16, 16), mesh))
    except SpatialSplitError as err:
        out["geometry"] = str(err)
    return out


def _dims_message(mesh) -> str:
    """A 2D layer under a plan that splits depth."""
    from exatrain.parallel.spatial import SpatialSplitError, parallelize_spatial

    layer = parallelize_spatial(nn.Sequential(OrderedDict(conv=nn.Conv2d(1, 1, 3, padding=1))), mesh)
    try:
        layer(torch.randn(1, 1, 8, 8))
    except SpatialSplitError as err:
        return str(err)
    return ""


def _dropout_masks(mesh) -> bool:
    """Channel dropout drops the same channels in every block of a sample."""
    from exatrain.parallel.spatial import gather_output, parallelize_spatial, split_input

    drop = parallelize_spatial(nn.Dropout2d(0.5), mesh).train()
    torch.manual_seed(mesh.rank)  # different generators on every rank
    y = gather_output(drop(split_input(torch.ones(4, 8, 16, 16), mesh)), mesh)
    per_channel = y.flatten(2)
    return bool(((per_channel == 0).all(-1) | (per_channel == 2).all(-1)).all()
                and (per_channel == 0).any())


def _assert_all(results: dict) -> None:
    worst = {key: max(errs.values()) for key, errs in results.items() if not key.startswith("_")}
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, bad
    assert len(worst) > 40


def test_layers_two_ranks():
    plans = [(1, (1, 1, 2), (1, 2, 3), None), (1, (1, 2, 1), (2, 3), None),
             (1, (2, 1, 1), (3,), None)]
    results = run_ranks(2, check_layers, plans)
    for r in results:
        _assert_all(r)
    res = results[0]
    # halo bytes: exactly the elements read and not owned (dilation 2: two rows), fwd + bwd
    assert res["_halo"]["counted"] == res["_halo"]["analytic"] > 0
    errors = res["_errors"]
    assert "'pad' (ZeroPad2d)" in errors["unsupported"] and "Replace it" in errors["unsupported"]
    assert "mode='bicubic'" in errors["bicubic"] and "'trilinear'" in errors["bicubic"]
    for words in ("LayerNorm 'norm' normalises over the last 1 dims [16]", "[2, 4, 16, 8]",
                  "nn.GroupNorm(1, C)", "channels-last"):
        assert words in errors["layernorm"], (words, errors["layernorm"])
    assert "'dense' (Linear)" in errors["dense"] and "nn.Flatten" in errors["dense"]
    # stride 2, no padding on 16 pixels: 7 outputs do not split in two; the message says so
    assert "Conv2d 'down.conv'" in errors["geometry"] and "output length 7" in errors["geometry"]
    assert "space_w can be one of [1]" in errors["geometry"]
    assert res["_dropout"]
    assert "Conv2d 'conv' has 2 spatial dims" in res["_dims"]
    assert "e.g. space=(1, 2, 1) on as many ranks" in res["_dims"]   # depth's degree onto h


def test_layers_four_ranks():
    some = ("conv_k3", "conv_k5_stride2", "conv_k3_dilation2", "maxpool_k3_stride2", "avgpool_k3",
            "convtranspose_k3_stride2", "deep_stack_gathers_early")
    plans = [(1, (1, 2, 2), (2, 3), None),                  # 2D split: faces and corners
             (1, (2, 2, 1), (3,), some + ("batchnorm",)),   # 3D model split along d and h
             (1, (1, 1, 4), (1, 2), some),                  # four blocks along one dim
             (2, (1, 1, 2), (2,), ("batchnorm", "conv_bn_pool_flatten_linear",
                                   "global_avgpool_head", "conv_k3"))]  # data × space
    results = run_ranks(4, check_layers, plans)
    for r in results:
        _assert_all(r)
    # space=(1, 2, 2): faces and corners, counted exactly
    assert results[0]["_halo"]["counted"] == results[0]["_halo"]["analytic"] > 0
    assert results[0]["_dropout"]


def test_geometry_formulas():
    """Halo widths from the closed forms equal a brute-force scan of which inputs each block reads."""
    from exatrain.parallel.spatial.layers import Window, transpose_geometry, window_geometry

    for n, parts, k, s, p, d in [(16, 2, 3, 1, 1, 1), (16, 4, 5, 2, 2, 1), (24, 2, 5, 2, 0, 1),
                                 (16, 2, 3, 1, 2, 2), (16, 4, 1, 2, 0, 1), (16, 2, 2, 2, 0, 1)]:
        lefts, rights, m = window_geometry(n, parts, Window(k, s, d, p, p))
        b = n // parts
        for r in range(parts):
            reads = [j * s - p + d * t for j in range(r * m, (r + 1) * m) for t in range(k)]
            assert lefts[r] == r * b - min(reads) and rights[r] == max(reads) - ((r + 1) * b - 1)
    for n, parts, k, s, p, op in [(8, 2, 3, 2, 1, 1), (8, 2, 2, 2, 0, 0), (8, 4, 4, 2, 1, 0)]:
        lefts, rights, m, _ = transpose_geometry(n, parts, k, s, 1, p, op)
        b = n // parts
        for r in range(parts):
            reads = [i for i in range(-k, n + k) for t in range(k)
                     if r * m <= i * s - p + t < (r + 1) * m]
            assert lefts[r] == r * b - min(reads) and rights[r] == max(reads) - ((r + 1) * b - 1)
    assert "does not divide" in window_geometry(16, 2, Window(3, 2, 1, 0, 0))
    assert "only 2 wide" in window_geometry(8, 4, Window(7, 1, 1, 3, 3))

