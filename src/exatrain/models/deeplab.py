"""DeepCAM as MLPerf HPC defines it: DeepLabv3+ on a modified aligned Xception (plain PyTorch).

MLPerf HPC's DeepCAM benchmark segments 16-channel 768 × 1152 climate fields into background,
tropical cyclones and atmospheric rivers with this network (Kurth et al., SC18; the reference
implementation in mlcommons/hpc, deepcam/src/deepCam/architecture). Written here from that
definition; the module and parameter names are exatrain's own.

Layout at output stride 16 (channels at width 1; resolution relative to the input)::

    backbone.stem     conv3x3/2 (32), BN, ReLU, conv3x3 (64), BN, ReLU            [1/2]
    backbone.entry    three blocks, each two separable convs (BN, ReLU between) and a separable
                      conv of stride 2, plus a 1×1 stride-2 projection on the skip path:
                      128 [1/4] (its ReLU'd output is the decoder's low-level feature),
                      256 [1/8], 728 [1/16]
    backbone.middle   16 residual blocks of 3 separable convs of 728 channels     [1/16]
    backbone.exit     a residual block 728 -> 1024 (projected skip), then separable convs
                      1536, 1536, 2048 with dilation 2 (the atrous exit flow)      [1/16]
    aspp              1×1 conv, 3×3 convs at rates 6, 12, 18 (each 256, BN, ReLU) and the
                      image-level pool (`ImagePool`: global mean, 1×1, affine, ReLU);
                      concatenated (1280) and projected by 1×1 (256), BN, ReLU      [1/16]
    decoder.low       1×1 conv (48), BN, ReLU on the low-level feature             [1/4]
    decoder.up        two transposed convs 3×3/2 (256), BN, ReLU                    [1/4]
    decoder.fuse      cat (256 + 48) -> conv3x3 (256), BN, ReLU, conv3x3 (256), BN, ReLU,
                      conv1x1 (256, with bias)                                     [1/4]
    decoder.up_full   transposed conv 3×3/2 (256), BN, ReLU                         [1/2]
    decoder.classify  transposed conv 3×3/2 (num_classes), no BN, no bias          [1]

A separable convolution is a depthwise 3×3 convolution (groups = channels) followed by a 1×1
(pointwise) one, no BatchNorm between (MLPerf's `SeparableConv2d_same`); every convolution before
a BatchNorm has no bias. A residual block is  relu?(rep(x) + skip(x)),  its rep a chain of
separable conv, BN, ReLU, ... with the last ReLU dropped and, where the block strides (or ends
the entry / starts the exit flow), one more separable conv without BatchNorm.

`width` scales every channel count (round(c · width), at least 1): 1 is MLPerf's network, smaller
values give the same topology narrow, for tests on a CPU. The reference's input is 768 × 1152; H
and W must be multiples of the output stride 16.

Cost. Parameters: 56,454,720 at width 1 with 16 inputs and 3 classes (counted by the test from
the model; the reference implementation's module, counted the same way, has the same number, and
with its weights copied in gives the same outputs to 3e-15 in float64, measured). Forward FLOPs per sample (2 × multiply-adds of every convolution and the image pool's
projection): `forward_flops`, 655,337,666,560 (6.55e11) at 768 × 1152 (3 × that per training
step), equal to torch's FlopCounterMode's count of the same forward. Almost all of it is pointwise convolutions and the decoder's
full-resolution layers; the depthwise convolutions are 9 multiply-adds per element.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelInputError, ModelOptionError
from .branches import Branches
from .image_pool import ImagePool

__all__ = ["DeepLabXception", "XceptionBlock", "separable_conv", "conv_forward_flops"]

MIDDLE_BLOCKS = 16
ASPP_RATES = (6, 12, 18)


def separable_conv(in_ch: int, out_ch: int, stride: int = 1, dilation: int = 1) -> nn.Sequential:
    """Depthwise 3×3 (groups = in_ch, "same" padding = dilation) then pointwise 1×1; no bias."""
    return nn.Sequential(
        nn.Conv2d(in_ch, in_ch, 3, stride=stride, padding=dilation, dilation=dilation,
                  groups=in_ch, bias=False),
        nn.Conv2d(in_ch, out_ch, 1, bias=False))


class XceptionBlock(nn.Module):
    """One residual block of the aligned Xception: ``relu?(rep(x) + skip(x))``.

    rep: ``reps`` separable convolutions (3×3 depthwise at `dilation`, then 1×1), each followed
    by BatchNorm and ReLU, except that the last ReLU is dropped; the channels grow to `out_ch`
    at the first (`grow_first`) or the last of them. Then, if `stride` is 2, one more separable
    conv of stride 2, or if `extra_conv`, one of stride 1 (neither with BatchNorm after it).
    skip: identity when shape is kept, else a 1×1 convolution of the block's stride and a
    BatchNorm.

    Cost per output position: Σ over its separable convs of (9·C_in + C_in·C_out) multiply-adds,
    plus C_in·C_out for a projected skip.
    """

    def __init__(self, in_ch: int, out_ch: int, reps: int, stride: int = 1, dilation: int = 1,
                 end_relu: bool = True, grow_first: bool = True, extra_conv: bool = False):
        super().__init__()
        layers: list[nn.Module] = []
        chans = [in_ch] + ([out_ch] * reps if grow_first else [in_ch] * (reps - 1) + [out_ch])
        for i in range(reps):
            layers += [separable_conv(chans[i], chans[i + 1], dilation=dilation),
                       nn.BatchNorm2d(chans[i + 1]), nn.ReLU()]
        layers.pop()  # the last ReLU is dropped
        if stride != 1:
            layers.append(separable_conv(out_ch, out_ch, stride=stride))
        elif extra_conv:
            layers.append(separable_conv(out_ch, out_ch))
        self.rep = nn.Sequential(*layers)
        self.skip = None
        if in_ch != out_ch or stride != 1:
            self.skip = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                      nn.BatchNorm2d(out_ch))
        self.end_relu = end_relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.rep(x) + (x if self.skip is None else self.skip(x))
        return F.relu(y) if self.end_relu else y


def _bn_relu(conv: nn.Module, ch: int) -> list[nn.Module]:
    return [conv, nn.BatchNorm2d(ch), nn.ReLU()]


def _up(in_ch: int, out_ch: int) -> nn.ConvTranspose2d:
    """Transposed 3×3 convolution of stride 2 that exactly doubles H and W (as MLPerf's)."""
    return nn.ConvTranspose2d(in_ch, out_ch, 3, stride=2, padding=1, output_padding=1, bias=False)


class Xception(nn.Module):
    """The modified aligned Xception backbone at output stride 16; returns (features, low-level)."""

    def __init__(self, in_channels: int, ch) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            *_bn_relu(nn.Conv2d(in_channels, ch(32), 3, stride=2, padding=1, bias=False), ch(32)),
            *_bn_relu(nn.Conv2d(ch(32), ch(64), 3, padding=1, bias=False), ch(64)))
        self.entry = nn.ModuleList([
            XceptionBlock(ch(64), ch(128), 2, stride=2, end_relu=False),
            XceptionBlock(ch(128), ch(256), 2, stride=2),
            XceptionBlock(ch(256), ch(728), 2, stride=2)])
        self.middle = nn.Sequential(*[XceptionBlock(ch(728), ch(728), 3)
                                      for _ in range(MIDDLE_BLOCKS)])
        self.exit = nn.Sequential(
            XceptionBlock(ch(728), ch(1024), 2, end_relu=False, grow_first=False, extra_conv=True),
            *_bn_relu(separable_conv(ch(1024), ch(1536), dilation=2), ch(1536)),
            *_bn_relu(separable_conv(ch(1536), ch(1536), dilation=2), ch(1536)),
            *_bn_relu(separable_conv(ch(1536), ch(2048), dilation=2), ch(2048)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.entry[0](self.stem(x))
        low = F.relu(x)                  # the decoder's low-level feature: ReLU'd (as MLPerf's)
        x = self.entry[2](self.entry[1](low))
        return self.exit(self.middle(x)), low


class ASPPImagePool(nn.Module):
    """DeepLabv3's ASPP with its image-level branch: 1×1, 3×3 at `rates`, image pool; concat,
    1×1 projection, BatchNorm, ReLU. No dropout (as MLPerf's)."""

    def __init__(self, in_ch: int, out_ch: int, rates=ASPP_RATES) -> None:
        super().__init__()
        self.rates = tuple(int(r) for r in rates)
        branches = [nn.Sequential(*_bn_relu(nn.Conv2d(in_ch, out_ch, 1, bias=False), out_ch))]
        branches += [nn.Sequential(*_bn_relu(
            nn.Conv2d(in_ch, out_ch, 3, padding=r, dilation=r, bias=False), out_ch))
            for r in self.rates]
        branches.append(ImagePool(in_ch, out_ch))
        self.branches = Branches(branches, combine="concat")
        self.project = nn.Sequential(
            *_bn_relu(nn.Conv2d(out_ch * len(branches), out_ch, 1, bias=False), out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.branches(x))


class Decoder(nn.Module):
    """DeepLabv3+'s decoder with MLPerf's transposed convolutions (module doc)."""

    def __init__(self, low_ch: int, deep_ch: int, ch, num_classes: int) -> None:
        super().__init__()
        c = ch(256)
        self.low = nn.Sequential(*_bn_relu(nn.Conv2d(low_ch, ch(48), 1, bias=False), ch(48)))
        self.up = nn.Sequential(*_bn_relu(_up(deep_ch, c), c), *_bn_relu(_up(c, c), c))
        self.fuse = nn.Sequential(
            *_bn_relu(nn.Conv2d(c + ch(48), c, 3, padding=1, bias=False), c),
            *_bn_relu(nn.Conv2d(c, c, 3, padding=1, bias=False), c),
            nn.Conv2d(c, c, 1))
        self.up_full = nn.Sequential(*_bn_relu(_up(c, c), c))
        self.classify = _up(c, num_classes)

    def forward(self, deep: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        y = self.fuse(torch.cat([self.up(deep), self.low(low)], dim=1))
        return self.classify(self.up_full(y))


class DeepLabXception(nn.Module):
    """DeepCAM's network as MLPerf HPC defines it (module doc): (B, C, H, W) -> (B, K, H, W).

    Args:
        in_channels: input channels (16 in DeepCAM).
        num_classes: output classes (3 in DeepCAM).
        width: channel multiplier; 1 is MLPerf's network (module doc).
    """

    output_stride: int = 16
    middle_blocks: int = MIDDLE_BLOCKS

    def __init__(self, in_channels: int = 16, num_classes: int = 3, width: float = 1.0) -> None:
        super().__init__()
        if in_channels < 1 or num_classes < 1 or not width > 0:
            raise ModelOptionError(
                f"in_channels and num_classes must be >= 1 and width > 0, got {in_channels}, "
                f"{num_classes}, {width}")
        self.in_channels, self.num_classes, self.width = int(in_channels), int(num_classes), width

        def ch(c: int) -> int:
            return max(1, round(c * width))

        self.backbone = Xception(in_channels, ch)
        self.aspp = ASPPImagePool(ch(2048), ch(256))
        self.decoder = Decoder(ch(128), ch(256), ch, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        """MLPerf's: Kaiming-normal (fan-in) encoder and ASPP convolutions, N(0, 2/(k²·out))
        decoder ones, BatchNorm scale 1 and shift 0."""
        for part, mode in ((self.backbone, "fan_in"), (self.aspp, "fan_in"),
                           (self.decoder, "fan_out")):
            for m in part.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode=mode)
                elif isinstance(m, nn.ConvTranspose2d):  # weight (in, out, k, k): fan-out is dim 1
                    k = m.kernel_size[0] * m.kernel_size[1]
                    nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / (k * m.out_channels)))
                elif isinstance(m, nn.BatchNorm2d):
                    nn.init.ones_(m.weight)
                    nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Per-pixel logits (B, num_classes, H, W) for input (B, C, H, W)."""
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ModelInputError(
                f"DeepLabXception expects input (B, {self.in_channels}, H, W), got "
                f"{tuple(x.shape)}: build it with in_channels="
                f"{x.shape[1] if x.dim() == 4 else 'C'} for these data")
        h, w = x.shape[-2:]
        if h % self.output_stride or w % self.output_stride:
            raise ModelInputError(
                f"DeepLabXception needs H and W divisible by its output stride "
                f"{self.output_stride}, got {h}x{w}: crop or pad to multiples of "
                f"{self.output_stride} (MLPerf's 768 x 1152 is)")
        deep, low = self.backbone(x)
        return self.decoder(self.aspp(deep), low)

    def forward_flops(self, height: int = 768, width: int = 1152) -> float:
        """Forward FLOPs of one sample at H × W (`conv_forward_flops`, a shape-only pass)."""
        return conv_forward_flops(self, self.in_channels, height, width)


def conv_forward_flops(model: nn.Module, channels: int, height: int, width: int) -> float:
    """Forward FLOPs of one (C, H, W) sample through `model`: 2 × the multiply-adds of every
    convolution (a grouped one: C_in / groups per output), transposed convolution (every tap of
    every input element, the cropped ones included, as torch's FlopCounterMode counts them) and
    `ImagePool` projection; nothing for norms, activations or additions. A pass on the meta
    device with forward hooks: shapes only, no memory, no arithmetic."""
    import copy

    flops = 0.0

    def count(module, inputs, output):
        nonlocal flops
        k = math.prod(module.kernel_size) if hasattr(module, "kernel_size") else 1
        if isinstance(module, nn.ConvTranspose2d):
            flops += 2.0 * inputs[0].numel() * module.out_channels // module.groups * k
        elif isinstance(module, nn.Conv2d):
            flops += 2.0 * output.numel() * module.in_channels // module.groups * k
        elif isinstance(module, ImagePool):
            flops += 2.0 * output.shape[0] * module.out_channels * module.in_channels

    meta = copy.deepcopy(model).to("meta")
    hooks = [m.register_forward_hook(count) for m in meta.modules()
             if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d, ImagePool))]
    try:
        with torch.no_grad():
            meta.eval()(torch.empty(1, channels, height, width, device="meta"))
    finally:
        for h in hooks:
            h.remove()
    return flops
