"""CosmoFlow synthetic writer and HDF5 reader: layout, determinism, real signal, hyperslabs, errors."""

import pickle

import h5py
import numpy as np
import pytest
import torch

from exatrain.data.cosmoflow import (
    PARAM_HIGH,
    PARAM_LOW,
    CosmoFlowDataset,
    normalise_params,
    predict_mean_baseline_mae,
)
from exatrain.data.cosmoflow_synth import generate_sample, write_cosmoflow


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("cf")
    summary = write_cosmoflow(out, samples=12, size=16, seed=3, val_fraction=0.25)
    return out, summary


def test_layout_shapes_dtypes_and_attrs(small_set):
    out, summary = small_set
    assert summary["n_train"] == 9 and summary["n_val"] == 3 and summary["size"] == 16
    assert sorted(p.name for p in out.iterdir()) == ["train.h5", "val.h5"]  # no temp files left
    with h5py.File(out / "train.h5", "r") as f:
        x, y = f["x"], f["y"]
        assert x.shape == (9, 16, 16, 16, 4) and x.dtype == np.int16
        assert x.chunks == (1, 16, 16, 16, 4)
        assert y.shape == (9, 4) and y.dtype == np.float32
        assert list(f.attrs["param_names"]) == ["Omega_m", "sigma_8", "n_s", "H0"]
        assert f.attrs["seed"] == 3
        counts = x[...]
        assert counts.min() >= 0 and 10 < counts.mean() < 22  # Poisson counts around mean_count=16
        np.testing.assert_allclose(f["y"][...], normalise_params(f["params"][...]), atol=1e-6)
    ds = CosmoFlowDataset(out / "train.h5")
    assert len(ds) == 9
    xt, yt = ds[4]
    assert xt.dtype == torch.float32 and xt.shape == (4, 16, 16, 16)
    assert yt.dtype == torch.float32 and yt.shape == (4,)
    np.testing.assert_allclose(xt.numpy(), np.log1p(np.moveaxis(counts[4], -1, 0).astype(np.float32)))
    raw, _ = CosmoFlowDataset(out / "train.h5", transform=None)[4]
    np.testing.assert_array_equal(raw.numpy(), np.moveaxis(counts[4], -1, 0))


def test_larger_cube_generates():
    counts = generate_sample((0.3, 0.8, 0.96, 70.0), 64, np.random.default_rng(0))
    assert counts.shape == (64, 64, 64, 4) and counts.dtype == np.int16 and counts.min() >= 0


def test_deterministic_by_seed(tmp_path):
    a = write_cosmoflow(tmp_path / "a", samples=6, size=8, seed=7)
    b = write_cosmoflow(tmp_path / "b", samples=6, size=8, seed=7)
    c = write_cosmoflow(tmp_path / "c", samples=6, size=8, seed=8)
    # sample i has its own stream, so a longer run starts with the same samples
    d = write_cosmoflow(tmp_path / "d", samples=9, size=8, seed=7, val_fraction=0.0)
    read = lambda s, split="train": h5py.File(s[split], "r")["x"][...]  # noqa: E731
    np.testing.assert_array_equal(read(a), read(b))
    np.testing.assert_array_equal(read(a, "val"), read(b, "val"))
    assert not np.array_equal(read(a), read(c))
    np.testing.assert_array_equal(read(d)[:5], read(a))


def test_signal_is_real(tmp_path):
    # the amplitude of the density field must track sigma_8 (and targets stay in [-1, 1])
    s = write_cosmoflow(tmp_path, samples=40, size=16, seed=11, val_fraction=0.0)
    with h5py.File(s["train"], "r") as f:
        counts, y, params = f["x"][...], f["y"][...], f["params"][...]
    assert np.all(y >= -1) and np.all(y <= 1)
    assert np.all(params >= PARAM_LOW) and np.all(params <= PARAM_HIGH)
    stat = np.log1p(counts[..., 0].astype(np.float32)).var(axis=(1, 2, 3))
    assert abs(np.corrcoef(stat, y[:, 1])[0, 1]) > 0.7
    # and the growth of structure with time is visible: z=0 is clumpier than z=3
    assert np.all(np.log1p(counts[..., 3].astype(np.float32)).var(axis=(1, 2, 3)) < stat)


