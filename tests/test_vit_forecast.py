"""ViT forecaster + shallow-water forecast data: shapes, physics, and a tiny training run."""

from __future__ import annotations

import math
import os
import pickle

import h5py
import numpy as np
import pytest
import torch

from exatrain.data.forecast import ForecastDataset
from exatrain.data.forecast_synth import simulate_shallow_water, write_forecast
from exatrain.models.vit import (
    ViTForecaster,
    flops_per_sample,
    patchify,
    relative_l2_loss,
    unpatchify,
)

H, W = 32, 64  # small grid for the data tests; the physics is resolution independent



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("forecast")
    info = write_forecast(
        out, trajectories=8, steps=12, height=H, width=W, seed=0, val_fraction=0.25
    )
    return out, info


def _energy(fields: np.ndarray, g: float = 1.0) -> np.ndarray:
    """Available energy per snapshot, (N, T): sum of h (u^2 + v^2) / 2 + g (h - <h>)^2 / 2.

    Total energy minus the (conserved, since mass is) energy of the fluid at rest
    with the same mass; without that offset the ratio E(t) / E(0) means nothing.
    """
    h, u, v = (fields[:, :, c].astype(np.float64) for c in range(3))
    eta = h - h.mean(axis=(-2, -1), keepdims=True)
    return (0.5 * h * (u**2 + v**2) + 0.5 * g * eta**2).sum(axis=(-2, -1))


# ------------------------------------------------------------------------- model


def test_model_shapes(one_thread):
    m = ViTForecaster()  # defaults: (64, 128), patch 8, 3 -> 3 channels, residual
    assert m.residual and isinstance(m.blocks, torch.nn.ModuleList) and len(m.blocks) == 4
    assert m.num_patches == 8 * 16
    with torch.no_grad():
        assert m(torch.randn(1, 3, 64, 128)).shape == (1, 3, 64, 128)
    m2 = ViTForecaster(
        img_size=(16, 32), patch_size=4, in_channels=3, out_channels=2, embed_dim=32, depth=1
    )
    assert not m2.residual
    with torch.no_grad():
        assert m2(torch.randn(1, 3, 16, 32)).shape == (1, 2, 16, 32)
    attn = m.blocks[0].attn
    for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert isinstance(getattr(attn, name), torch.nn.Linear)
    assert isinstance(m.patch_embed, torch.nn.Linear) and m.patch_embed.in_features == 8 * 8 * 3
    with pytest.raises(ValueError, match="divisible"):
        ViTForecaster(img_size=(30, 64))
    with pytest.raises(ValueError, match="residual"):
        ViTForecaster(in_channels=3, out_channels=2, residual=True)
    with pytest.raises(ValueError, match="expected input"):
        m(torch.randn(1, 3, 32, 64))


def test_untrained_residual_model_is_persistence():
    m = ViTForecaster(img_size=(16, 32), patch_size=8, embed_dim=32, depth=1, num_heads=2)
    x = torch.randn(2, 3, 16, 32)
    with torch.no_grad():
        torch.testing.assert_close(m(x), x, rtol=0, atol=0)


def test_patchify_unpatchify_roundtrip_exact():
    x = torch.randn(2, 3, 16, 24)
    t = patchify(x, 8)
    assert t.shape == (2, 6, 8 * 8 * 3)
    # Token 1 is the patch in the first patch-row, second patch-column.
    assert torch.equal(t[:, 1].reshape(2, 8, 8, 3), x[:, :, :8, 8:16].permute(0, 2, 3, 1))
    assert torch.equal(unpatchify(t, 8, 16, 24), x)
    m = ViTForecaster(img_size=(16, 24), patch_size=4, embed_dim=16, depth=1, num_heads=2)
    assert torch.equal(m.unpatchify(m.patchify(x)), x)


