"""Spatially partitioned reading: each rank's hyperslab is exactly its block of the serial sample."""

from __future__ import annotations

import itertools

import h5py
import pytest
import torch

from exatrain.data.cosmoflow import CosmoFlowDataset
from exatrain.data.cosmoflow_synth import write_cosmoflow
from exatrain.data.deepcam import DeepCAMDataset
from exatrain.data.deepcam_write import write_deepcam
from exatrain.parallel.spatial import SpatialBlocks, SpatialSplitError, block_slices


@pytest.mark.parametrize("space", [(1, 1, 2), (2, 2, 1), (2, 2, 2), (1, 4, 1)])
def test_cosmoflow_blocks_tile_the_sample(tmp_path, space):
    write_cosmoflow(tmp_path, samples=4, size=32, seed=5)
    serial = CosmoFlowDataset(tmp_path / "train.h5")
    with h5py.File(tmp_path / "train.h5") as f:
        assert f["x"].chunks == (1, 16, 16, 16, 4)  # a 16³ block is one chunk, not the sample
    full, y = serial[1]
    rebuilt = torch.full_like(full, float("nan"))
    sample_bytes = 32 ** 3 * 4 * 2
    for coords in itertools.product(*(range(p) for p in space)):
        region = block_slices((32, 32, 32), space, coords)
        blocks = SpatialBlocks(CosmoFlowDataset(tmp_path / "train.h5"), region)
        x, yb = blocks[1]
        assert torch.equal(x, full[(slice(None), *region)]) and torch.equal(yb, y)
        assert torch.isnan(rebuilt[(slice(None), *region)]).all()  # blocks do not overlap
        rebuilt[(slice(None), *region)] = x
        # this rank read its block (int16 counts) and the 4 targets, not the sample
        assert blocks.bytes_read == sample_bytes // (space[0] * space[1] * space[2]) + 16
    assert torch.equal(rebuilt, full)


def test_deepcam_blocks_tile_the_sample(tmp_path):
    write_deepcam(tmp_path, 3, height=48, width=72, seed=2)
    serial = DeepCAMDataset(tmp_path / "train")
    x, y = serial[0]
    for coords in itertools.product(range(2), range(3)):
        region = block_slices((48, 72), (1, 2, 3), (0, *coords))
        blocks = SpatialBlocks(DeepCAMDataset(tmp_path / "train"), region)
        xb, yb = blocks[0]
        assert torch.equal(xb, x[(slice(None), *region)]) and torch.equal(yb, y[region])
        assert blocks.bytes_read == 24 * 24 * (16 * 4 + 1)  # float32 channels + uint8 labels


def test_uneven_split_and_wrong_dimensionality_are_refused():
    with pytest.raises(SpatialSplitError, match="30 long along h, which space_h=4"):
        block_slices((30, 32), (1, 4, 1), (0, 0, 0))
    with pytest.raises(SpatialSplitError, match=r"use space=\(1, 4, 2\) on as many ranks"):
        block_slices((32, 32), (2, 2, 2), (0, 0, 0))
