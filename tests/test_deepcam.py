"""Tests for the DeepCAM model (models/deepcam.py) and data (data/deepcam.py, deepcam_synth.py, deepcam_write.py)."""

from __future__ import annotations

import pickle
import re

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from exatrain.data.deepcam import (
    CHANNEL_NAMES,
    DeepCAMDataset,
    FieldsDecoder,
    load_deepcam_stats,
)
from exatrain.data.deepcam_synth import synth_deepcam_sample
from exatrain.data.deepcam_write import write_deepcam
from exatrain.models.deepcam import (
    DeepCAM,
    class_weights_from_frequencies,
    confusion_matrix,
    mean_iou,
    weighted_cross_entropy,
)

CH = {name: i for i, name in enumerate(CHANNEL_NAMES)}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    """Eight 48x72 samples: 7 train, 1 val."""
    out = tmp_path_factory.mktemp("deepcam")
    info = write_deepcam(out, 8, height=48, width=72, seed=3)
    return out, info


# ------------------------------------------------------------------------ model


def test_model_output_shape_and_size():
    model = DeepCAM(in_channels=16, num_classes=3, width=8).eval()
    for h, w in [(32, 48), (24, 40)]:
        with torch.no_grad():
            out = model(torch.randn(2, 16, h, w))
        assert out.shape == (2, 3, h, w)
    with pytest.raises(ValueError, match="divisible"):
        model(torch.randn(1, 16, 30, 48))
    with pytest.raises(ValueError, match="expects input"):
        model(torch.randn(1, 4, 32, 48))
    n_params = sum(p.numel() for p in DeepCAM().parameters())
    assert 300_000 <= n_params <= 2_000_000


def test_model_has_only_local_layers():
    model = DeepCAM(width=8)
    allowed = (
        nn.Conv2d, nn.ConvTranspose2d, nn.BatchNorm2d, nn.ReLU, nn.LeakyReLU,
        nn.Dropout2d, nn.MaxPool2d, nn.AvgPool2d, nn.Upsample,
        nn.Sequential, nn.ModuleList,
    )  # fmt: skip
    for name, module in model.named_modules():
        if module is model or type(module).__name__ == "ASPP":
            continue
        assert isinstance(module, allowed), f"{name}: {type(module).__name__}"
        assert "Adaptive" not in type(module).__name__
        if isinstance(module, nn.Upsample):
            assert module.mode == "nearest"
    assert any(getattr(m, "dilation", (1, 1)) != (1, 1) for m in model.modules())
    # No global pooling: in eval mode, a change in one corner must not reach the
    # opposite corner of a domain much larger than the receptive field.
    model.eval()
    x = torch.randn(1, 16, 128, 128)
    x2 = x.clone()
    x2[..., :8, :8] += 5.0
    with torch.no_grad():
        y, y2 = model(x), model(x2)
    assert torch.equal(y[..., -16:, -16:], y2[..., -16:, -16:])
    assert not torch.equal(y[..., :8, :8], y2[..., :8, :8])


def test_metrics_and_loss():
    labels = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]])
    assert mean_iou(labels, labels, 3) == pytest.approx(1.0)  # class 2 absent: ignored
    trivial = torch.zeros_like(labels)
    assert mean_iou(trivial, labels, 3) == pytest.approx((6 / 8) / 2)
    pred = torch.tensor([[0, 1, 1, 2], [0, 0, 0, 0]])
    cm = confusion_matrix(pred, labels, 3)
    assert cm.tolist() == [[5, 1, 0], [0, 1, 1], [0, 0, 0]]
    assert mean_iou(pred, labels, 3) == pytest.approx((5 / 6 + 1 / 3 + 0.0) / 3)
    with pytest.raises(ValueError):
        mean_iou(pred, labels.flatten()[:5], 3)

    w = class_weights_from_frequencies([0.81, 0.09, 0.01])
    assert w.dtype == torch.float32 and w.sum().item() == pytest.approx(1.0)
    assert (w[1] / w[0]).item() == pytest.approx(3.0) and (w[2] / w[0]).item() == pytest.approx(9.0)
    assert torch.allclose(class_weights_from_frequencies([810, 90, 10]), w)  # counts work too
    assert torch.isfinite(class_weights_from_frequencies([1.0, 0.0, 0.0])).all()

    logits = torch.randn(2, 3, 4, 4)
    target = torch.randint(0, 3, (2, 4, 4))
    plain = F.cross_entropy(logits, target)
    assert torch.allclose(weighted_cross_entropy(logits, target, None), plain)
    assert torch.allclose(weighted_cross_entropy(logits, target, torch.ones(3) / 3), plain)
    lw = weighted_cross_entropy(logits, target, w)
    assert torch.allclose(lw, F.cross_entropy(logits, target, weight=w))


