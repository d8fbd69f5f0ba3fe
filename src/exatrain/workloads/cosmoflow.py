"""CosmoFlow workload: the MLPerf HPC cosmology regression, MSE loss, validation MAE."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data.cosmoflow import (PARAM_NAMES, CosmoFlowDataset, CountsDecoder,
                              predict_mean_baseline_per_target, sample_files)
from ..data.cosmoflow_synth import write_cosmoflow
from ..data.stage import InputFiles
from ..models.cosmoflow import CosmoFlow
from .base import InputOptions, Workload
from ..errors import ConfigError, MissingFileError


@dataclass
class ModelOptions:
    size: int = 32              # input cube edge; must match the data
    base_channels: int = 16     # 16 at 32³: 4x fewer FLOPs than MLPerf's 32, more steps in 3 minutes
    conv_layers: int = 5
    dropout: float = 0.0
    batchnorm: bool = True      # Conv -> BatchNorm -> LeakyReLU (models/cosmoflow.py: measured gain)
    channels_last: bool = True  # channels-last convolutions (faster on CPU and GPU)


@dataclass
class DataOptions(InputOptions):
    path: str = "data/cosmoflow-32-4608"  # directory with train.h5 and val.h5, or MLPerf per-sample files
    generate: bool = True             # write a synthetic set there if it is missing
    samples: int = 4608               # samples to generate (train + val): 4032 + 576 (2000 steps of
                                      # 8 = 4 epochs; 576 MiB on disk, ~40 s to write)
    size: int = 32
    seed: int = 1234
    standardize: bool = True          # log1p, then zero mean / unit variance (stats from train)
    decode_on_device: bool = True     # move int16 counts, decode (log1p, standardize) on the
                                      # device: half the bytes, no loader arithmetic


class Standardize:
    """log1p(counts), then (v - mean) / std: a picklable transform for the data set.

    MLPerf's reference stops at log1p; log1p counts have a mean far from zero (≈2.6 here), which
    slows the first hundreds of steps of an un-normalised ConvNet, so by default we also centre
    and scale with statistics of the first training samples.
    """

    def __init__(self, mean: float, std: float):
        self.mean, self.std = mean, std

    def __call__(self, counts):
        import numpy as np
        return (np.log1p(counts) - self.mean) / self.std


def standardizer(train_set: CosmoFlowDataset, samples: int = 16, region=None,
                 axis=None) -> Standardize:
    """Mean and std of log1p counts over the first `samples` training samples.

    Under a `space` split (`region` = this rank's block, `axis` = the space axis) each rank reads
    only its blocks and the sums are added over the spatial ranks, giving the whole samples' mean
    and (unbiased) std without any rank reading a whole sample.
    """
    n = min(samples, len(train_set))
    if region is None:
        values = torch.stack([train_set[i][0] for i in range(n)])
        return Standardize(float(values.mean()), float(values.std()))
    from ..comm import all_reduce
    sums = torch.zeros(3, dtype=torch.float64)
    for i in range(n):
        block = train_set.read(i, region)[0].double()
        sums += torch.stack([torch.tensor(float(block.numel()), dtype=torch.float64),
                             block.sum(), (block * block).sum()])
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        and torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    sums = sums.to(device)  # NCCL reduces only GPU tensors
    all_reduce(sums, axis, tag="metric")
    count, total, squares = sums.tolist()
    mean = total / count
    return Standardize(mean, max((squares - count * mean * mean) / (count - 1), 0.0) ** 0.5)


def prepare(config, progress=None) -> Path:
    """Generate the synthetic set once if asked and missing (run on one process, before build)."""
    options = config.data
    path = Path(options.path)
    given = (path / "train.h5").exists() or any(path.glob("*/*.h5")) or any(path.glob("*/*.hdf5")) \
        or any(path.glob("*/*_data.npy"))
    if _flat_samples(path):  # generating would write our files beside the user's samples
        raise layout_error(path)
    if options.generate and not given:
        write_cosmoflow(path, samples=options.samples, size=options.size, seed=options.seed,
                        progress=progress)
    return path


LAYOUTS = ("DIR/train.h5 and DIR/val.h5 (exatrain's layout: `exatrain data cosmoflow --out DIR`)",
           "DIR/train/ and DIR/validation/, each a directory of MLPerf per-sample .h5/.hdf5 files "
           "(`full`, `unitPar`)",
           "DIR/train/ and DIR/validation/, each a directory of MLPerf numpy pairs "
           "(NAME_data.npy, NAME_label.npy)")


def _found(path: Path) -> str:
    """What `path` holds, in a few words, for an error message."""
    if not path.exists():
        return f"{path} does not exist"
    if not path.is_dir():
        return f"{path} is a file, not a directory"
    entries = sorted(path.iterdir())
    if not entries:
        return f"{path} is empty"
    kinds: dict[str, int] = {}
    for entry in entries:
        kind = "director(ies)" if entry.is_dir() else (f"{entry.suffix} file(s)" if entry.suffix
                                                       else "file(s) without a suffix")
        kinds[kind] = kinds.get(kind, 0) + 1
    names = ", ".join(e.name + ("/" if e.is_dir() else "") for e in entries[:3])
    more = ", …" if len(entries) > 3 else ""
    return (f"{path} holds " + ", ".join(f"{n} {k}" for k, n in kinds.items())
            + f" ({names}{more})")


def _flat_samples(path: Path) -> bool:
    """A flat directory of per-sample files: one split, not a data directory with two."""
    return path.is_dir() and any(p.suffix in (".h5", ".hdf5") or p.name.endswith("_data.npy")
                                 for p in path.iterdir()) and not (path / "train.h5").exists()


def layout_error(path: Path) -> MissingFileError:
    """The accepted layouts, what `path` holds, and what to do: for a data.path that is none."""
    fix = (f"This looks like one split of per-sample files: move them into {path}/train/ (and "
           f"the validation samples into {path}/validation/), or point data.path at the "
           "directory that holds train/ and validation/."
           if path.exists() and _flat_samples(path) else
           "Point data.path at such a directory, or write a synthetic set with "
           "`exatrain data cosmoflow --out DIR` (or set data.generate = true and a data.path "
           "that does not exist yet).")
    accepted = "".join(f"\n  * {layout}" for layout in LAYOUTS)
    return MissingFileError(f"data.path={str(path)!r} is not a CosmoFlow data directory. "
                            f"Accepted layouts:{accepted}\nFound: {_found(path)}. {fix}")


def _split(path: Path, name: str) -> Path:
    """Our layout has train.h5/val.h5; the MLPerf layout has train/ and validation/ folders."""
    for candidate in (path / f"{name}.h5", path / name, path / {"val": "validation"}.get(name, name)):
        if candidate.exists():
            return candidate
    raise layout_error(path)


def input_files(config) -> InputFiles:
    """The files `build` reads, for staging (data.stage): the validation split and a training
    set held in one file are shared by every node; MLPerf per-sample training files are listed
    per sample, so under data.shuffle = "node" each node stages only its shard."""
    path = Path(config.data.path)
    train, val = _split(path, "train"), _split(path, "val")
    shared = [f for sample in sample_files(val) for f in sample] if val.is_dir() else [val]
    if not train.is_dir():
        return InputFiles(shared=[train, *shared])
    return InputFiles(shared=shared, samples=sample_files(train))


def check_model_fits_data(config, data_set: CosmoFlowDataset) -> None:
    """Refuse, before any step, a model whose input cube differs from the data's samples
    (otherwise the first step fails deep inside with a matmul shape error)."""
    m, d = config.model, config.data
    edge = data_set.sample_shape[:3]
    if edge == (m.size,) * 3:
        return
    cube = "×".join(map(str, edge))
    generated = (f" (data.size={d.size} only sizes newly generated data; {d.path} already "
                 "holds data, so nothing was generated: delete it or point data.path elsewhere "
                 "to generate new data)") if d.generate and d.size == m.size else ""
    fix = (f"set model.size={edge[0]}" + ("" if d.size == edge[0] else f" and data.size={edge[0]}")
           if len(set(edge)) == 1 else "use cubic samples")
    new = (f"; to generate {m.size}³ data instead, set data.size={m.size} and a data.path "
           "that does not exist yet") if d.generate else ""
    raise ConfigError(
        f"model.size={m.size} expects {m.size}³ samples, but the data in {data_set.path} "
        f"({data_set.layout} layout) hold {cube} samples of {data_set.sample_shape[3]} "
        f"channels{generated}. To train on these data, {fix}{new}.")


def build(config, mesh) -> Workload:
    m, d = config.model, config.data
    path = Path(d.path)
    train_set = CosmoFlowDataset(_split(path, "train"))
    val_set = CosmoFlowDataset(_split(path, "val"))
    for data_set in (train_set, val_set):
        check_model_fits_data(config, data_set)
    region = None
    if mesh.plan.space_degree > 1:
        # spatial parallelism: each rank reads only its block of every sample (HDF5 hyperslab)
        from ..parallel.spatial import block_region
        region = block_region(tuple(train_set.sample_shape[:3]), mesh)
    if d.standardize:
        train_set.transform = val_set.transform = standardizer(
            train_set, region=region, axis=mesh.axis("space") if region else None)
    decode = None
    if d.decode_on_device:  # the counts travel as stored; the transform runs on the device
        mean, std = (train_set.transform.mean, train_set.transform.std) if d.standardize \
            else (None, None)
        decode = CountsDecoder(log1p=True, mean=mean, std=std)
        train_set.raw = val_set.raw = True
    if region is not None:
        from ..parallel.spatial import SpatialBlocks
        train_set, val_set = SpatialBlocks(train_set, region), SpatialBlocks(val_set, region)
    model = CosmoFlow(size=m.size, base_channels=m.base_channels, conv_layers=m.conv_layers,
                      dropout=m.dropout, batchnorm=m.batchnorm, channels_last=m.channels_last)

    def metric_sums(output, target):
        err = (output.float() - target).abs()
        return {"abs_err": err.sum(), "sq_err": ((output.float() - target) ** 2).sum(),
                "count": torch.tensor(float(target.numel())),
                **{f"abs_err_{name}": err[:, i].sum() for i, name in enumerate(PARAM_NAMES)}}

    def finalize(s):
        per_target = s["count"] / len(PARAM_NAMES)
        return {"val_mae": s["abs_err"] / s["count"], "val_mse": s["sq_err"] / s["count"],
                **{f"val_mae_{name}": s[f"abs_err_{name}"] / per_target for name in PARAM_NAMES}}

    baseline = predict_mean_baseline_per_target(train_set, val_set)
    return Workload(model=model, train_set=train_set, val_set=val_set, loss_fn=F.mse_loss,
                    metric_sums=metric_sums, finalize=finalize, decode=decode,
                    input_blocks=region is not None,
                    baselines={"baseline_mae": float(baseline.mean()),
                               **{f"baseline_mae_{name}": float(b)
                                  for name, b in zip(PARAM_NAMES, baseline)}},
                    flops_per_sample=3 * cosmoflow_forward_flops(m.size, m.base_channels, m.conv_layers))


def cosmoflow_forward_flops(size: int, base_channels: int = 32, conv_layers: int = 5) -> float:
    """Forward FLOPs of one sample: 2 × MACs of the convolutions and dense layers."""
    flops, channels, edge = 0.0, 4, size
    for i in range(conv_layers):
        out = base_channels * 2 ** i
        flops += 2 * edge ** 3 * out * channels * 27
        channels, edge = out, edge // 2
    flat = channels * edge ** 3
    return flops + 2 * (flat * 128 + 128 * 64 + 64 * 4)
