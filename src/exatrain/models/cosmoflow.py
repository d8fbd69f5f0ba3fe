"""CosmoFlow, as MLPerf HPC defines it: regress four cosmological parameters from a 3D cube.

    5 × [Conv3d(k=3, 'same') -> LeakyReLU -> MaxPool3d(2)], channels 4 -> 32 -> 64 -> 128 -> 256 -> 512
    flatten -> Linear 128 -> LeakyReLU -> Linear 64 -> LeakyReLU -> Linear 4 -> tanh × 1.2

At 128³×4 input the flattened features are 512 × 4³ and the model has 8,907,556 parameters.
Weights are initialised as the MLPerf reference (Keras) does: Glorot-uniform kernels, zero biases.
That matters here: with PyTorch's default init the signal shrinks through the seven layers and
training sits on a plateau for ~100 extra steps (measured on the synthetic set at 32³).

Options beyond the reference:
* ``batchnorm=True``: Conv3d (no bias) -> BatchNorm3d -> LeakyReLU in each block. What made the
  default job learn the spectral slope (n_s, and H0 through the spectrum's shape): measured on
  the synthetic 32³ set, base_channels 16, 3,000 steps on 4,032 samples, val MAE 0.46-0.57 × the
  predict-the-mean baseline with it against 0.59 × without, which never learned n_s or H0 (the
  table is in docs/get-started/first-run.md, "The default job's figures").
* ``channels_last=True``: the input is made channels-last (NDHWC in memory) before the first conv,
  so oneDNN (CPU) and cuDNN run channels-last kernels: 1.5x faster per step on CPU at 32³ (26.7
  against 40.6 ms, batch 4, one thread). The parameters keep their usual layout.
Plain PyTorch: it knows nothing of parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ModelInputError, ModelOptionError


class CosmoFlow(nn.Module):
    def __init__(self, size: int = 128, in_channels: int = 4, base_channels: int = 32,
                 conv_layers: int = 5, dropout: float = 0.0, out_features: int = 4,
                 batchnorm: bool = False, channels_last: bool = False):
        super().__init__()
        if size % 2 ** conv_layers:
            raise ModelOptionError(
                f"CosmoFlow size={size} must be divisible by 2^{conv_layers} = "
                f"{2 ** conv_layers} (one halving per conv block); try "
                f"{max(2 ** conv_layers, size // 2 ** conv_layers * 2 ** conv_layers)}.")
        layers: list[nn.Module] = []
        channels = in_channels
        for i in range(conv_layers):
            out = base_channels * 2 ** i
            if batchnorm:  # the norm's shift makes the conv's bias redundant
                layers += [nn.Conv3d(channels, out, kernel_size=3, padding=1, bias=False),
                           nn.BatchNorm3d(out)]
            else:
                layers += [nn.Conv3d(channels, out, kernel_size=3, padding=1)]
            layers += [nn.LeakyReLU(0.01), nn.MaxPool3d(2)]
            channels = out
        self.features = nn.Sequential(*layers)
        flat = channels * (size // 2 ** conv_layers) ** 3
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(flat, 128), nn.LeakyReLU(0.01), nn.Dropout(dropout),
            nn.Linear(128, 64), nn.LeakyReLU(0.01), nn.Dropout(dropout),
            nn.Linear(64, out_features), nn.Tanh(),
        )
        self.output_scale = 1.2
        self.channels_last = channels_last
        self.in_channels, self.size = in_channels, size
        for module in self.modules():
            if isinstance(module, (nn.Conv3d, nn.Linear)):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, x):
        # channels and rank only: under a `space` split this forward sees a rank's block, so
        # the cube's edge is checked against the data at build time (workloads.cosmoflow)
        if x.dim() != 5 or x.shape[1] != self.in_channels:
            fix = (f"feed channels-first cubes: x.permute(0, 4, 1, 2, 3) turns these (B, S, S, "
                   f"S, {self.in_channels}) ones around" if x.dim() == 5 and
                   x.shape[-1] == self.in_channels else
                   f"feed (B, C, S, S, S) cubes of {self.in_channels} channels, or build the "
                   f"model with in_channels=C for data of C channels")
            raise ModelInputError(
                f"CosmoFlow expects input (B, {self.in_channels}, {self.size}, {self.size}, "
                f"{self.size}), got {tuple(x.shape)}: {fix}")
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last_3d)
        return self.head(self.features(x)) * self.output_scale
