"""K-FAC's factor statistics and the arithmetic on them: a convolution's input patches, the
preconditioned layers and the sizes of their factors, the dtype of the factor products, damped
inverses. The formulas are in `optim.kfac`'s docstring.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.spatial.conv import SpatialConv

MATMUL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fast_bfloat16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 faster than float32: a CUDA GPU of compute
    capability 8.0 or later (tensor cores), a CPU with AVX512-BF16 or AMX (measured on such a
    2-core CPU: a 1,024² bfloat16 matmul at 211 GFLOP/s against float32's 94; without them
    bfloat16 is emulated and slower)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    if device.type != "cpu":
        return False
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith("flags")), "").split()
    except OSError:   # not Linux: no way to tell, the safe choice
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_matmul_dtype(name: str, device: torch.device) -> torch.dtype:
    """`matmul_dtype` as a dtype; "auto": bfloat16 where `fast_bfloat16(device)`, else float32."""
    if name == "auto":
        return torch.bfloat16 if fast_bfloat16(device) else torch.float32
    return MATMUL_DTYPES[name]


# ---------------------------------------------------------------------- factor statistics
def conv_patches(x: torch.Tensor, kernel, stride, dilation, pad_lo, pad_hi,
                 cap: int = 0) -> torch.Tensor:
    """The rows (samples × positions, C·K) of a convolution's input patches, in the order of
    `weight.view(out, -1)`'s columns (1-3 spatial dims; zero padding lo/hi per dim). With
    `cap` > 0 only every ⌈T/cap⌉-th of a sample's T output positions (in flat order), picked
    from the unfolded view so only those patches are copied."""
    nd = len(kernel)
    pads = [p for lo, hi in zip(reversed(pad_lo), reversed(pad_hi)) for p in (lo, hi)]
    if any(pads):
        x = F.pad(x, pads)
    for i in range(nd):
        x = x.unfold(2 + i, dilation[i] * (kernel[i] - 1) + 1, stride[i])
    if any(d > 1 for d in dilation):
        x = x[(Ellipsis, *(slice(None, None, d) for d in dilation))]
    c_k = x.shape[1] * math.prod(kernel)
    grid = x.shape[2:2 + nd]
    positions = math.prod(grid)
    if 0 < cap < positions:   # the same strided positions of every sample
        flat = torch.arange(0, positions, -(-positions // cap), device=x.device)
        index = torch.unravel_index(flat, grid)
        x = x[(slice(None), slice(None), *index)]           # (N, C, P, k1..knd)
        return x.movedim(1, 2).reshape(-1, c_k)
    # (N, C, o1..ond, k1..knd) -> (N, o1..ond, C, k1..knd)
    order = [0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd)]
    return x.permute(order).reshape(-1, c_k)


def damped_inverse(factor: torch.Tensor, damping: float) -> torch.Tensor:
    """(F + damping·I)⁻¹ of a symmetric positive semi-definite factor, by Cholesky (n³/3 flops,
    against eigh's ~9n³), on the factor's worker in the factor's precision (KAISA's default:
    the damping bounds the condition number, and float32 halves the cost of the widest factor),
    again in float64 if float32 rounding leaves it not positive definite."""
    eye = torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
    L, info = torch.linalg.cholesky_ex(factor + damping * eye)
    if int(info) == 0:
        return torch.cholesky_inverse(L)
    f = factor.double() + damping * eye.double()
    return torch.cholesky_inverse(torch.linalg.cholesky(f)).to(factor.dtype)


class KFACLayer:
    """One preconditioned layer: its parameters, sizes and the statistics of the current step."""

    def __init__(self, name: str, module: nn.Module, max_dim: int = 0):
        self.name, self.module = name, module
        self.weight, self.bias = module.weight, module.bias
        self.out = self.weight.shape[0]
        self.a = self.weight[0].numel() + (self.bias is not None)
        self.g = self.out
        self.conv = not isinstance(module, nn.Linear)
        # a factor wider than max_dim is kept diagonal (its vector of diagonal entries)
        self.diag = {"A": 0 < max_dim < self.a, "G": 0 < max_dim < self.g}
        self.reset()

    def width(self, k: str) -> int:
        return self.a if k == "A" else self.g

    def factor_shape(self, k: str) -> tuple[int, ...]:
        n = self.width(k)
        return (n,) if self.diag[k] else (n, n)

    def factor_numel(self, k: str) -> int:
        """Floats of the factor (and of its eigenvectors or inverse, when it has them)."""
        return math.prod(self.factor_shape(k))

    def reset(self) -> None:
        self.A_sum = self.G_sum = None
        self.a_count = self.g_count = 0.0

    def factor_cost(self, k: str) -> int:
        """The inversion's flops, up to a constant: n³ for a full factor, n for a diagonal one."""
        n = self.width(k)
        return n if self.diag[k] else n ** 3

    def state_numel(self) -> int:
        """Floats of this layer's second-order state: per full factor the running factor, its
        eigenvectors (or inverse) and eigenvalues (2n² + n); per diagonal factor the running
        diagonal and its eigenvalues (or inverse diagonal) (2n)."""
        return sum(2 * self.factor_numel(k) + (0 if self.diag[k] else self.width(k))
                   for k in ("A", "G"))


def preconditionable(module: nn.Module) -> bool:
    """Whether K-FAC preconditions this layer: Linear, and ungrouped Conv1-3d (spatial too)."""
    if isinstance(module, nn.Linear):
        return True
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, SpatialConv)):
        return module.groups == 1
    return False