# ------------------------------------------------------------------------- data


def test_write_layout_shapes_and_stats(small_set):
    out, info = small_set
    assert info["train_samples"] == 7 and info["val_samples"] == 1
    assert sorted(p.name for p in (out / "train").iterdir()) == [
        f"data-{i:06d}.h5" for i in range(7)
    ]
    assert [p.name for p in (out / "val").iterdir()] == ["data-000007.h5"]
    assert not list(out.rglob(".*tmp*"))
    with h5py.File(out / "train" / "data-000000.h5", "r") as fh:
        assert fh["climate/data"].shape == (48, 72, 16)
        assert fh["climate/data"].dtype == np.float32
        assert fh["climate/labels_0"].shape == (48, 72)
        assert np.issubdtype(fh["climate/labels_0"].dtype, np.integer)
    stats = load_deepcam_stats(out / "stats.h5")
    assert stats["mean"].shape == (16,) and (stats["std"] > 0).all()
    assert stats["class_frequencies"].sum() == pytest.approx(1.0)
    assert np.allclose(load_deepcam_stats(out / "stats.json")["std"], stats["std"])

    ds = DeepCAMDataset(out / "train")  # finds ../stats.h5 by itself
    assert len(ds) == 7 and ds.sample_shape == (16, 48, 72)
    x, y = ds[0]
    assert x.shape == (16, 48, 72) and x.dtype == torch.float32
    assert y.shape == (48, 72) and y.dtype == torch.int64
    xs = torch.stack([ds[i][0] for i in range(len(ds))])
    # z-scored with train statistics: per-channel mean ~0, std ~1 over train
    assert xs.mean((0, 2, 3)).abs().max() < 1e-3
    assert (xs.std((0, 2, 3)) - 1).abs().max() < 1e-2
    raw, _ = DeepCAMDataset(out / "train", stats=False)[0]
    assert raw[CH["PSL"]].mean() > 9e4  # Pa, unnormalised


def test_generation_is_deterministic_and_all_classes_occur(tmp_path):
    a = write_deepcam(tmp_path / "a", 4, height=48, width=72, seed=5, val_fraction=0.25)
    b = write_deepcam(tmp_path / "b", 4, height=48, width=72, seed=5, val_fraction=0.25)
    c = write_deepcam(tmp_path / "c", 4, height=48, width=72, seed=6, val_fraction=0.25)
    assert a["mean"] == b["mean"] and a["class_frequencies"] == b["class_frequencies"]
    for name in ("train/data-000000.h5", "val/data-000003.h5"):
        with h5py.File(tmp_path / "a" / name) as fa, h5py.File(tmp_path / "b" / name) as fb:
            assert np.array_equal(fa["climate/data"][...], fb["climate/data"][...])
            assert np.array_equal(fa["climate/labels_0"][...], fb["climate/labels_0"][...])
    assert a["mean"] != c["mean"]
    seen = set()
    for i in range(4):
        seen |= set(np.unique(synth_deepcam_sample(48, 72, seed=5, index=i)[1]).tolist())
    assert seen == {0, 1, 2}
    # A smaller rerun into the same directory leaves no stale samples behind.
    write_deepcam(tmp_path / "a", 2, height=48, width=72, seed=5, val_fraction=0.5)
    assert len(list((tmp_path / "a" / "train").glob("data-*.h5"))) == 1
    assert len(list((tmp_path / "a" / "val").glob("data-*.h5"))) == 1


