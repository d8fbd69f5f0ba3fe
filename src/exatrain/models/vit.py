"""A Vision Transformer forecaster for gridded fields (plain PyTorch).

In the spirit of the NERSC "deep learning at scale" tutorial's ViT weather model:
the state x of shape (B, C_in, H, W) is cut into non-overlapping p x p patches,
each flattened patch (p*p*C_in values) is embedded by a Linear layer, learned
position embeddings are added, ``depth`` pre-norm transformer blocks mix the
N = (H/p)(W/p) tokens,

    z   <- z + Attn(LN(z)),   Attn(a) = W_o softmax(Q K^T / sqrt(d_head)) V,
                              Q = W_q a, K = W_k a, V = W_v a   (per head)
    z   <- z + MLP(LN(z)),    MLP(a) = W_2 GELU(W_1 a)

then a final LayerNorm and a Linear head map each token back to p*p*C_out values
which are un-patchified to (B, C_out, H, W). With ``residual`` the network predicts
the increment: y = x + f(x).

Every weight matrix is an ``nn.Linear`` (including the patch embedding, which a
Conv2d with stride = kernel = p would also express) so tensor parallelism can shard
them column-/row-wise; the attention reads its head count from the local q width,
so a column-sharded q/k/v with a row-sharded out_proj runs unchanged.
The model itself knows nothing about parallelism.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelInputError, ModelOptionError

__all__ = [
    "ViTForecaster",
    "Attention",
    "MLP",
    "Block",
    "patchify",
    "unpatchify",
    "relative_l2_loss",
    "flops_per_sample",
]


def patchify(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, p*p*C), N = (H/p)(W/p), tokens in row-major patch order.

    Each token's features are ordered (pi, pj, c): pixel row within the patch,
    pixel column, channel. :func:`unpatchify` is its exact inverse.
    """
    B, C, H, W = x.shape
    p = patch_size
    if H % p or W % p:
        raise ModelInputError(f"image {H}x{W} is not divisible by patch size {p}: crop or pad "
                              f"the images to multiples of {p}, or choose a patch size that "
                              f"divides both")
    x = x.reshape(B, C, H // p, p, W // p, p)
    x = x.permute(0, 2, 4, 3, 5, 1)  # B, Hp, Wp, pi, pj, C
    return x.reshape(B, (H // p) * (W // p), p * p * C)


def unpatchify(tokens: torch.Tensor, patch_size: int, height: int, width: int) -> torch.Tensor:
    """(B, N, p*p*C) -> (B, C, H, W); the exact inverse of :func:`patchify`."""
    B, N, F_ = tokens.shape
    p = patch_size
    hp, wp = height // p, width // p
    if hp * wp != N or F_ % (p * p):
        raise ModelInputError(
            f"cannot unpatchify {tuple(tokens.shape)} to {height}x{width} with patch {p}"
        )
    C = F_ // (p * p)
    x = tokens.reshape(B, hp, wp, p, p, C).permute(0, 5, 1, 3, 2, 4)  # B, C, Hp, pi, Wp, pj
    return x.reshape(B, C, height, width)


class Attention(nn.Module):
    """Multi-head (non-causal) self-attention with separate q/k/v/out projections.

    softmax(Q K^T / sqrt(d_head)) V per head via F.scaled_dot_product_attention.
    """

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ModelOptionError(f"embed_dim {dim} not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Heads from the *local* projection width, not self.num_heads: under tensor
        # parallelism q_proj is column-sharded and each rank holds num_heads / tp heads.
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.reshape(B, N, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=False
        )
        return self.out_proj(o.transpose(1, 2).reshape(B, N, heads * self.head_dim))


class MLP(nn.Module):
    """fc_out(GELU(fc_in(x))), hidden width mlp_ratio * dim."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc_in = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc_out = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc_out(self.act(self.fc_in(x))))


class Block(nn.Module):
    """Pre-norm transformer block: z + Attn(LN(z)), then z + MLP(LN(z))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, dropout)
        self.drop = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(round(dim * mlp_ratio)), dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.mlp(self.norm2(x))


class ViTForecaster(nn.Module):
    """ViT mapping a state (B, C_in, H, W) to the next state (B, C_out, H, W).

    ``residual`` (default: True iff in_channels == out_channels) makes the output
    x + f(x); the head is then zero-initialised so the untrained model is exactly
    the persistence forecast and training starts from that baseline.
    """

    def __init__(
        self,
        img_size: tuple[int, int] | int = (64, 128),
        patch_size: int = 8,
        in_channels: int = 3,
        out_channels: int = 3,
        embed_dim: int = 192,
        depth: int = 4,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        residual: bool | None = None,
    ) -> None:
        super().__init__()
        H, W = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        if H % patch_size or W % patch_size:
            raise ModelOptionError(f"img_size {(H, W)} is not divisible by patch_size {patch_size}")
        if residual is None:
            residual = in_channels == out_channels
        if residual and in_channels != out_channels:
            raise ModelOptionError(
                f"residual prediction needs in_channels == out_channels, got "
                f"{in_channels} != {out_channels}"
            )
        self.img_size = (H, W)
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.embed_dim = embed_dim
        self.depth = depth
        self.num_heads = num_heads
        self.mlp_ratio = mlp_ratio
        self.residual = bool(residual)
        self.num_patches = (H // patch_size) * (W // patch_size)

        self.patch_embed = nn.Linear(patch_size * patch_size * in_channels, embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches, embed_dim))
        self.pos_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, dropout) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, patch_size * patch_size * out_channels)
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if self.residual:
            # Start as persistence (y = x): the first updates can only learn a
            # correction to that baseline instead of first un-learning random noise.
            nn.init.zeros_(self.head.weight)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        return patchify(x, self.patch_size)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        return unpatchify(tokens, self.patch_size, *self.img_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-3:]) != (self.in_channels, *self.img_size):
            raise ModelInputError(
                f"expected input (B, {self.in_channels}, {self.img_size[0]}, "
                f"{self.img_size[1]}), got {tuple(x.shape)}: build the model with the data's "
                f"img_size and in_channels, or feed images of that shape"
            )
        z = self.pos_drop(self.patch_embed(self.patchify(x)) + self.pos_embed)
        for block in self.blocks:
            z = block(z)
        out = self.unpatchify(self.head(self.norm(z)))
        return x + out if self.residual else out


