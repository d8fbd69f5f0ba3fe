"""DeepCAM-style climate segmentation model (a small DeepLabv3+ encoder-decoder).

The network maps a multi-channel atmospheric state ``(B, C, H, W)`` to per-pixel
logits ``(B, num_classes, H, W)`` for the three DeepCAM classes
(0 = background, 1 = tropical cyclone, 2 = atmospheric river).

It is deliberately plain PyTorch and knows nothing about parallelism.  Its layer
vocabulary is restricted so that the model can later be partitioned spatially
(each rank holding a block of the H x W domain plus halos):

* only local operators - ``Conv2d`` (incl. dilated), ``ConvTranspose2d``,
  ``BatchNorm2d``, ``ReLU``, ``Dropout2d``, nearest ``Upsample`` and ``torch.cat``;
* **no global pooling**: the original DeepLabv3+ ASPP has an image-level branch
  (global average pool), which would need a reduction over the whole domain;
  here ASPP has convolutional branches only;
* no bilinear / ``align_corners`` interpolation, whose result depends on the
  global image size rather than on a local neighbourhood.

Metrics and loss helpers used by DeepCAM training live here too:
:func:`weighted_cross_entropy`, :func:`class_weights_from_frequencies`,
:func:`confusion_matrix`, :func:`iou_from_confusion` and :func:`mean_iou`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .branches import Branches
from ..errors import DataError, ModelInputError, ModelOptionError

__all__ = [
    "DeepCAM",
    "ASPP",
    "weighted_cross_entropy",
    "class_weights_from_frequencies",
    "confusion_matrix",
    "iou_from_confusion",
    "mean_iou",
]


def _conv_bn_relu(
    in_ch: int, out_ch: int, kernel: int = 3, stride: int = 1, dilation: int = 1
) -> nn.Sequential:
    """Conv2d -> BatchNorm2d -> ReLU with "same" padding for odd kernels.

    The convolution has no bias because the following BatchNorm has its own shift.
    """
    padding = dilation * (kernel // 2)
    return nn.Sequential(
        nn.Conv2d(
            in_ch, out_ch, kernel, stride=stride, padding=padding, dilation=dilation, bias=False
        ),
        nn.BatchNorm2d(out_ch),
        nn.ReLU(inplace=True),
    )


class ASPP(nn.Module):
    """Atrous spatial pyramid pooling with convolutional branches only.

    Branches: one 1x1 convolution plus one 3x3 convolution per dilation rate in
    ``rates``; their outputs are concatenated and projected by a 1x1 convolution.
    The image-level (global average pooling) branch of DeepLabv3 is left out on
    purpose, so every output pixel depends only on a bounded neighbourhood
    (receptive-field radius ``max(rates)`` at this resolution).

    Args:
        in_channels: input feature channels.
        out_channels: channels of every branch and of the projection.
        rates: dilation rates of the 3x3 branches.
        dropout: ``Dropout2d`` probability after the projection.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        rates: Sequence[int] = (1, 2, 3),
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.rates = tuple(int(r) for r in rates)
        branches = [_conv_bn_relu(in_channels, out_channels, kernel=1)]
        branches += [
            _conv_bn_relu(in_channels, out_channels, kernel=3, dilation=r) for r in self.rates
        ]
        self.branches = Branches(branches, combine="concat")  # independent: see et.Branches
        self.project = nn.Sequential(
            _conv_bn_relu(out_channels * len(branches), out_channels, kernel=1),
            nn.Dropout2d(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply all branches to ``x`` and fuse them."""
        return self.project(self.branches(x))


class DeepCAM(nn.Module):
    """Small DeepLabv3+-style segmentation network for DeepCAM climate data.

    Layout (``w = width``; resolution relative to the input in brackets)::

        stem      2 x conv3x3(w)                          [1]
        enc1      conv3x3/2(2w), conv3x3(2w)              [1/2]  -> low-level skip
        enc2      conv3x3/2(4w), conv3x3(4w)              [1/4]
        enc3      conv3x3/2(4w), conv3x3 dilation 2 (4w)  [1/8]  (atrous)
        aspp      1x1 + 3x3 at rates (1, 2, 3), 1x1 project (4w)
        decoder   nearest x4 -> cat(skip 1x1 (w)) -> 2 x conv3x3(2w)   [1/2]
                  ConvTranspose2d x2 (w) -> conv3x3(w)                 [1]
        classify  conv1x1(num_classes)

    The output stride is :attr:`output_stride` (= 8): ``H`` and ``W`` of the input
    must be divisible by it so that the decoder lands back on the input grid.
    About 1.2 M parameters at ``width=32`` and 0.3 M at ``width=16``.

    Args:
        in_channels: input channels (16 in DeepCAM).
        num_classes: output classes (3 in DeepCAM).
        width: base channel width ``w``.
        aspp_rates: dilation rates of the ASPP 3x3 branches.
        dropout: ``Dropout2d`` probability in ASPP.
    """

    output_stride: int = 8

    def __init__(
        self,
        in_channels: int = 16,
        num_classes: int = 3,
        width: int = 32,
        aspp_rates: Sequence[int] = (1, 2, 3),
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if in_channels < 1 or num_classes < 1 or width < 1:
            raise ModelOptionError(
                f"in_channels, num_classes and width must be >= 1, got "
                f"{in_channels}, {num_classes}, {width}"
            )
        w = int(width)
        self.in_channels = int(in_channels)
        self.num_classes = int(num_classes)
        self.width = w

        self.stem = nn.Sequential(_conv_bn_relu(in_channels, w), _conv_bn_relu(w, w))
        self.enc1 = nn.Sequential(_conv_bn_relu(w, 2 * w, stride=2), _conv_bn_relu(2 * w, 2 * w))
        self.enc2 = nn.Sequential(
            _conv_bn_relu(2 * w, 4 * w, stride=2), _conv_bn_relu(4 * w, 4 * w)
        )
        # The last stage stops downsampling at stride 8 and widens the receptive
        # field with a dilated convolution instead (the "atrous" part of DeepLab).
        self.enc3 = nn.Sequential(
            _conv_bn_relu(4 * w, 4 * w, stride=2), _conv_bn_relu(4 * w, 4 * w, dilation=2)
        )
        self.aspp = ASPP(4 * w, 4 * w, rates=aspp_rates, dropout=dropout)

        self.up_deep = nn.Upsample(scale_factor=4, mode="nearest")
        self.skip_proj = _conv_bn_relu(2 * w, w, kernel=1)
        self.fuse = nn.Sequential(_conv_bn_relu(5 * w, 2 * w), _conv_bn_relu(2 * w, 2 * w))
        # A learned 2x upsampling (kernel == stride, so no overlap and no halo
        # needed) back to full resolution, followed by one refinement conv.
        self.up_full = nn.Sequential(
            nn.ConvTranspose2d(2 * w, w, kernel_size=2, stride=2, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(inplace=True),
        )
        self.refine = _conv_bn_relu(w, w)
        self.classifier = nn.Conv2d(w, num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Per-pixel logits ``(B, num_classes, H, W)`` for input ``(B, C, H, W)``."""
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ModelInputError(
                f"DeepCAM expects input (B, {self.in_channels}, H, W), got {tuple(x.shape)}: "
                f"build it with in_channels={x.shape[1] if x.dim() == 4 else 'C'} for these data, "
                f"or feed {self.in_channels}-channel images (B, C, H, W)"
            )
        h, w = x.shape[-2:]
        if h % self.output_stride or w % self.output_stride:
            raise ModelInputError(
                f"DeepCAM needs H and W divisible by its output stride {self.output_stride}, "
                f"got {h}x{w}: crop or pad the images to multiples of {self.output_stride}"
            )
        x = self.stem(x)
        low = self.enc1(x)
        deep = self.aspp(self.enc3(self.enc2(low)))
        y = torch.cat([self.up_deep(deep), self.skip_proj(low)], dim=1)
        y = self.refine(self.up_full(self.fuse(y)))
        return self.classifier(y)


# --------------------------------------------------------------------------- loss


def class_weights_from_frequencies(
    freqs: Sequence[float] | np.ndarray | torch.Tensor, min_frequency: float = 1e-6
) -> torch.Tensor:
    """Inverse-square-root class weights, as in DeepCAM (Kurth et al., 2018).

    ``w_c = f_c ** -0.5`` normalised so the weights sum to one.  ``freqs`` may be
    frequencies or raw pixel counts (they are normalised to sum to one first).
    Classes with frequency below ``min_frequency`` are clamped to it, because an
    absent class would otherwise get an infinite weight.

    Returns:
        float32 tensor of shape ``(num_classes,)``.
    """
    if torch.is_tensor(freqs):
        f = freqs.detach().to("cpu", torch.float64).flatten()
    else:
        f = torch.as_tensor(np.asarray(freqs, dtype=np.float64)).flatten()
    if f.numel() == 0 or not torch.isfinite(f).all() or (f < 0).any() or f.sum() <= 0:
        raise DataError(
            f"class frequencies must be finite, >= 0 and not all zero, got {f.tolist()}"
        )
    f = (f / f.sum()).clamp_min(min_frequency)
    w = f.rsqrt()
    return (w / w.sum()).float()


def weighted_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    class_weights: torch.Tensor | Sequence[float] | None = None,
) -> torch.Tensor:
    """Class-weighted per-pixel cross entropy.

    Args:
        logits: ``(B, K, H, W)`` unnormalised scores.
        labels: ``(B, H, W)`` integer class labels in ``[0, K)``.
        class_weights: ``(K,)`` weights (e.g. from
            :func:`class_weights_from_frequencies`) or ``None`` for unweighted.

    Returns:
        Scalar loss: the weighted mean ``sum_i w_{y_i} l_i / sum_i w_{y_i}`` (PyTorch's
        convention), so the overall scale of the weights does not change the
        learning rate.
    """
    if class_weights is not None:
        class_weights = torch.as_tensor(class_weights, dtype=logits.dtype, device=logits.device)
    return F.cross_entropy(logits, labels.long(), weight=class_weights)


# ------------------------------------------------------------------------ metrics


def _as_long_tensor(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    return torch.as_tensor(x).long() if not torch.is_tensor(x) else x.detach().long()


def confusion_matrix(
    pred_labels: torch.Tensor | np.ndarray,
    labels: torch.Tensor | np.ndarray,
    num_classes: int,
) -> torch.Tensor:
    """``(K, K)`` int64 confusion matrix, rows = true class, columns = predicted.

    Confusion matrices add up exactly across batches or ranks, unlike per-batch
    IoUs, so accumulate these and call :func:`iou_from_confusion` at the end.
    """
    pred = _as_long_tensor(pred_labels).flatten().cpu()
    true = _as_long_tensor(labels).flatten().cpu()
    if pred.shape != true.shape:
        raise ValueError(
            f"pred_labels and labels differ in size: {tuple(pred_labels.shape)} vs "
            f"{tuple(labels.shape)}"
        )
    for name, t in (("pred_labels", pred), ("labels", true)):
        if t.numel() and (t.min() < 0 or t.max() >= num_classes):
            raise ValueError(f"{name} must lie in [0, {num_classes}), got [{t.min()}, {t.max()}]")
    idx = true * num_classes + pred
    return torch.bincount(idx, minlength=num_classes * num_classes).reshape(
        num_classes, num_classes
    )


def iou_from_confusion(cm: torch.Tensor | np.ndarray) -> float:
    """Mean IoU from a confusion matrix, skipping classes absent from both
    prediction and label (their IoU is undefined).  ``nan`` if no class occurs."""
    cm = torch.as_tensor(cm).double()
    tp = cm.diagonal()
    union = cm.sum(0) + cm.sum(1) - tp
    present = union > 0
    if not present.any():
        return float("nan")
    return float((tp[present] / union[present]).mean())


def mean_iou(
    pred_labels: torch.Tensor | np.ndarray,
    labels: torch.Tensor | np.ndarray,
    num_classes: int,
) -> float:
    """Mean intersection-over-union over classes, pooled over all given pixels.

    Classes absent in both ``pred_labels`` and ``labels`` are ignored.  For
    DeepCAM's trivial all-background prediction this gives
    ``background_fraction / num_classes_present``.
    """
    return iou_from_confusion(confusion_matrix(pred_labels, labels, num_classes))
