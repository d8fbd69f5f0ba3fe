"""A user's data set read by blocks under `space` (issue 46, item 4), on real HDF5 files.

  reader      et.data.HDF5Dataset.read(index, region) returns exactly the hyperslab of the
              input (channels first or last in the file) and the whole target, and its
              ReadCounter counts the selected bytes, loader workers included
  training    the tutorial's 3D U-Net trained by et.fit from an HDF5Dataset, and from a
              user's own Dataset with read(index, region), under space=(1, 1, 2): each rank
              reads half of every input's bytes and the whole target (input_bytes_read_per_sample
              = B_x / 2 + B_y exactly), and the final weights equal one process's trained on
              the same files (relative 1e-5 in float32; the issue asks 1e-4)
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness import rel_err, run_ranks
from test_spatial_user_models import STEPS, build

SHAPE = (2, 16, 16, 16)      # one input (C, D, H, W)
TARGET = (1, 16, 16, 16)     # its per-voxel target
X_BYTES, Y_BYTES = 4 * 2 * 16 ** 3, 4 * 16 ** 3


def write_volumes(path: Path, samples: int = 8, channels_last: bool = False) -> Path:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(samples, *SHAPE, generator=g)
    y = 0.3 * x[:, :1] + 0.5 * torch.randn(samples, *TARGET, generator=g)
    with h5py.File(path, "w") as f:
        f["volume"] = (x.permute(0, 2, 3, 4, 1) if channels_last else x).numpy()
        f["label"] = y.numpy()
    return path


class MyVolumes(torch.utils.data.Dataset):
    """A user's own data set that reads blocks: the protocol, with its own read counter."""

    def __init__(self, path):
        import exatrain as et
        self.path, self.sample_shape = str(path), SHAPE
        self.read_counter = et.data.ReadCounter()
        with h5py.File(self.path, "r") as f:
            self.n = len(f["volume"])

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return self.read(index, (slice(None),) * 3)

    def read(self, index, region):
        with h5py.File(self.path, "r") as f:
            x, y = f["volume"][(index, slice(None), *region)], f["label"][index]
        self.read_counter.add(x.nbytes + y.nbytes)
        return torch.from_numpy(x), torch.from_numpy(y)


def test_hdf5_dataset_reads_the_hyperslab_and_counts_its_bytes(tmp_path):
    from exatrain.data import HDF5Dataset
    first = HDF5Dataset(write_volumes(tmp_path / "first.h5"), x="volume", y="label")
    last = HDF5Dataset(write_volumes(tmp_path / "last.h5", channels_last=True), x="volume",
                       y="label", channels="last")
    assert first.sample_shape == last.sample_shape == SHAPE
    region = (slice(0, 16), slice(8, 16), slice(4, 12))
    whole_x, whole_y = first[3]
    for ds in (first, last):
        before = ds.bytes_read
        x, y = ds.read(3, region)
        assert torch.equal(x, whole_x[:, 0:16, 8:16, 4:12]) and torch.equal(y, whole_y)
        assert ds.bytes_read - before == X_BYTES // 4 + Y_BYTES  # a quarter of x, y whole
    with pytest.raises(Exception, match="needs 3 slices"):
        first.read(0, (slice(0, 8),))
    # loader workers count into the same counter (a slot each, in shared memory)
    counted = HDF5Dataset(tmp_path / "first.h5", x="volume", y="label")
    loader = torch.utils.data.DataLoader(counted, batch_size=2, num_workers=2)
    assert sum(len(x) for x, _ in loader) == 8
    assert counted.read_counter.samples == 8
    assert counted.bytes_read == 8 * (X_BYTES + Y_BYTES)


def fit_from_files(kind: str, path: str, plan: dict, out_dir: str) -> dict:
    """et.fit of the U-Net on the HDF5 volumes at `path`; every rank returns its summary's read
    figures and (rank 0) the final weights."""
    import exatrain as et
    from exatrain.train.checkpoints import checkpoint

    def data():
        if kind == "hdf5":
            return et.data.HDF5Dataset(path, x="volume", y="label")
        return MyVolumes(path)

    summary = et.fit(lambda: build("unet"), data(), data(), loss=F.mse_loss,
                     plan=et.Plan(**plan),
                     train={"steps": STEPS, "batch_size": 4, "log_every": 1, "eval_every": 0,
                            "num_workers": 0},
                     optim={"name": "sgd", "lr": 0.1}, run={"out_dir": out_dir})
    state = checkpoint.full_model_state(checkpoint.latest(Path(summary["run_dir"]))) \
        if int(os.environ.get("RANK", "0")) == 0 else None
    return {"read": summary["input_bytes_read_per_rank"],
            "per_sample": summary["input_bytes_read_per_sample"],
            "val_loss": summary["val_loss"], "state": state}


def _both(path: str, out_dir: str) -> dict:
    return {kind: fit_from_files(kind, path, {"space": (1, 1, 2)}, out_dir)
            for kind in ("hdf5", "own")}


def _flat(state: dict) -> torch.Tensor:
    keys = sorted(k for k in state if not k.endswith("num_batches_tracked"))
    return torch.cat([state[k].double().flatten() for k in keys])


def test_user_volumes_read_by_blocks_under_space_train_as_one_process(tmp_path, one_thread):
    path = str(write_volumes(tmp_path / "volumes.h5"))
    runs = run_ranks(2, _both, path, str(tmp_path / "space"))
    for kind in ("hdf5", "own"):
        serial = fit_from_files(kind, path, {}, str(tmp_path / "serial"))
        assert serial["per_sample"] == X_BYTES + Y_BYTES
        for rank in runs:  # each rank: half of every input (its block), the target whole
            assert rank[kind]["per_sample"] == X_BYTES // 2 + Y_BYTES, (kind, rank[kind])
            assert rank[kind]["read"] > 0
            assert rank[kind]["val_loss"] == pytest.approx(serial["val_loss"], rel=1e-5)
        err = rel_err(_flat(runs[0][kind]["state"]), _flat(serial["state"]))
        assert err <= 1e-5, (kind, err)
        start = _flat(build("unet").state_dict())
        assert rel_err(_flat(serial["state"]), start) > 1e-3  # the steps moved the weights