def relative_l2_loss(pred: torch.Tensor, target: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Mean over samples of ||pred_b - target_b||_2 / ||target_b||_2.

    Norms run over everything but the leading batch dim (all channels and pixels).
    ``eps`` guards an all-zero target.
    """
    if pred.shape != target.shape:
        raise ModelInputError(
            f"shape mismatch: pred {tuple(pred.shape)} vs target {tuple(target.shape)}: give "
            f"each sample a target of the model output's shape"
        )
    diff = (pred - target).flatten(1).norm(dim=1)
    ref = target.flatten(1).norm(dim=1).clamp_min(eps)
    return (diff / ref).mean()


def flops_per_sample(model_or_cfg: ViTForecaster | Mapping[str, Any]) -> float:
    """Training FLOPs (forward + backward) for one sample, the standard estimate

        FLOPs = 6 * P * T  +  12 * L * T^2 * D

    with P the parameters used in per-token matmuls (every parameter except the
    position embedding, which is only added), T = (H/p)(W/p) tokens, L = depth and
    D = embed_dim. 6 P T: each weight does a multiply-add (2 FLOPs) per token in
    the forward pass and twice that in the backward (grads of inputs and weights).
    12 L T^2 D: per layer, Q K^T and softmax(.) V are each 2 T^2 D forward FLOPs,
    times 3 for forward + backward. Norms, GELU, softmax and biases are ignored.

    Accepts a model or the keyword arguments of :class:`ViTForecaster` (missing
    keys take the defaults; the count is exact via a model on the meta device).
    """
    if isinstance(model_or_cfg, ViTForecaster):
        model = model_or_cfg
    elif isinstance(model_or_cfg, Mapping):
        with torch.device("meta"):  # shapes only, no memory, no init cost
            model = ViTForecaster(**dict(model_or_cfg))
    else:
        raise TypeError(f"expected ViTForecaster or a mapping, got {type(model_or_cfg).__name__}")
    params = sum(p.numel() for n, p in model.named_parameters() if n != "pos_embed")
    tokens = model.num_patches
    return float(6 * params * tokens + 12 * model.depth * tokens**2 * model.embed_dim)
