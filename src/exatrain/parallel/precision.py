"""Mixed precision: bf16/fp16 compute, fp32 master weights and reductions, fp16 loss scaling.

`parallel.precision` = fp32 | bf16 | fp16 | fp8 (fp8: bf16 as below, with the Linear layers'
matrix products in float8; `parallel/float8.py`). In bf16 and fp16:

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
"""

from __future__ import annotations


import torch
from torch import nn

from ..errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}  # fp8: float8 Linears (parallel/float8.py), the rest in bf16

# Module types whose forward runs in fp32 under mixed precision (all norm layers).
NORM_TYPES: tuple[type, ...] = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase,
                                nn.LocalResponseNorm) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in DTYPES:
        raise ConfigError(f"parallel.precision={precision!r} is not one of {', '.join(DTYPES)}.")
    return DTYPES[precision]


def is_norm(module: nn.Module) -> bool:
    """A norm layer: torch's, or one of exatrain's distributed BatchNorms (`is_norm_layer`)."""
    return isinstance(module, NORM_TYPES) or getattr(module, "is_norm_layer", False)


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

    def autocast(self, cache: bool = True):
        """Context for the forward pass (not the loss, not backward). `cache`: keep each
        weight's low-precision copy for the region (off where a CUDA graph records the step)."""
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.mixed,
                              cache_enabled=cache)

    def loss_scaler(self, device: torch.device | str = "cpu") -> "DynamicLossScaler":
        return DynamicLossScaler(enabled=self.dtype == torch.float16, device=device)


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al., 2018), agreed on by every rank, kept on
    the device.

    Every rank reaches the same verdict without a collective of its own: the finiteness test is
    the global gradient norm that the Trainer computes anyway (`optim.gradnorm`), which is the
    same number on every rank. Scales are powers of two, so scaling and unscaling are exact.

    The scale, the count of clean steps and the count of skipped steps are device tensors, and
    `update(found_inf)` with a device tensor changes them with torch's own kernel
    (`torch._amp_update_scale_`, what `torch.amp.GradScaler` uses): a step never waits for the
    host to decide. `update(bool)` (a verdict already read on the host, True where not finite)
    returns whether the optimizer should step. `scale`, `good_steps` and `skipped_steps` read
    the device (at log steps); `check()` refuses a scale that fell below `min_scale`.
    """

    def __init__(self, enabled: bool = True, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 2.0 ** -14,
                 device: torch.device | str = "cpu"):
        self.enabled = enabled
        self.device = torch.device(device)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self._scale = torch.full((), float(init_scale) if enabled else 1.0, dtype=torch.float32,
                                 device=self.device)
        self._good = torch.zeros((), dtype=torch.int32, device=self.device)
        self._skipped = torch.zeros((), dtype=torch.float32, device=self.device)

    # the state, read on the host (a device read: at log steps and checkpoints only)
    @property
    def scale(self) -> float:
        return float(self._scale)

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale.fill_(float(value))

    @property
    def good_steps(self) -> int:
        return int(self._good)

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale.to(loss.device) if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params) -> None:
        if not self.enabled:
            return
        grads = [p.grad for p in params if p.grad is not None]
        by_device: dict = {}
        for g in grads:
            by_device.setdefault((g.device, g.dtype, type(g)), []).append(g)
        inverse = self._scale.double().reciprocal().float()
        for (device, dtype, kind), group in by_device.items():
            if kind is torch.Tensor:
                torch._foreach_mul_(group, inverse.to(device=device, dtype=dtype))
            else:  # DTensor gradients (FSDP2): one at a time, each with its own placement
                for g in group:
                    g.mul_(inverse.item())

    def update(self, found_inf):
        """Record one step's verdict, `found_inf`: 1 (True) where the gradients were not finite,
        as `optim.gradnorm.found_nonfinite` and the fused optimizers' `found_inf` say it. A
        device tensor is read on the device and returns None; a host bool (the verdict already
        read) returns whether the optimizer should step, and refuses a scale below `min_scale`
        at once."""
        host = isinstance(found_inf, bool)
        if not self.enabled:
            return (not found_inf) if host else None
        flag = torch.tensor(1.0 if found_inf else 0.0, device=self.device) if host else \
            found_inf.to(device=self.device, dtype=torch.float32)
        torch._amp_update_scale_(self._scale, self._good, flag, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)
        self._skipped.add_(flag)
        if host:
            if found_inf:
                self.check()
            return not found_inf
        return None

    def check(self) -> None:
        """Refuse a scale that fell below `min_scale` (reads the device)."""
        if self.enabled and self.scale < self.min_scale:
            raise FloatingPointError(
                f"fp16 loss scale fell below {self.min_scale:g} after {self.skipped_steps} "
                "skipped steps: the gradients are not finite even unscaled. Use "
                "parallel.precision='bf16' or 'fp32', lower optim.lr, or set "
                "train.clip_grad_norm.")

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good.fill_(int(state["good_steps"]))
        self._skipped.fill_(int(state.get("skipped_steps", 0)))
