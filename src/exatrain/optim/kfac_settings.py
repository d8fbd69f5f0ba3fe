"""K-FAC's settings, their defaults (the one home of them: the config's `optim.kfac_*` keys take
theirs from here), and the plans K-FAC runs under.

Imports no torch: the config reads the defaults when it is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError

MATMUL_DTYPE_NAMES = ("auto", "float32", "bfloat16")


def check_plan(plan, where: str = "") -> None:
    """Refuse, by name, an axis K-FAC does not support yet (before any work starts)."""
    degrees = {"trainer": plan.trainer, "pipe": plan.pipe, "shard": plan.shard,
               "tensor": math.prod(plan.tensor) if isinstance(plan.tensor, tuple) else plan.tensor}
    bad = {k: v for k, v in degrees.items() if v > 1}
    if bad:
        names = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ConfigError(
            f"{where}optim.name='kfac' supports the data and space axes only; the plan has {names}. "
            f"Set {' and '.join(f'plan.{k}=1' for k in bad)} (put those ranks on plan.data), or "
            f"use optim.name='adamw' or 'sgd'.")


@dataclass(frozen=True)
class KFACSettings:
    """K-FAC's settings; the config keys `optim.kfac_*` of the same names.

    Attributes:
        damping: λ, added to the factors' eigenvalues (Tikhonov damping).
        factor_decay: ξ of the factors' running average.
        factor_every: steps between factor updates.
        inverse_every: steps between eigendecompositions (or inverses).
        kl_clip: κ of the KL clip of the preconditioned update.
        grad_worker_fraction: f from 1/W (memory-optimal) to 1 (communication-optimal).
        inverse: `"eigen"` or `"cholesky"` (damped inverses, for wide factors).
        factor_positions: a convolution's A from at most this many positions per sample (0: all).
        max_factor_dim: a factor wider than this is kept diagonal (0: all full).
        matmul_dtype: `"float32"` or `"bfloat16"` for the factor and preconditioning products.
    """

    # The defaults are the recipe that reached the default CosmoFlow job's target fastest, in
    # 0.75x tuned AdamW's seconds over nine seeds (docs/how-to/kfac.md, "Does it pay?").
    damping: float = 0.03           # 0.1 preconditioned too weakly there; 1e-3 saturates its head
    factor_decay: float = 0.95
    factor_every: int = 2           # factors every other step: half their cost, the same curve
    inverse_every: int = 10
    kl_clip: float = 1e-3
    grad_worker_fraction: float = 1.0
    inverse: str = "cholesky"       # eigen | cholesky: damped inverses, n³/3 flops against eigh's
                                    # ~9n³ (3D convolutions' factors are thousands wide)
    factor_positions: int = 64      # a convolution's A from at most this many output positions
                                    # per sample (strided); 0 = all
    max_factor_dim: int = 1000      # a factor wider than this is kept diagonal; 0 = all full
    matmul_dtype: str = "auto"      # auto | float32 | bfloat16: the factor products and the
                                    # preconditioning products (the state stays float32); auto =
                                    # bfloat16 where the device multiplies it fast

    def check(self) -> None:
        """Refuse settings out of range, naming them all (before any work starts)."""
        s = self
        if not 0 < s.factor_decay < 1 or s.damping <= 0 or s.kl_clip <= 0 \
                or s.factor_every < 1 or s.inverse_every < 1 or s.factor_positions < 0 \
                or s.inverse not in ("eigen", "cholesky") or s.max_factor_dim < 0 \
                or s.matmul_dtype not in MATMUL_DTYPE_NAMES:
            raise ConfigError(f"K-FAC settings out of range: {s}; need 0 < factor_decay < 1, "
                              "damping > 0, kl_clip > 0, factor_every ≥ 1, inverse_every ≥ 1, "
                              "factor_positions ≥ 0, inverse 'eigen' or 'cholesky', "
                              "max_factor_dim ≥ 0, matmul_dtype 'auto', 'float32' or "
                              "'bfloat16'.")

    @classmethod
    def from_options(cls, o) -> "KFACSettings":
        return cls(o.kfac_damping, o.kfac_factor_decay, o.kfac_factor_every,
                   o.kfac_inverse_every, o.kfac_kl_clip, o.kfac_grad_worker_fraction,
                   o.kfac_inverse, o.kfac_factor_positions, o.kfac_max_factor_dim,
                   o.kfac_matmul_dtype)


DEFAULTS = KFACSettings()   # what `optim.kfac_*` defaults to