def test_hyperslab_read_and_bytes_read(small_set):
    out, _ = small_set
    ds = CosmoFlowDataset(out / "val.h5")
    full, y_full = ds.read(1)
    region = (slice(2, 10), slice(0, 4), slice(5, 16))
    before = ds.bytes_read
    block, y = ds.read(1, region)
    assert block.shape == (4, 8, 4, 11)
    torch.testing.assert_close(block, full[:, 2:10, 0:4, 5:16])
    torch.testing.assert_close(y, y_full)
    assert ds.bytes_read - before == 8 * 4 * 11 * 4 * 2 + 4 * 4  # int16 block + float32 targets
    with pytest.raises(TypeError):
        ds.read(0, (slice(0, 2),))
    with pytest.raises(IndexError):
        ds.read(3)


def test_pickle_drops_handle(small_set):
    out, _ = small_set
    ds = CosmoFlowDataset(out / "train.h5")
    x0, _ = ds[0]
    assert ds._handle is not None
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._handle is None
    torch.testing.assert_close(clone[0][0], x0)
    ds.close()


def _write_mlperf(path, counts, unit_par):
    with h5py.File(path, "w") as f:
        f["full"] = counts
        f["unitPar"] = np.asarray(unit_par, dtype=np.float32)


def test_mlperf_layout(tmp_path):
    rng = np.random.default_rng(0)
    cubes = [rng.poisson(5.0, (8, 8, 8, 4)).astype(np.int16) for _ in range(3)]
    pars = [[0.1, -0.2, 0.3, -0.4], [0.5, 0.6, -0.7, 0.8], [-0.9, 0.0, 0.2, 0.4]]
    names = ["univ_a.hdf5", "univ_b.h5", "univ_c.h5"]
    for name, cube, par in zip(names, cubes, pars):
        _write_mlperf(tmp_path / name, cube, par)
    (tmp_path / "README.txt").write_text("not a sample")
    ds = CosmoFlowDataset(tmp_path)
    assert ds.layout == "mlperf" and len(ds) == 3
    for i in range(3):
        x, y = ds[i]
        np.testing.assert_allclose(x.numpy(), np.log1p(np.moveaxis(cubes[i], -1, 0).astype(np.float32)))
        np.testing.assert_allclose(y.numpy(), pars[i])
    before = ds.bytes_read
    block, _ = ds.read(2, (slice(1, 3), slice(None), slice(4, 8)))
    np.testing.assert_allclose(block.numpy(), np.log1p(np.moveaxis(cubes[2], -1, 0)[:, 1:3, :, 4:8]))
    assert ds.bytes_read - before == 2 * 8 * 4 * 4 * 2 + 16
    np.testing.assert_allclose(ds.targets(), pars)


def test_baseline_mae(small_set):
    out, _ = small_set
    train, val = CosmoFlowDataset(out / "train.h5"), CosmoFlowDataset(out / "val.h5")
    with h5py.File(out / "train.h5", "r") as f, h5py.File(out / "val.h5", "r") as g:
        expected = np.abs(g["y"][...] - f["y"][...].mean(axis=0)).mean()
    assert predict_mean_baseline_mae(train, val) == pytest.approx(expected, rel=1e-5)
    # any map-style data set of (x, y) works too
    as_list = [val[i] for i in range(len(val))]
    assert predict_mean_baseline_mae(train, as_list) == pytest.approx(expected, rel=1e-5)


def test_missing_paths_name_the_path(tmp_path):
    missing = tmp_path / "nope.h5"
    with pytest.raises(FileNotFoundError, match="nope.h5") as e:
        CosmoFlowDataset(missing)
    assert "exatrain data cosmoflow --out" in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty.*exatrain data cosmoflow"):
        CosmoFlowDataset(empty)


def test_corrupt_and_invalid_files_name_file_and_sample(tmp_path):
    bad = tmp_path / "garbage.h5"
    bad.write_bytes(b"this is not an HDF5 file" * 10)
    with pytest.raises(ValueError, match="garbage.h5"):
        CosmoFlowDataset(bad)

    mdir = tmp_path / "mlperf"
    mdir.mkdir()
    good = np.ones((4, 4, 4, 4), np.int16)
    _write_mlperf(mdir / "s0.h5", good, [0, 0, 0, 0])
    (mdir / "s1.h5").write_bytes(b"\x89HDF\r\n\x1a\n truncated")
    _write_mlperf(mdir / "s2.h5", np.ones((4, 4, 4, 3), np.int16), [0, 0, 0, 0])  # 3 channels
    _write_mlperf(mdir / "s3.h5", good.astype(np.float32), [0, 0, 0, 0])  # not counts
    _write_mlperf(mdir / "s4.h5", good, [0, np.nan, 0, 0])
    _write_mlperf(mdir / "s5.h5", np.ones((6, 6, 6, 4), np.int16), [0, 0, 0, 0])  # other size
    ds = CosmoFlowDataset(mdir)
    ds[0]
    for i in range(1, 6):
        with pytest.raises(ValueError, match=rf"s{i}\.h5.*sample {i}"):
            ds[i]

    # a sample with NaN targets in the exatrain layout
    lay = tmp_path / "nan.h5"
    with h5py.File(lay, "w") as f:
        f["x"] = np.ones((2, 4, 4, 4, 4), np.int16)
        f["y"] = np.array([[0, 0, 0, 0], [0, 0, np.nan, 0]], np.float32)
    ds = CosmoFlowDataset(lay)
    ds[0]
    with pytest.raises(ValueError, match=r"nan\.h5.*sample 1"):
        ds[1]


