"""Shared fixtures: a small real CosmoFlow data set, and a tiny-model config builder."""

from __future__ import annotations

import pytest

from exatrain.data.cosmoflow import write_cosmoflow
from exatrain.train.config import load_config

TINY = ["model.size=16", "model.conv_layers=4", "model.base_channels=4", "data.size=16",
        "data.generate=false", "train.batch_size=8", "train.log_every=1", "optim.lr=0.003"]


@pytest.fixture(scope="session")
def cosmo_data(tmp_path_factory):
    """48 samples of 16³ CosmoFlow fields (42 train, 6 val), written once per test session."""
    path = tmp_path_factory.mktemp("cosmoflow16")
    write_cosmoflow(path, samples=48, size=16, seed=3)
    return path


@pytest.fixture
def tiny_config(cosmo_data, tmp_path):
    """A config for a tiny CosmoFlow on the session's data; pass extra `section.key=value`s."""
    def make(*overrides: str):
        return load_config(None, [*TINY, f"data.path={cosmo_data}", f"run.out_dir={tmp_path}/runs",
                                  *overrides])
    return make
