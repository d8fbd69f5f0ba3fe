"""What a workload hands the Trainer: model, data sets, loss, and summable validation statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.utils.data import Dataset


SHUFFLE_MODES = ("global", "node")


@dataclass
class InputOptions:
    """[data] keys every built-in workload shares (its own DataOptions adds the rest)."""
    stage_to: str = ""          # copy the data set once per node to this node-local directory
                                # before training (/dev/shm, $TMPDIR, NVMe; env EXATRAIN_STAGE_TO
                                # overrides); "" = read data.path where it is
    shuffle: str = "global"     # global: one permutation of all samples per epoch (equal to
                                # serial); node: each node shuffles only its shard of the samples


@dataclass
class Workload:
    model: nn.Module
    train_set: Dataset
    val_set: Dataset
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # Per validation batch: named sums (e.g. {"abs_err": ..., "count": ...}); the Trainer adds
    # them over batches and over `metric_axes`, then `finalize` turns sums into metrics.
    metric_sums: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]
    finalize: Callable[[dict[str, float]], dict[str, float]]
    baselines: dict[str, float] = field(default_factory=dict)
    metric_axes: tuple[str, ...] = ("data",)
    # Model FLOPs of one training sample (forward + backward), for MFU; 0 = unknown.
    flops_per_sample: float = 0.0
    # Tokens in one sample (sequence models), for tokens/s; 0 = not a sequence model.
    tokens_per_sample: int = 0
    # Inputs delivered in their stored form (e.g. int16 counts) are decoded by this function on
    # the device, batch by batch (data.loader.Prefetcher); it returns floating inputs unchanged,
    # so applying it to an already decoded batch is harmless. None: inputs arrive decoded.
    decode: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Under `space`: do the data sets deliver this rank's block of each sample (SpatialBlocks),
    # with the loss and metrics written for split outputs (the built-in CosmoFlow, DeepCAM)?
    # False: they deliver whole samples, and the parallel model cuts them into blocks and hands
    # back whole outputs, so the loss and metrics are the serial ones (a user's Task).
    input_blocks: bool = False
    # With input_blocks: the loss and metrics take whole outputs and whole targets (a user's
    # Task whose data set reads blocks, workloads.user): the parallel model gathers its output.
    whole_outputs: bool = False
    # The user handed a compiled model (torch.compile(model)): `model` is its plain module, laid
    # out as any other and compiled after the layout, as parallel.compile = true compiles.
    compile: bool = False
    # How a list of samples becomes a batch (input, target), as DataLoader's collate_fn: a
    # user's, for samples that do not stack (graphs of different sizes). None: stacked.
    collate_fn: Callable | None = None
    # The forward takes a derivative of its own output (forces, -dE/dx): the Plans and settings
    # that cannot differentiate twice are refused before the first step. A user's model is
    # probed for it (train/user_checks.py); a built-in workload says so here.
    differentiates: bool = False

    def spatial_io(self) -> dict:
        """How the model meets the data under `space`: `parallelize`'s whole_samples and
        input_blocks arguments (parallel/spatial/convert.py, "Whole samples")."""
        return {"whole_samples": not self.input_blocks or self.whole_outputs,
                "input_blocks": self.input_blocks}

    def decode_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as the model takes it (decoded on x's device when the data set delivers raw)."""
        return self.decode(x) if self.decode is not None else x