def test_interrupted_write_leaves_no_file(tmp_path):
    def stop(done, total):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_cosmoflow(tmp_path, samples=8, size=8, seed=0, progress=stop)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sample, workers", [(3, 0), (30, 1)], ids=["statistics", "worker"])
def test_a_negative_count_is_named_at_its_source_with_nothing_printed_before(
        sample, workers, cosmo_data, tmp_path, capfd):
    """`exatrain run` on CosmoFlow files with one negative count (an int16 overflow, say): one
    line naming the file and the sample, exit 2, and no numpy warning or NonFiniteLoss first.
    Sample 3 is read for the standardisation statistics at build time; sample 30 only in
    training, by a loader worker: the fd-level capture sees the worker's stderr too, and the
    DataLoader's re-raise must not put the worker's traceback into the line."""
    import shutil
    import warnings

    from exatrain.cli import main

    for name in ("train.h5", "val.h5"):
        shutil.copy(cosmo_data / name, tmp_path / name)
    with h5py.File(tmp_path / "train.h5", "r+") as f:
        f["x"][sample, 2, 3, 4, 1] = -7
    args = ["model.size=16", "model.conv_layers=4", "model.base_channels=4", "data.size=16",
            "data.generate=false", "train.batch_size=8", "train.steps=6", "train.eval_every=0",
            f"train.num_workers={workers}", f"data.path={tmp_path}", f"run.out_dir={tmp_path}/runs"]
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["run", "--nproc", "1", *[a for v in args for a in ("--set", v)]])
    err = capfd.readouterr().err
    assert code == 2, err[-3000:]
    assert not caught, [str(w.message) for w in caught]
    # the job's banner, then the refusal: nothing between (no RuntimeWarning, no NonFiniteLoss)
    banner, *rest = [line for line in err.splitlines() if line.strip()]
    assert banner == "exatrain run: cosmoflow on 1 local rank(s)", err[-3000:]
    assert len(rest) == 1 and rest[0].startswith("exatrain: DataError: "), err[-3000:]
    assert f"{tmp_path / 'train.h5'} (sample {sample}): 1 negative particle counts" in rest[0]
    assert "-7 at (d, h, w, channel) = (2, 3, 4, 1)" in rest[0]
    assert "exatrain data cosmoflow --out DIR" in rest[0]


def test_a_negative_count_is_found_in_every_layout_and_block(tmp_path):
    from exatrain.errors import DataError

    counts = np.ones((4, 4, 4, 4), np.int16)
    counts[3, 1, 2, 0] = -1
    mdir, ndir = tmp_path / "mlperf", tmp_path / "numpy"
    mdir.mkdir()
    ndir.mkdir()
    _write_mlperf(mdir / "a.h5", np.ones_like(counts), [0, 0, 0, 0])
    _write_mlperf(mdir / "b.h5", counts, [0, 0, 0, 0])
    np.save(ndir / "a_data.npy", np.ones_like(counts))
    np.save(ndir / "a_label.npy", np.zeros(4, np.float32))
    np.save(ndir / "b_data.npy", counts)
    np.save(ndir / "b_label.npy", np.zeros(4, np.float32))
    for ds, file in ((CosmoFlowDataset(mdir), mdir / "b.h5"),
                     (CosmoFlowDataset(ndir), ndir / "b_data.npy")):
        ds[0]
        for raw in (False, True):
            ds.raw = raw
            with pytest.raises(DataError, match=rf"{file} \(sample 1\).*\(3, 1, 2, 0\)"):
                ds[1]
        # a spatial block: the voxel is named in the whole sample's coordinates
        with pytest.raises(DataError, match=r"\(3, 1, 2, 0\)"):
            ds.read(1, (slice(2, 4), slice(None), slice(None)))
        ds.read(1, (slice(0, 2), slice(None), slice(None)))   # a block without it reads
