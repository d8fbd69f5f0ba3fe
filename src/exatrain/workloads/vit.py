"""ViT forecaster workload: learn the shallow-water dynamics, state(t) -> state(t + lead·Δt).

The NERSC "deep learning at scale" tutorial's weather example in spirit: a Vision Transformer
(patch embedding, learned positions, pre-norm blocks, unpatchify head; `models/vit.py`) trained
with the relative L2 loss on trajectories of a real 2D simulation, the rotating shallow-water
equations on a doubly periodic f-plane (`data/forecast.py`: fields h, u, v, written once as HDF5).

Metrics on the validation trajectories (unseen initial conditions):

    val_rel_l2    mean over samples of ||pred - target|| / ||target||   (the training loss)
    val_rmse      root mean squared error of the normalised fields

and, as the baseline every forecaster must beat, `baseline_persistence_rel_l2`: the same metric
for the persistence forecast pred = state(t). With `model.residual` (the default) the untrained
model *is* persistence (its head starts at zero), so training can only improve on it.

Every weight matrix is an nn.Linear, so under `plan.tensor` the blocks split 1D (heads and MLP
columns) or over the 3D grid, and the patch embedding and head split where their shapes divide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.forecast import ForecastDataset
from ..data.forecast_synth import write_forecast
from ..models.vit import ViTForecaster, flops_per_sample, relative_l2_loss
from .base import InputOptions, Workload
from ..errors import ConfigError, MissingFileError


@dataclass
class ModelOptions:
    patch_size: int = 8         # must divide the grid's height and width
    embed_dim: int = 192
    depth: int = 4
    num_heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    residual: bool = True       # predict the increment: y = x + f(x)


@dataclass
class DataOptions(InputOptions):
    path: str = "data/forecast"  # directory with train.h5 and val.h5
    generate: bool = True        # run the simulation there once if the files are missing
    trajectories: int = 16       # simulated runs (train + val; val gets 1/8, at least one)
    steps: int = 20              # saved states per trajectory
    height: int = 64
    width: int = 128
    seed: int = 0
    lead: int = 1                # forecast lead in saved steps (dt_save = 0.05 model time units)
    val_fraction: float = 0.125


def prepare(config, progress=None) -> Path:
    """Run the shallow-water simulation once if asked and the files are missing (one process)."""
    d = config.data
    path = Path(d.path)
    if d.generate and not ((path / "train.h5").exists() and (path / "val.h5").exists()):
        if progress:
            progress(0, 1)
        write_forecast(path, trajectories=d.trajectories, steps=d.steps, height=d.height,
                       width=d.width, seed=d.seed, val_fraction=d.val_fraction)
        if progress:
            progress(1, 1)
    return path


def persistence_rel_l2(dataset: ForecastDataset, limit: int = 256) -> float:
    """Relative L2 error of predicting no change, over (up to `limit`) samples."""
    n = min(len(dataset), limit)
    errors = [relative_l2_loss(x[None], y[None]).item()
              for x, y in (dataset[i] for i in range(n))]
    return sum(errors) / n


def build(config, mesh) -> Workload:
    m, d = config.model, config.data
    path = Path(d.path)
    for split in ("train", "val"):
        if not (path / f"{split}.h5").is_file():
            raise MissingFileError(
                f"{path / (split + '.h5')} is missing: set data.generate=true to simulate it "
                f"here, or write it with `exatrain data forecast --out {path}`.")
    train_set = ForecastDataset(path / "train.h5", lead=d.lead)
    val_set = ForecastDataset(path / "val.h5", lead=d.lead)
    _n, _t, channels, height, width = train_set.shape
    if height % m.patch_size or width % m.patch_size:
        raise ConfigError(f"model.patch_size={m.patch_size} must divide the data's grid "
                          f"{height}×{width} ({path}); pick a divisor of both, e.g. "
                          f"{math.gcd(height, width)}.")
    if m.embed_dim % m.num_heads:
        raise ConfigError(f"model.embed_dim={m.embed_dim} is not divisible by "
                          f"model.num_heads={m.num_heads}.")
    model = ViTForecaster(img_size=(height, width), patch_size=m.patch_size,
                          in_channels=channels, out_channels=channels, embed_dim=m.embed_dim,
                          depth=m.depth, num_heads=m.num_heads, mlp_ratio=m.mlp_ratio,
                          dropout=m.dropout, residual=m.residual)

    def metric_sums(output, target):
        output, target = output.float(), target.float()
        diff = (output - target).flatten(1)
        rel = diff.norm(dim=1) / target.flatten(1).norm(dim=1).clamp_min(1e-12)
        return {"rel_l2": rel.sum(), "samples": torch.tensor(float(target.shape[0])),
                "sq_err": diff.square().sum(), "values": torch.tensor(float(target.numel()))}

    def finalize(s):
        return {"val_rel_l2": s["rel_l2"] / s["samples"],
                "val_rmse": math.sqrt(s["sq_err"] / s["values"])}

    return Workload(model=model, train_set=train_set, val_set=val_set, loss_fn=relative_l2_loss,
                    metric_sums=metric_sums, finalize=finalize,
                    baselines={"baseline_persistence_rel_l2": persistence_rel_l2(val_set)},
                    metric_axes=("data",), flops_per_sample=flops_per_sample(model))
