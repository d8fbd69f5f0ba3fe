"""CosmoFlow, as MLPerf HPC defines it: regress four cosmological parameters from a 3D cube.

    5 × [Conv3d(k=3, 'same') -> LeakyReLU -> MaxPool3d(2)], channels 4 -> 32 -> 64 -> 128 -> 256 -> 512
    flatten -> Linear 128 -> LeakyReLU -> Linear 64 -> LeakyReLU -> Linear 4 -> tanh × 1.2

At 128³×4 input the flattened features are 512 × 4³ and the model has 8,907,556 parameters.
Weights are initialised as the MLPerf reference (Keras) does: Glorot-uniform kernels, zero biases.
That matters here: with PyTorch's default init the signal shrinks through the seven layers and
training sits on a plateau for ~100 extra steps (measured on the synthetic set at 32³).
Plain PyTorch: it knows nothing of parallelism.
"""

from __future__ import annotations

from torch import nn


class CosmoFlow(nn.Module):
    def __init__(self, size: int = 128, in_channels: int = 4, base_channels: int = 32,
                 conv_layers: int = 5, dropout: float = 0.0, out_features: int = 4):
        super().__init__()
        if size % 2 ** conv_layers:
            raise ValueError(f"CosmoFlow size={size} must be divisible by 2^{conv_layers} = "
                             f"{2 ** conv_layers} (one halving per conv block); try "
                             f"{max(2 ** conv_layers, size // 2 ** conv_layers * 2 ** conv_layers)}.")
        layers: list[nn.Module] = []
        channels = in_channels
        for i in range(conv_layers):
            out = base_channels * 2 ** i
            layers += [nn.Conv3d(channels, out, kernel_size=3, padding=1),
                       nn.LeakyReLU(0.01), nn.MaxPool3d(2)]
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
        for module in self.modules():
            if isinstance(module, (nn.Conv3d, nn.Linear)):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x):
        return self.head(self.features(x)) * self.output_scale