def test_labels_follow_from_fields():
    tc_wind, bg_wind, tc_dpsl, tc_min_dpsl, ar_tmq, bg_tmq, ar_ivt = ([] for _ in range(7))
    for i in range(6):
        data, labels = synth_deepcam_sample(96, 144, seed=11, index=i)
        wind = np.hypot(data[..., CH["UBOT"]], data[..., CH["VBOT"]])
        ivt = data[..., CH["TMQ"]] * np.hypot(data[..., CH["U850"]], data[..., CH["V850"]])
        tc, ar, bg = labels == 1, labels == 2, labels == 0
        tc_wind.append(wind[tc].mean())
        bg_wind.append(wind[bg].mean())
        # compare within the same latitude rows, so it is not just climatology
        rows = tc.any(axis=1)
        psl_bg = data[rows][..., CH["PSL"]][bg[rows]].mean()
        tc_dpsl.append(psl_bg - data[..., CH["PSL"]][tc].mean())
        tc_min_dpsl.append(psl_bg - data[..., CH["PSL"]][tc].min())
        rows = ar.any(axis=1)
        ar_tmq.append(data[..., CH["TMQ"]][ar].mean())
        bg_tmq.append(data[rows][..., CH["TMQ"]][bg[rows]].mean())
        ar_ivt.append(np.median(ivt[ar]))
    assert np.mean(tc_wind) > 2.0 * np.mean(bg_wind)
    assert min(tc_dpsl) > 300.0  # Pa: lower pressure over the whole storm ...
    assert min(tc_min_dpsl) > 1500.0  # ... and a deep central minimum
    assert np.mean(ar_tmq) > np.mean(bg_tmq) + 10.0  # kg m^-2 of extra water vapour
    assert np.min(ar_ivt) > 250.0  # kg m^-1 s^-1, the AR threshold


def test_hyperslab_read_matches_full_read(small_set):
    out, _ = small_set
    ds = DeepCAMDataset(out / "train")
    x, y = ds.read(2)
    full_bytes = ds.bytes_read
    assert full_bytes == 48 * 72 * 16 * 4 + 48 * 72 * 1  # float32 data + uint8 labels
    region = (slice(8, 24), slice(36, 72))
    xr, yr = ds.read(2, region=region)
    assert torch.equal(xr, x[:, 8:24, 36:72]) and torch.equal(yr, y[8:24, 36:72])
    assert ds.bytes_read - full_bytes == 16 * 36 * (16 * 4 + 1)
    with pytest.raises(TypeError):
        ds.read(0, region=(slice(0, 4),))
    # no open handles: the dataset pickles and keeps working in another "process"
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone.read(2, region=region)[0], xr)


def test_fields_decoder_on_the_device_equals_the_cpu_normalisation(small_set):
    """Fields and labels as stored, normalised on the device: the CPU path's values to the last
    bit (whole fields and a spatial block), contiguous like them; a decoded batch passes."""
    out, _ = small_set
    cpu, raw = DeepCAMDataset(out / "train"), DeepCAMDataset(out / "train")
    raw.raw = True
    decode = FieldsDecoder(*raw.normalisation, channels=16)
    for region in (None, (slice(8, 24), slice(36, 72))):
        pairs = [(cpu.read(i, region), raw.read(i, region)) for i in (0, 3, 5)]
        xs = torch.stack([r[0] for _, r in pairs])
        assert xs.shape[-1] == 16 and xs.dtype == torch.float32  # (N, H, W, C) as stored
        assert all(r[1].dtype == torch.uint8 for _, r in pairs)  # labels as stored
        batch = decode(xs)
        assert torch.equal(batch, torch.stack([c[0] for c, _ in pairs]))
        assert batch.is_contiguous()
        assert all(torch.equal(c[1], r[1].long()) for c, r in pairs)
        assert decode(batch) is batch  # decoded inputs pass through
    assert cpu.bytes_read == raw.bytes_read  # the same bytes read from the files