def test_attention_matches_reference():
    m = ViTForecaster(img_size=(16, 16), patch_size=4, embed_dim=32, depth=1, num_heads=4)
    attn = m.blocks[0].attn
    z = torch.randn(2, 16, 32)
    B, N, D, nh = 2, 16, 32, 4
    q, k, v = (
        p(z).reshape(B, N, nh, D // nh).transpose(1, 2)
        for p in (attn.q_proj, attn.k_proj, attn.v_proj)
    )
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D // nh), dim=-1)  # not causal
    ref = attn.out_proj((w @ v).transpose(1, 2).reshape(B, N, D))
    torch.testing.assert_close(attn(z), ref, rtol=1e-5, atol=1e-6)


def test_relative_l2_loss():
    x = torch.randn(4, 3, 8, 8)
    assert relative_l2_loss(x, x).item() == 0.0
    # Identity prediction of a target scaled by a: ||x - a x|| / ||a x|| = |1 - a| / |a|.
    for a in (2.0, 0.5, -1.0):
        assert relative_l2_loss(x, a * x).item() == pytest.approx(abs(1 - a) / abs(a), rel=1e-5)
    # Per-sample, then averaged: sample 0 scaled by 2 (0.5), sample 1 exact (0).
    target = torch.stack([2 * x[0], x[1]])
    assert relative_l2_loss(x[:2], target).item() == pytest.approx(0.25, rel=1e-5)
    # Scale invariance: the loss does not change if both are scaled.
    y = torch.randn(4, 3, 8, 8)
    scaled = relative_l2_loss(10 * x, 10 * y).item()
    assert scaled == pytest.approx(relative_l2_loss(x, y).item(), rel=1e-5)


def test_flops_per_sample():
    cfg = dict(img_size=(32, 64), patch_size=8, embed_dim=64, depth=2, num_heads=4)
    m = ViTForecaster(**cfg)
    P = sum(p.numel() for p in m.parameters()) - m.pos_embed.numel()
    T, L, D = 32, 2, 64
    assert flops_per_sample(m) == 6 * P * T + 12 * L * T**2 * D
    assert flops_per_sample(cfg) == flops_per_sample(m)
    # Default model: ~ 6 * 1.9M params * 128 tokens; attention is a few percent of it.
    full = flops_per_sample({})
    assert 1e9 < full < 3e9
    with pytest.raises(TypeError):
        flops_per_sample(42)


# -------------------------------------------------------------------- simulation


def test_simulation_conserves_mass_and_energy():
    fields, params = simulate_shallow_water(2, 60, H, W, dt_save=0.05, seed=3)  # t = 0 .. 2.95
    assert fields.shape == (2, 60, 3, H, W) and np.isfinite(fields).all()
    mass = fields[:, :, 0].sum(axis=(-2, -1))
    assert np.abs(mass / mass[:, :1] - 1).max() < 1e-10  # flux form: round-off only
    # The scheme conserves energy semi-discretely; RK3 and hyperdiffusion only remove
    # a little. Nothing may create energy (no blow-up). The tolerance above 1 covers
    # evaluating it on face-to-centre averaged velocities rather than the C-grid's.
    ratio = _energy(fields) / _energy(fields[:, :1])
    assert ratio.max() < 1.0005 and ratio.min() > 0.9
    assert np.abs(fields[:, :, 1:]).max() < 0.5  # |u|, |v| stay well below c = 1
    assert params["dt"] * params["substeps_per_save"] == pytest.approx(0.05)
    assert params["dt"] <= 0.4 * params["dx"] / math.sqrt(params["g"] * params["H0"]) + 1e-12


def test_simulation_deterministic_and_seeded():
    a, _ = simulate_shallow_water(2, 3, 16, 32, seed=5)
    b, _ = simulate_shallow_water(2, 3, 16, 32, seed=5)
    c, _ = simulate_shallow_water(2, 3, 16, 32, seed=6)
    assert np.array_equal(a, b) and not np.allclose(a, c)


def test_files_layout_and_attrs(data):
    out, info = data
    assert info["n_train"] == 6 and info["n_val"] == 2 and info["shape"] == (8, 12, 3, H, W)
    assert sorted(os.listdir(out)) == ["train.h5", "val.h5"]  # no temp files left behind
    with h5py.File(out / "train.h5", "r") as ft, h5py.File(out / "val.h5", "r") as fv:
        tr, va = ft["fields"], fv["fields"]
        assert tr.shape == (6, 12, 3, H, W) and va.shape == (2, 12, 3, H, W)
        assert tr.dtype == np.float32
        assert "shallow water" in ft.attrs["equation"]
        names = [c.decode() if isinstance(c, bytes) else c for c in ft.attrs["channels"]]
        assert names == ["h", "u", "v"]
        assert ft.attrs["dt"] > 0 and ft.attrs["g"] == 1.0
        arr = tr[...].astype(np.float64)
        np.testing.assert_allclose(
            ft.attrs["mean"], arr.mean(axis=(0, 1, 3, 4)), rtol=1e-5, atol=1e-7
        )
        np.testing.assert_allclose(ft.attrs["std"], arr.std(axis=(0, 1, 3, 4)), rtol=1e-4)
        np.testing.assert_array_equal(fv.attrs["mean"], ft.attrs["mean"])  # val uses train stats
        mass = arr[:, :, 0].sum(axis=(-2, -1))
        assert np.abs(mass / mass[:, :1] - 1).max() < 1e-5  # float32 storage
        assert np.isfinite(arr).all()


def test_data_has_real_dynamics(data):
    out, _ = data
    ds = ForecastDataset(out / "val.h5")
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    x, y = torch.stack(xs), torch.stack(ys)
    # Every pair changes, in every channel.
    assert ((y - x).flatten(2).abs().amax(-1) > 1e-3).all()
    assert relative_l2_loss(x, y).item() > 0.1  # persistence is clearly wrong


# ----------------------------------------------------------------------- dataset


def test_dataset_pairs_normalisation_and_pickle(data):
    out, info = data
    ds = ForecastDataset(out / "train.h5")
    assert len(ds) == 6 * 11 and ds.channels == ["h", "u", "v"]
    x, y = ds[13]  # trajectory 1, t = 2
    assert x.dtype == torch.float32 and x.shape == (3, H, W) and y.shape == (3, H, W)
    with h5py.File(out / "train.h5", "r") as fh:
        raw = torch.from_numpy(fh["fields"][1, 2:4])
    mean = torch.tensor(info["mean"], dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(info["std"], dtype=torch.float32).view(3, 1, 1)
    torch.testing.assert_close(x, (raw[0] - mean) / std)
    torch.testing.assert_close(y, (raw[1] - mean) / std)
    allx = torch.stack([ds[i][0] for i in range(0, len(ds), 11)])  # t = 0 of each
    assert allx.isfinite().all()
    # lead and raw mode
    ds2 = ForecastDataset(out / "train.h5", lead=3, normalize=False)
    assert len(ds2) == 6 * 9
    x2, y2 = ds2[9]  # trajectory 1, t = 0 -> 3
    with h5py.File(out / "train.h5", "r") as fh:
        torch.testing.assert_close(y2, torch.from_numpy(fh["fields"][1, 3]))
    # Pickle with an open handle: the copy opens its own.
    assert ds._file is not None
    ds3 = pickle.loads(pickle.dumps(ds))
    assert ds3._file is None
    torch.testing.assert_close(ds3[13][0], x)
    ds.close()
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_dataset_errors(tmp_path, data):
    missing = tmp_path / "nope.h5"
    with pytest.raises(FileNotFoundError, match="exatrain data forecast --out") as ei:
        ForecastDataset(missing)
    assert str(missing) in str(ei.value)
    bad = tmp_path / "bad.h5"
    with h5py.File(bad, "w") as fh:
        fh["fields"] = np.zeros((2, 3, 8, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="bad.h5"):
        ForecastDataset(bad)
    with pytest.raises(ValueError, match="lead"):
        ForecastDataset(data[0] / "val.h5", lead=12)


# ---------------------------------------------------------------------- training


def _stack(path):
    ds = ForecastDataset(path)
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    ds.close()
    return torch.stack(xs), torch.stack(ys)


def test_tiny_vit_beats_persistence(data, one_thread):
    out, _ = data
    xtr, ytr = _stack(out / "train.h5")
    xva, yva = _stack(out / "val.h5")  # unseen initial conditions
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = ViTForecaster(img_size=(H, W), patch_size=8, embed_dim=64, depth=2, num_heads=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(80):
        idx = torch.randint(len(xtr), (32,), generator=gen)
        loss = relative_l2_loss(model(xtr[idx]), ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        model_err = relative_l2_loss(model(xva), yva).item()
    persistence = relative_l2_loss(xva, yva).item()
    assert model_err < 0.85 * persistence, (model_err, persistence)
