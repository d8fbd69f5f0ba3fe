"""The workloads of `exatrain bench device`, at the full sizes for one GPU and at tiny CPU sizes.

Each case is one `exatrain run` config (as `--set` overrides of the workload's defaults), the
plain loss the baseline uses for the same workload, and the published figure it is set beside.

Full sizes (one 80 GB GPU):
  cosmoflow   MLPerf HPC's model and input: 128³ × 4 channels, 32 base channels, 5 conv blocks,
              no BatchNorm (8.9 M parameters), batch 16, 48 samples
  deepcam     MLPerf HPC's DeepCAM network (model.variant = "reference": DeepLabv3+ on the
              modified aligned Xception, 56.5 M parameters, 6.55e11 forward FLOPs a sample) on
              MLPerf's whole 768 × 1152 × 16 fields, batch 8, 48 samples (57 MB and ~9 s of one
              core each to generate, once per data directory). Batch 8 peaked at 20.5 GiB
              on an H200 (bf16 autocast, compiled; 2026-11-27).
              Beside NVIDIA's published per-GPU rate, what differs (`DEEPCAM_DIFFERENCES`,
              in the JSON as deepcam_published_differences): the network and input size are
              MLPerf's; NVIDIA's figure is a time-to-train run on many GPUs (local batch of a
              few samples, gradient all-reduce, real CAM5 data staged to node memory and
              decoded by DALI, CUDA graphs and fused kernels in fp16/bf16), ours one GPU at
              batch 8 on synthetic fields read from HDF5, at the bench's precision
  vit         the SC23 "deep learning at scale" tutorial's ViT: 360 × 720 grid, patch 8, embed
              384, depth 12, 8 heads (4,050 tokens), batch 8; the shallow-water data have 3
              channels where the tutorial's ERA5 has 20 (only the patch embedding and head differ);
              3 trajectories of 8 frames (the simulation at 360 × 720 took 3.8 s for 3 saved
              frames on one core here: 4 × 12 frames, about a minute, were half the 110 s in
              which the case printed nothing, the two compiles most of the rest)
  gpt_125m    the "125m" preset (block 2048, vocab 50304), batch 8
  gpt_1b      the "1.3b" preset, batch 4
Small sizes: the same models shrunk until the whole bench runs on a CPU in seconds, on data sets
of at least a dozen batches an epoch (the Trainer shuffles at every epoch's start, the baseline
draws its whole order before its loop: a data set of one batch would charge exatrain a shuffle
every step).

Every case runs without dropout (the Trainer reseeds dropout per step; the baseline cannot
replay that, and the two paths must agree), at a constant learning rate with no warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F


@dataclass(frozen=True)
class Published:
    value: float
    unit: str          # "samples_per_s" (per GPU), "mfu_peak" or "speedup_vs_plain"
    source: str


@dataclass(frozen=True)
class Case:
    name: str
    workload: str
    sets: dict                          # config overrides, "section.key" -> value
    published: Published | None = None
    data_sets: dict = field(default_factory=dict)  # data.* that name and size the data set
    differences: tuple[str, ...] = ()   # what differs from the published figure's setting
    unpublished: str = ""               # why no published figure is set beside this case


COMMON = {"train.eval_every": 0, "schedule.warmup_steps": 0,
          "schedule.decay": "constant", "data.generate": True}

MLPERF_COSMOFLOW = Published(200.0, "samples_per_s", "NVIDIA, MLPerf HPC v3.0 CosmoFlow: 2.1 min "
                             "on 512 H100, about 200 samples/s per GPU")
MLPERF_DEEPCAM = Published(30.0, "samples_per_s", "NVIDIA, MLPerf HPC v3.0 DeepCAM: about 30 "
                           "samples/s per H100")
DEEPCAM_DIFFERENCES = (
    "network and input: the same (MLPerf HPC's DeepLabv3+ on Xception, 768 x 1152 x 16, "
    "3 classes, MLPerf's class weights)",
    "scale: NVIDIA's rate is per GPU of a many-GPU time-to-train run (gradient all-reduce "
    "included); ours is one GPU alone",
    "batch: NVIDIA's local batch is a few samples per GPU; ours 8 on one GPU",
    "precision and kernels: NVIDIA's mixed precision with CUDA graphs and fused kernels; ours "
    "the bench's precision (bf16 autocast on a GPU) with torch.compile",
    "data: NVIDIA's real CAM5 fields staged to node memory, decoded by DALI; ours synthetic "
    "fields of the same shape read from HDF5 by exatrain's loader",
)
NERSC_VIT = Published(4.6, "speedup_vs_plain", "NERSC SC23 tutorial: 4.6x single-GPU speed-up of "
                      "its ViT from data loading, mixed precision, fused optimizers, compile")
TORCHTITAN = Published(0.33, "mfu_peak", "torchtitan: 33-39 % MFU, Llama 3.1 8B on H100 (bf16)")


def _cases(size: str) -> list[Case]:
    small = size == "small"
    cosmo = dict(size=32, base_channels=4) if small else dict(size=128, base_channels=32)
    cosmoflow = Case("cosmoflow", "cosmoflow", {
        "model.size": cosmo["size"], "model.base_channels": cosmo["base_channels"],
        "model.conv_layers": 5, "model.batchnorm": False, "model.channels_last": True,
        "train.batch_size": 2 if small else 16},
        MLPERF_COSMOFLOW,
        {"data.size": cosmo["size"], "data.samples": 40 if small else 48})
    # small: the small net (a harness check on a CPU), never set beside a published rate
    deepcam = Case("deepcam", "deepcam", {
        "model.variant": "small", "model.width": 4, "model.dropout": 0.0,
        "train.batch_size": 2},
        None, {"data.height": 32, "data.width": 48, "data.channels": 16, "data.samples": 40},
        unpublished="the small net is not MLPerf's DeepCAM: --sizes full runs the reference "
                    "definition beside NVIDIA's rate") if small else Case(
        "deepcam", "deepcam", {"model.variant": "reference", "model.width_multiplier": 1.0,
                               "train.batch_size": 8},
        MLPERF_DEEPCAM,
        {"data.height": 768, "data.width": 1152, "data.channels": 16, "data.samples": 48},
        differences=DEEPCAM_DIFFERENCES)
    gh, gw = (16, 32) if small else (360, 720)
    vit = Case("vit", "vit", {
        "model.patch_size": 8, "model.embed_dim": 16 if small else 384,
        "model.depth": 1 if small else 12, "model.num_heads": 2 if small else 8,
        "train.batch_size": 2 if small else 8},
        NERSC_VIT,
        {"data.height": gh, "data.width": gw, "data.trajectories": 4 if small else 3,
         "data.steps": 12 if small else 8})
    gpt_small = {"model.vocab_size": 256, "model.block_size": 32, "model.n_layer": 1,
                 "model.n_head": 2, "model.n_embd": 16}
    gpt_125m = Case("gpt_125m", "gpt", {
        **(gpt_small if small else {"model.preset": "125m"}),
        "train.batch_size": 2 if small else 8}, TORCHTITAN,
        {"data.max_bytes": 200_000 if small else 8_000_000, "data.val_samples": 4})
    gpt_1b = Case("gpt_1b", "gpt", {
        **({**gpt_small, "model.n_layer": 2, "model.n_embd": 32} if small
           else {"model.preset": "1.3b"}),
        "train.batch_size": 2 if small else 4}, TORCHTITAN,
        {"data.max_bytes": 200_000 if small else 8_000_000, "data.val_samples": 4})
    return [cosmoflow, deepcam, vit, gpt_125m, gpt_1b]


def cases(size: str) -> list[Case]:
    if size not in ("small", "full"):
        raise ValueError(f"--sizes {size!r}: choose 'small' (CPU harness check) or 'full' (one GPU).")
    return _cases(size)


def data_path(root: str, case: Case) -> str:
    """One data directory per workload and data shape, so a second run reuses what the first wrote."""
    tag = "-".join(str(v) for v in case.data_sets.values())
    return f"{root}/{case.workload}-{tag}"


def plain_loss(case: Case, workload, config):
    """The baseline's loss for the case: plain PyTorch, equal at one process to the workload's."""
    from ..models.gpt import gpt_loss
    from ..models.vit import relative_l2_loss
    if case.workload == "cosmoflow":
        return F.mse_loss
    if case.workload == "vit":
        return relative_l2_loss
    if case.workload == "gpt":
        return gpt_loss
    # DeepCAM's two variants weigh and average the pixels differently (workloads/deepcam.py):
    # "reference" MLPerf's w_c = f_c^(-1/8) over the pixel count, "small" normalised inverse
    # square roots over the pixels' summed weights (F.cross_entropy's weighted mean)
    from ..models.deepcam import class_weights_from_frequencies
    from ..workloads.deepcam import mlperf_class_weights
    freqs = workload.train_set.class_frequencies
    reference = config.model.variant == "reference"
    if reference:
        weights = mlperf_class_weights(freqs)
    else:
        weights = None if freqs is None else class_weights_from_frequencies(freqs)

    def weighted_cross_entropy(logits, labels):
        labels = labels.long()
        w = None if weights is None else weights.to(device=logits.device, dtype=logits.dtype)
        if reference:  # the weighted sum over the pixel count
            return F.cross_entropy(logits, labels, weight=w, reduction="sum") / labels.numel()
        return F.cross_entropy(logits, labels, weight=w)
    return weighted_cross_entropy