def test_clear_errors(tmp_path, small_set):
    out, _ = small_set
    missing = tmp_path / "nope" / "train"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))) as err:
        DeepCAMDataset(missing)
    assert "exatrain data deepcam --out DIR" in str(err.value)

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "data-000000.h5").write_bytes(b"not an hdf5 file")
    with h5py.File(bad / "data-000001.h5", "w") as fh:
        fh["climate/data"] = np.zeros((8, 8, 16), np.float32)
        fh["climate/labels_0"] = np.zeros((8, 9), np.uint8)
    ds = DeepCAMDataset(bad, stats=out / "stats.h5")
    with pytest.raises(ValueError, match="data-000000.h5"):
        ds[0]
    with pytest.raises(ValueError, match="data-000001.h5"):
        ds[1]


def test_reads_mlperf_style_files_with_minmax_stats(tmp_path):
    """Real DeepCAM: date-stamped names, float labels, stats.h5 with only min/max."""
    split = tmp_path / "validation"
    split.mkdir()
    rng = np.random.default_rng(0)
    data = rng.uniform(-1.0, 3.0, size=(16, 24, 16)).astype(np.float32)
    with h5py.File(split / "data-2107-12-26-02-1.h5", "w") as fh:
        fh["climate/data"] = data
        fh["climate/labels_0"] = np.ones((16, 24), np.float32)
    with h5py.File(tmp_path / "stats.h5", "w") as fh:
        fh["climate/minval"] = np.full(16, -1.0)
        fh["climate/maxval"] = np.full(16, 3.0)
    x, y = DeepCAMDataset(split)[0]
    assert torch.allclose(x, torch.from_numpy((data.transpose(2, 0, 1) + 1.0) / 4.0))
    assert y.dtype == torch.int64 and (y == 1).all()


# --------------------------------------------------------------------- learning


def test_tiny_training_beats_trivial_prediction(tmp_path):
    info = write_deepcam(tmp_path, 32, height=48, width=72, seed=1, val_fraction=0.25)
    train, val = DeepCAMDataset(info["train_dir"]), DeepCAMDataset(info["val_dir"])
    x, y = (torch.stack(t) for t in zip(*(train[i] for i in range(len(train)))))
    xv, yv = (torch.stack(t) for t in zip(*(val[i] for i in range(len(val)))))
    assert len(x) == 24 and len(xv) == 8

    torch.manual_seed(0)
    model = DeepCAM(width=16)
    weights = class_weights_from_frequencies(train.class_frequencies)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    order = torch.Generator().manual_seed(0)
    for _ in range(40):
        idx = torch.randperm(len(x), generator=order)[:6]
        loss = weighted_cross_entropy(model(x[idx]), y[idx], weights)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(xv).argmax(1)
    trivial = mean_iou(torch.zeros_like(yv), yv, 3)
    learned = mean_iou(pred, yv, 3)
    assert trivial < 0.35
    assert learned > trivial + 0.2, (learned, trivial)


def test_samples_written_side_by_side_are_the_same_data_set(tmp_path):
    import h5py
    import numpy as np

    from exatrain.data.deepcam_write import write_deepcam
    one = write_deepcam(tmp_path / "one", 5, 32, 48, workers=1)
    two = write_deepcam(tmp_path / "two", 5, 32, 48, workers=2)
    for key in ("mean", "std", "class_frequencies"):
        assert one[key] == two[key], key
    for split in ("train", "val"):
        names = sorted(p.name for p in (tmp_path / "one" / split).glob("data-*.h5"))
        assert names == sorted(p.name for p in (tmp_path / "two" / split).glob("data-*.h5"))
        for name in names:
            with h5py.File(tmp_path / "one" / split / name) as a, \
                    h5py.File(tmp_path / "two" / split / name) as b:
                assert np.array_equal(a["climate/data"][...], b["climate/data"][...])
