"""Mixed precision: bf16/fp16 compute, fp32 master weights and reductions, fp16 loss scaling.

`parallel.precision` = fp32 | bf16 | fp16. In bf16 and fp16:

  master weights   stay fp32: the optimizer steps fp32 parameters (ZeRO-1/2 and plain data
                   parallelism: the model's own parameters; ZeRO-3: FSDP2's fp32 shards, with the
                   gathered copies in the compute dtype per FSDP2's `MixedPrecisionPolicy`)
  compute          `torch.autocast` around the forward pass: matrix multiplies, convolutions and
                   attention run in the compute dtype
  exceptions       norm layers (LayerNorm, GroupNorm, RMSNorm, batch/instance norms) run in fp32:
                   `keep_norms_fp32` gives each a forward pre-hook casting its input to fp32, and
                   their fp32 weights then keep the op in fp32 on every device (on CPU, autocast
                   alone would run layer_norm in bf16). Losses are computed by the Trainer outside
                   autocast on `output.float()`.
  reductions       gradients are fp32 (autocast differentiates into the fp32 parameters; FSDP2 is
                   given `reduce_dtype=float32`), so every gradient collective is fp32.
  fp16 only        dynamic loss scaling (`DynamicLossScaler`): the loss is multiplied by a power
                   of two before backward, gradients are unscaled before clipping, and a step
                   whose global gradient norm is not finite is skipped and the scale halved; after
                   `growth_interval` clean steps it doubles. bf16 has fp32's exponent range and
                   needs no scaling.

`measured_matmul_flops` times a square matrix multiply in a given dtype: the denominator of MFU
as "model FLOPs per second over this device's measured matmul rate".
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Module types whose forward runs in fp32 under mixed precision (all norm layers).
NORM_TYPES: tuple[type, ...] = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase,
                                nn.LocalResponseNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in DTYPES:
        raise ConfigError(f"parallel.precision={precision!r} is not one of {', '.join(DTYPES)}.")
    return DTYPES[precision]


def is_norm(module: nn.Module) -> bool:
    return isinstance(module, NORM_TYPES)


def _fp32_inputs(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


def keep_norms_fp32(model: nn.Module) -> int:
    """Make every norm layer of `model` compute in fp32 under autocast; returns how many.

    Idempotent: a norm that already casts its inputs is left alone. Call it before compiling.
    """
    count = 0
    for module in model.modules():
        if is_norm(module):
            if not any(h is _fp32_inputs for h in module._forward_pre_hooks.values()):
                module.register_forward_pre_hook(_fp32_inputs)
            count += 1
    return count


class Precision:
    """The compute precision of a run: an autocast context and, for fp16, a loss scaler."""

    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.dtype = compute_dtype(name)
        self.device_type = torch.device(device).type
        if self.dtype == torch.bfloat16 and self.device_type == "cuda" and \
                not torch.cuda.is_bf16_supported():
            raise ConfigError("parallel.precision='bf16' needs a GPU with bf16 support (Ampere or "
                              "newer); use 'fp16' on this device.")

    @property
    def mixed(self) -> bool:
        return self.dtype != torch.float32

    def autocast(self):
        """Context for the forward pass (not the loss, not backward)."""
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.mixed)

    def loss_scaler(self) -> "DynamicLossScaler":
        return DynamicLossScaler(enabled=self.dtype == torch.float16)


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al., 2018), agreed on by every rank.

    Every rank reaches the same verdict without a collective of its own: the finiteness test is
    the global gradient norm that clipping computes anyway (`parallel.gradnorm`), which is the
    same number on every rank. Scales are powers of two, so scaling and unscaling are exact.
    """

    def __init__(self, enabled: bool = True, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 2.0 ** -14):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params) -> None:
        if not self.enabled:
            return
        inv = 1.0 / self.scale
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inv)

    def update(self, grads_finite: bool) -> bool:
        """Record one step's verdict; True if the optimizer should step."""
        if not self.enabled:
            return grads_finite
        if not grads_finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            if self.scale < self.min_scale:
                raise FloatingPointError(
                    f"fp16 loss scale fell below {self.min_scale:g} after {self.skipped_steps} "
                    "skipped steps: the gradients are not finite even unscaled. Use "
                    "parallel.precision='bf16' or 'fp32', lower optim.lr, or set "
                    "train.clip_grad_norm.")
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def measured_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32,
                          n: int | None = None, seconds: float = 0.1) -> float:
    """FLOP/s of an n×n by n×n matrix multiply in `dtype` on `device`, median of repeats.

    The denominator for MFU: what this device sustains on the op that dominates the model,
    measured rather than taken from a datasheet. n grows from 256 by doubling up to `n`
    (default 8192 on a GPU, 1024 on a CPU) while one multiply takes under a twentieth of
    `seconds`: a dtype the device has no fast kernel for (float16 on most CPUs: 1 GFLOP/s here,
    where a 1024² multiply took 2 s) is measured in about `seconds`, not in many.
    """
    device = torch.device(device)
    n_max = n or (8192 if device.type == "cuda" else 1024)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def operands(size):
        return (torch.randn(size, size, device=device).to(dtype),
                torch.randn(size, size, device=device).to(dtype))

    n = min(256, n_max)
    a, b = operands(n)
    a @ b  # warm-up
    while True:
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        if n >= n_max or time.perf_counter() - t0 >= seconds / 20:
            break
        n = min(2 * n, n_max)
        a, b = operands(n)
        a @ b  # warm-up at the new size
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < seconds and len(times) < 50):
        t0 = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * n ** 3 / times[len(times) // 2]
