"""DeepCAM workload: climate segmentation (background / tropical cyclone / atmospheric river).

Data `data.deepcam` (the DeepCAM HDF5 layout, synthetic or real), class-weighted cross-entropy,
validation mean IoU. Two variants (`model.variant`), each a whole definition:

  "reference" (the default)  MLPerf HPC's DeepCAM: `models.deeplab.DeepLabXception` (DeepLabv3+ on
             the modified aligned Xception, 56.5 M parameters at model.width_multiplier = 1),
             class weights  w_c = f_c^(-1/8)  (MLPerf's `loss_pow = -0.125`, f_c the training
             set's class frequencies from its stats file, or MLPerf's own frequencies of the real
             data when the stats file has none), the loss  (1/P) Σ_i w_{y_i} ℓ_i  over the P
             pixels of the global batch (MLPerf's CELoss: a plain mean of weighted terms), and
             MLPerf's IoU (`mlperf_iou`): per sample, the mean over the classes of
             tp / (tp + fp + fn), a class absent from both prediction and label counting 1,
             averaged over the validation samples (MLPerf averages per-batch means: the same
             with equal batches). The data set's default size is MLPerf's 768 × 1152.
  "small"    `models.deepcam.DeepCAM`, a small DeepLabv3+-style net for CPU tests and tutorials
             (0.3 M parameters at model.width = 16), inverse-square-root class weights normalised
             to sum 1, the weighted mean  Σ_i w ℓ_i / Σ_i w  (PyTorch's convention), and the mean
             IoU of the pooled confusion matrix (classes absent from both skipped).

Loss. The weighted cross-entropy is  L = Σ_i w_{y_i} ℓ_i / D  over every pixel of the batch, with
D = Σ_i w_{y_i} ("small") or D = the pixel count ("reference"). Here each rank holds a block of the pixels of its data replica's samples
(spatial parallelism) and the replicas hold different samples, so each rank computes its numerator,
divides by the denominator summed over all data and spatial ranks, and multiplies by the number of
data replicas R (the data-parallel all-reduce divides gradients by R):

    l_r = R · Σ_{i in block r} w ℓ_i / Σ_{all ranks} w,        L = (1/R) Σ_replicas Σ_blocks l_r

The loss value each rank returns is summed over the spatial ranks (forward all-reduce, identity
backward), so every rank reports its replica's loss while backpropagating only its own pixels.
With R = 1 and no split this is exactly `F.cross_entropy(..., weight=w)`; with data parallelism
it makes the global batch's weighted mean exact (a per-replica mean of means would not be).

Metric. The confusion matrix (counts) is summed over blocks, batches and ranks
(`metric_axes = ("data", "space")`), and the pooled mean IoU computed from the total ("small";
"reference" reports it too, as val_pooled_mean_iou). MLPerf's per-sample IoU needs each sample's
counts whole: under `space` each sample's (K, 3) counts are all-reduced over the spatial ranks
(tag "metric", N × K × 3 × 8 bytes per batch, evaluation only), and only the first spatial rank
adds the sample's IoU to the sums.

Input. With `data.decode_on_device` (the default) the fields travel as stored, (H, W, C) float32,
and the labels in their stored dtype (uint8: 1/8 of int64's bytes; the loss and the metric take
them as they come), and `data.deepcam.FieldsDecoder` transposes and normalises each batch on the
device: the loader neither transposes nor computes (measured: 1.0 instead of 1.4 ms of CPU a
96×144×16 sample). The fields stay float32 on the way, so unlike CosmoFlow's int16 counts no
bytes are saved there; the normalised values and their memory layout are the CPU path's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..comm import all_reduce
from ..data.deepcam import CLASS_NAMES, DeepCAMDataset, FieldsDecoder, find_stats, sample_files
from ..data.deepcam_write import write_deepcam
from ..data.stage import InputFiles
from ..models.deepcam import DeepCAM, class_weights_from_frequencies, iou_from_confusion
from ..models.deeplab import DeepLabXception, conv_forward_flops
from ..parallel.spatial.functions import sum_over_axis
from .base import InputOptions, Workload
from ..errors import ConfigError


VARIANTS = ("reference", "small")
# MLPerf HPC DeepCAM's class frequencies of its real data (background, cyclone, river), from which
# its train.py computes the class weights f^loss_pow with loss_pow = -0.125
MLPERF_CLASS_FREQUENCIES = (0.986267818390377, 0.0004578708870701058, 0.01327431072255291)
MLPERF_LOSS_POW = -0.125


@dataclass
class ModelOptions:
    variant: str = "reference"            # "reference": MLPerf HPC's DeepCAM (module doc);
                                          # "small": the small net for CPU tests and tutorials
    width_multiplier: float = 1.0         # reference: channel multiplier (1 = MLPerf's network)
    width: int = 16                       # small: base channel width w (DeepCAM(width=w))
    aspp_rates: list[int] = field(default_factory=lambda: [1, 2, 3])
    dropout: float = 0.1                  # small: Dropout2d in ASPP


@dataclass
class DataOptions(InputOptions):
    path: str = "data/deepcam-768x1152"   # out_dir of `exatrain data deepcam` (train/, val/, stats)
    generate: bool = True                 # write a synthetic set there if it is missing
    samples: int = 64                     # samples to generate (train + val; MLPerf's 768 × 1152
                                          # × 16: 57 MB and ~9 s of one core each)
    height: int = 768
    width: int = 1152
    channels: int = 16
    seed: int = 0
    class_weights: bool = True            # class weights from the frequencies (model.variant's)
    decode_on_device: bool = True         # move fields and labels as stored, normalise on the
                                          # device (FieldsDecoder): no loader arithmetic


def prepare(config, progress=None) -> Path:
    """Generate the synthetic set once if asked and missing (run on one process, before build)."""
    d = config.data
    path = Path(d.path)
    if d.generate and not any((path / "train").glob("data-*.h5")):
        write_deepcam(path, samples=d.samples, height=d.height, width=d.width,
                      channels=d.channels, seed=d.seed)
    return path


def _split_dir(path: Path, name: str) -> Path:
    """Ours: train/ and val/; the MLPerf DeepCAM layout: train/ and validation/."""
    if name == "val" and not (path / "val").is_dir() and (path / "validation").is_dir():
        return path / "validation"
    return path / name


def input_files(config) -> InputFiles:
    """The files `build` reads, for staging (data.stage): the validation samples and the
    statistics on every node; the training samples one by one, so under data.shuffle = "node"
    each node stages only its shard."""
    path = Path(config.data.path)
    train, val = _split_dir(path, "train"), _split_dir(path, "val")
    stats = list(dict.fromkeys(s for s in (find_stats(train), find_stats(val)) if s is not None))
    return InputFiles(shared=[*sample_files(val), *stats],
                      samples=[(f,) for f in sample_files(train)])


def mlperf_class_weights(freqs=None) -> torch.Tensor:
    """MLPerf HPC DeepCAM's class weights  w_c = f_c^(-1/8)  (not normalised), from `freqs` or,
    without them, from MLPerf's frequencies of its real data (`MLPERF_CLASS_FREQUENCIES`). A class
    that never occurs is clamped to frequency 1e-6, as `class_weights_from_frequencies` does."""
    f = torch.as_tensor(MLPERF_CLASS_FREQUENCIES if freqs is None else np.asarray(freqs, float),
                        dtype=torch.float64).flatten()
    return (f / f.sum()).clamp_min(1e-6).pow(MLPERF_LOSS_POW).float()


def mlperf_iou(pred: torch.Tensor, labels: torch.Tensor, num_classes: int,
               axis=None) -> torch.Tensor:
    """MLPerf HPC DeepCAM's IoU of each sample: (N,) float64.

    Per sample and class, tp, fp and fn are counted; the sample's score is the mean over classes
    of tp / (tp + fp + fn), a class absent from both prediction and label scoring 1 (MLPerf's
    utils/metric.py: nan_to_num(nan=1/K) of the terms already divided by K). `axis`: the counts
    are summed over it first (the spatial ranks holding blocks of the same samples).
    """
    n = pred.shape[0]
    p, t = pred.reshape(n, -1).long(), labels.reshape(n, -1).long()
    cols = []
    for c in range(num_classes):
        pc, tc = p == c, t == c
        cols += [(pc & tc).sum(1), (pc & ~tc).sum(1), (~pc & tc).sum(1)]
    counts = torch.stack(cols, 1).reshape(n, num_classes, 3).double()
    if axis is not None and axis.size > 1:
        all_reduce(counts, axis, tag="metric")
    tp, union = counts[..., 0], counts.sum(-1)
    iou = torch.where(union > 0, tp / union.clamp_min(1), torch.ones_like(tp))
    return iou.mean(1)


def segmentation_loss(class_weights: torch.Tensor | None, mesh, normalise: str = "weights"):
    """Weighted cross-entropy over split outputs (see the module doc); a loss_fn(logits, labels).
    `normalise`: divide by the sum of the pixels' weights ("weights") or by the pixel count
    ("pixels", MLPerf's)."""
    norm_axis = mesh.axis("data", "space")
    space_axis = mesh.axis("space")
    replicas = mesh.axis("data").size

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels = labels.long()
        if class_weights is not None and normalise == "pixels":
            weights = class_weights.to(device=logits.device, dtype=logits.dtype)
            den = torch.tensor(float(labels.numel()), dtype=torch.float64, device=logits.device)
        elif class_weights is None:
            weights = None
            den = torch.tensor(float(labels.numel()), dtype=torch.float64, device=logits.device)
        else:
            weights = class_weights.to(device=logits.device, dtype=logits.dtype)
            den = weights[labels].sum(dtype=torch.float64)
        num = F.cross_entropy(logits, labels, weight=weights, reduction="sum")
        all_reduce(den, norm_axis, tag="loss")
        return sum_over_axis(num * (replicas / den).to(num.dtype), space_axis, tag="loss")

    return loss_fn


def deepcam_forward_flops(model: nn.Module, channels: int, height: int, width: int) -> float:
    """Forward FLOPs of one sample (2 × multiply-adds of convolutions), by a shape-only pass."""
    flops = 0.0

    def count(module, inputs, output):
        nonlocal flops
        if isinstance(module, nn.Conv2d):
            per_out = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            flops += 2.0 * output.numel() * per_out
        elif isinstance(module, nn.ConvTranspose2d):
            per_in = module.out_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            flops += 2.0 * inputs[0].numel() * per_in

    meta = copy.deepcopy(model).to("meta")
    hooks = [m.register_forward_hook(count) for m in meta.modules()
             if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]
    with torch.no_grad():
        meta.eval()(torch.empty(1, channels, height, width, device="meta"))
    for h in hooks:
        h.remove()
    return flops


def build(config, mesh) -> Workload:
    m, d = config.model, config.data
    if m.variant not in VARIANTS:
        raise ConfigError(
            f"model.variant = {m.variant!r}: choose 'reference' (MLPerf HPC's DeepLabv3+ on "
            f"Xception) or 'small' (the small net for CPU tests and tutorials).")
    reference = m.variant == "reference"
    path = Path(d.path)
    train_set = DeepCAMDataset(_split_dir(path, "train"))
    val_set = DeepCAMDataset(_split_dir(path, "val"))
    channels, height, width = train_set.sample_shape
    if reference:
        model = DeepLabXception(in_channels=channels, num_classes=len(CLASS_NAMES),
                                width=m.width_multiplier)
    else:
        model = DeepCAM(in_channels=channels, num_classes=len(CLASS_NAMES), width=m.width,
                        aspp_rates=tuple(m.aspp_rates), dropout=m.dropout)
    stride = model.output_stride
    if height % stride or width % stride:
        raise ConfigError(
            f"DeepCAM samples are {height}x{width}; both must be divisible by the "
            f"model's output stride {stride} (data.height/data.width), or model.variant = "
            f"{'small' if reference else 'reference'} ({'8' if reference else '16'}).")
    flops = 3 * (conv_forward_flops(model, channels, height, width) if reference
                 else deepcam_forward_flops(model, channels, height, width))
    freqs = train_set.class_frequencies
    decode = None
    same = all(np.array_equal(a, b) if a is not None else b is None
               for a, b in zip(train_set.normalisation, val_set.normalisation))
    if d.decode_on_device and same:  # one decoder serves both splits: the same statistics
        decode = FieldsDecoder(*train_set.normalisation, channels=channels)
        train_set.raw = val_set.raw = True
    if mesh.plan.space_degree > 1:
        # spatial parallelism: each rank reads only its block of every sample (HDF5 hyperslab)
        from ..parallel.spatial import SpatialBlocks, block_region
        region = block_region((height, width), mesh)
        for n, p, a in ((height, mesh.plan.space[1], "h"), (width, mesh.plan.space[2], "w")):
            if (n // p) % stride:
                ok = [q for q in range(1, n // stride + 1) if n % (q * stride) == 0]
                raise ConfigError(
                    f"plan.space splits the {n}-pixel {'height' if a == 'h' else 'width'} of the "
                    f"DeepCAM fields {p} ways into blocks of {n // p}, which the model's output "
                    f"stride {stride} does not divide; use space_{a} in {ok}, or fields whose "
                    f"size is a multiple of {p * stride}.")
        train_set, val_set = SpatialBlocks(train_set, region), SpatialBlocks(val_set, region)

    weights = None
    if d.class_weights and reference:
        weights = mlperf_class_weights(freqs)
    elif d.class_weights:
        if freqs is None:
            raise ConfigError(
                f"data.class_weights=true needs class frequencies in the stats file "
                f"next to {path}; set data.class_weights=false or regenerate the data.")
        weights = class_weights_from_frequencies(freqs)
    k = len(CLASS_NAMES)
    space = mesh.axis("space")

    def metric_sums(output, target):
        labels = output.argmax(1)
        pred, true = labels.flatten(), target.long().flatten()
        cm = torch.bincount(true * k + pred, minlength=k * k).double()
        sums = {f"cm_{i}_{j}": cm[i * k + j] for i in range(k) for j in range(k)}
        if reference:  # MLPerf's per-sample IoU, counted once per sample (module doc)
            first = float(space.rank == 0)
            sums["mlperf_iou_sum"] = mlperf_iou(labels, target, k, space).sum() * first
            sums["samples"] = torch.tensor(float(len(target)) * first, dtype=torch.float64)
        return sums

    def finalize(s):
        cm = torch.tensor([[float(s[f"cm_{i}_{j}"]) for j in range(k)] for i in range(k)])
        tp = cm.diagonal()
        union = cm.sum(0) + cm.sum(1) - tp
        pooled = iou_from_confusion(cm)
        out = {"val_mean_iou": pooled, "val_pixel_accuracy": float(tp.sum() / cm.sum().clamp_min(1))}
        if reference:
            n = float(s["samples"])
            out["val_mean_iou"] = float(s["mlperf_iou_sum"]) / n if n else float("nan")
            out["val_pooled_mean_iou"] = pooled
        for i, name in enumerate(CLASS_NAMES):
            out[f"val_iou_{name}"] = float(tp[i] / union[i]) if union[i] > 0 else float("nan")
        return out

    baselines = {}
    if freqs is not None and not reference:
        present = sum(1 for f in freqs if f > 0)
        # predicting background everywhere: IoU = background fraction for it, 0 for the others
        baselines["baseline_mean_iou"] = float(freqs[0]) / max(present, 1)

    return Workload(model=model, train_set=train_set, val_set=val_set,
                    loss_fn=segmentation_loss(weights, mesh, "pixels" if reference else "weights"),
                    metric_sums=metric_sums,
                    finalize=finalize, baselines=baselines, metric_axes=("data", "space"),
                    flops_per_sample=flops, decode=decode,
                    input_blocks=mesh.plan.space_degree > 1)
