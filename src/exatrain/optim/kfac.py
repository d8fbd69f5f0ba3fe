"""Distributed K-FAC (KAISA): Kronecker-factored preconditioning with its work split over ranks.

For a Linear or Conv layer with weight W (out × in·K, plus a bias column) K-FAC approximates the
Fisher block of W by A ⊗ G, with A = E[a aᵀ] over the layer's input rows a (for a convolution
the unfolded input patches, "KFC" expand: one row per output position and sample, Grosse &
Martens 2016; a column of ones for the bias) and G = E[(B·g)(B·g)ᵀ] over the rows g of the
gradient of the loss w.r.t. the layer's output (B: the samples the local loss averages over, so
B·g is the per-sample gradient whatever the data split). A is a mean over rows, G a sum over a
sample's output positions averaged over samples (so A ⊗ G is KFC's T·E[a aᵀ] ⊗ E[g gᵀ] for T
positions per sample; for a Linear layer T = 1). With `factor_positions = P` a convolution's A
is the mean over P strided output positions of each sample only (the same positions of every
sample, so data-parallel runs still equal serial; under `space` the positions are each block's):
A's cost falls by T/P, where a 3D convolution's A (C_in·27 wide) costs more than its forward.
Both are kept as
running averages A ← ξ·A + (1-ξ)·A_step (ξ = `factor_decay`, the first update sets them), every
`factor_every` steps. Every `inverse_every` steps each factor is eigendecomposed,
A = Q_A diag(d_A) Q_Aᵀ (same for G), and every step the gradient matrix ∇ is preconditioned as

    V = Q_G [ (Q_Gᵀ ∇ Q_A) / (d_G d_Aᵀ + λ) ] Q_Aᵀ          λ = `damping`

or, with `inverse = "cholesky"` (KAISA's "inverse" method, for the wide factors of 3D
convolutions whose eigendecomposition dominates a step: n³/3 flops against ~9n³), the damped
inverses by Cholesky with factored Tikhonov damping, V = (G + √λ/π·I)⁻¹ ∇ (A + π√λ·I)⁻¹,
π = sqrt((tr A / a) / (tr G / g)) (Martens & Grosse 2015, §6.3), stored in the Q slots (the d
slots hold the two dampings, so the state and the bytes are the same as eigen's);
then scaled by ν = min(1, sqrt(κ / (η² Σ_layers ⟨V, ∇⟩))) (KL clipping, κ = `kl_clip`, η the
learning rate) and handed to the first-order optimizer (SGD or AdamW) in place of ∇. Layers that
are not Linear / Conv1-3d (norms, grouped convolutions) keep their plain gradient.

Distribution (Pauloski et al., KAISA, SC21). The replica group is the `data` × `space` ranks
(W of them); every other axis is refused by name (`check_plan`). Ranks are laid out as a grid of
R = 1/f rows × n = f·W columns, f = `grad_worker_fraction` ∈ [1/W, 1]:

  1. factors   every rank sums a aᵀ and g gᵀ over its own rows (its samples under `data`, its
               spatial block's positions under `space`; a layer that runs replicated over the S
               spatial ranks weighs its rows by 1/S), and ONE all-reduce over the replica group
               sums all layers' factors and row counts (tag "kfac").
  2. eigen     each layer belongs to one row of grad workers, chosen by greedy
               longest-processing-time over the rows on cost d_A³ + d_G³; inside the row each of
               its two factors is eigendecomposed by one member (LPT again), which broadcasts
               Q and d to the row (tag "kfac").
  3. gradient  the row's members precondition the layer's gradient; each member broadcasts V
               down its column, so every other rank receives V from exactly one worker
               (tag "kfac").

f = 1/W (R = W rows of one rank) is memory-optimal: one rank holds each layer's second-order
state, and every preconditioned gradient is broadcast every step. f = 1 (one row) is
communication-optimal: every rank holds everything and step 3 sends nothing.

Bytes per rank (ledger payload convention: all-reduce and broadcast count the tensor once), with
a = d_A, g = d_G of layer ℓ and 4-byte floats:

  factors (step 1, every `factor_every`)    4 · (Σ_ℓ (a² + g²) + 2L)       all-reduce, all ranks
  eigen   (step 2, every `inverse_every`)   4 · Σ_{ℓ in my row} (a² + a + g² + g)   when n > 1
  gradient (step 3, every step)             4 · Σ_ℓ g·a                    when R > 1

(L layers; the 2L are each layer's two row counts, sent as floats in the same all-reduce.)

A factor wider than `max_factor_dim` is kept diagonal (Distributed Shampoo's fallback for wide
dimensions): only its diagonal is summed, all-reduced (a floats, not a²) and inverted
(elementwise), and its eigenvectors are the identity, so it costs a in place of a² (and of a² + a
in the eigen broadcast), 2a in place of 2a² + a in the state below, and applying it costs g·a
flops instead of g·a². A 3D convolution's A is C_in·27 wide: in the default CosmoFlow the last
two (1,728 and 3,456 wide) took ~90 % of the preconditioning flops.

Second-order state held per rank (`memory_bytes`; the persistent tensors: running factors,
eigenvectors, eigenvalues of the layers of its row):

  4 · Σ_{ℓ in my row} (2a² + a + 2g² + g)          (2a for a diagonal A, 2g for a diagonal G)

so the sum over ranks is n times the serial state, and each rank holds about f of it.

The state lives in the optimizer's state dict under the weight's name (keys "kfac_A", "kfac_G",
"kfac_QA", "kfac_dA", "kfac_QG", "kfac_dG" on the ranks that hold them, "kfac_steps" on all), so
checkpoints carry it and a resume continues bit-identically.

With `matmul_dtype = "bfloat16"` (the default `"auto"` picks it where the device multiplies
bfloat16 fast: a GPU of compute capability 8.0 or later, a CPU with AVX512-BF16 or AMX) the
factor products (aᵀa, gᵀg) and the preconditioning
products take bfloat16 operands (float32 accumulation in the kernel, float32 results); the
running factors, inverses, eigendecompositions and the update stay float32. Bytes and state are
unchanged.

Limits: activation checkpointing re-runs forward hooks (factors would count twice) and is
refused; fp16 loss scaling is not undone in G (use bf16 or fp32); branches split over the data
ranks (`parallel.branches = "data"`) run each branch on one rank, so its layers have no factors
on the others: refused when the optimizer is built (`check_model`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..comm import Axis, all_reduce, broadcast
from ..mesh import Mesh
from ..parallel.branches import SplitBranches
from ..parallel.data import UnusedParameterError, unwrap
from ..parallel.spatial.layers import SpatialConv
from ..errors import ConfigError

UNSUPPORTED_AXES = ("trainer", "pipe", "shard", "tensor")
STATE_KEYS = ("kfac_A", "kfac_G", "kfac_QA", "kfac_dA", "kfac_QG", "kfac_dG")
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


def check_model(module: nn.Module, where: str = "") -> None:
    """Refuse, by name, a model whose layers do not run on every replica rank: branches split
    over the data ranks (`parallel.branches = 'data'`) run each branch on its owner only, so the
    other ranks would have no factors of its layers to all-reduce."""
    split = [name for name, m in module.named_modules()
             if isinstance(m, SplitBranches) and m.axis.size > 1]
    if split:
        raise ConfigError(
            f"{where}optim.name='kfac' with parallel.branches='data': the branches of "
            f"{', '.join(repr(n) for n in split)} run on their owner ranks only, and K-FAC needs "
            f"every preconditioned layer on every data rank. Set parallel.branches='none' (K-FAC "
            f"then preconditions the branches under plain data parallelism), or use "
            f"optim.name='adamw' or 'sgd' with the branches split.")


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

    @classmethod
    def from_options(cls, o) -> "KFACSettings":
        return cls(o.kfac_damping, o.kfac_factor_decay, o.kfac_factor_every,
                   o.kfac_inverse_every, o.kfac_kl_clip, o.kfac_grad_worker_fraction,
                   o.kfac_inverse, o.kfac_factor_positions, o.kfac_max_factor_dim,
                   o.kfac_matmul_dtype)


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


def _damped_inverse(factor: torch.Tensor, damping: float) -> torch.Tensor:
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


class _Layer:
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
        n = self.width(k)
        return n if self.diag[k] else n ** 3

    @property
    def cost(self) -> int:
        return self.factor_cost("A") + self.factor_cost("G")

    def state_numel(self) -> int:
        """Floats of this layer's second-order state: per full factor the running factor, its
        eigenvectors (or inverse) and eigenvalues (2n² + n); per diagonal factor the running
        diagonal and its eigenvalues (or inverse diagonal) (2n)."""
        return sum(2 * self.factor_numel(k) + (0 if self.diag[k] else self.width(k))
                   for k in ("A", "G"))


def _supported(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, SpatialConv)):
        return module.groups == 1
    return False


def lpt(costs: list[float], bins: int) -> list[int]:
    """Greedy longest-processing-time: item i -> bin, largest items first to the least loaded
    bin (ties: the lowest bin, so every rank computes the same assignment)."""
    load = [0.0] * bins
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        b = min(range(bins), key=lambda j: (load[j], j))
        out[i] = b
        load[b] += costs[i]
    return out


# ---------------------------------------------------------------------- the optimizer
class KFAC(torch.optim.Optimizer):
    """K-FAC preconditioning in front of a first-order `inner` optimizer (see the module doc).

    It is the optimizer the Trainer steps: `param_groups` and per-parameter state are the inner
    optimizer's (so learning-rate schedules, clipping and DCP checkpoints work unchanged), with
    K-FAC's state added to the weights' entries of the state dict.

        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = KFAC(model, inner)                 # one process; or KFAC(model, inner, mesh)

    Args:
        model: the model whose Linear and Conv layers are preconditioned.
        inner: the first-order optimizer over the model's parameters.
        mesh: the Mesh to split the work over (its data and space ranks); None on one process.
        settings: a `KFACSettings`.
        grad_accum: micro-batches accumulated per step (their factors are averaged).
    """

    def __init__(self, model: nn.Module, inner: torch.optim.Optimizer, mesh: Mesh | None = None,
                 settings: KFACSettings = KFACSettings(), grad_accum: int = 1):
        s = settings
        if not 0 < s.factor_decay < 1 or s.damping <= 0 or s.kl_clip <= 0 \
                or s.factor_every < 1 or s.inverse_every < 1 or s.factor_positions < 0 \
                or s.inverse not in ("eigen", "cholesky") or s.max_factor_dim < 0 \
                or s.matmul_dtype not in (*MATMUL_DTYPES, "auto"):
            raise ConfigError(f"K-FAC settings out of range: {s}; need 0 < factor_decay < 1, "
                              "damping > 0, kl_clip > 0, factor_every ≥ 1, inverse_every ≥ 1, "
                              "factor_positions ≥ 0, inverse 'eigen' or 'cholesky', "
                              "max_factor_dim ≥ 0, matmul_dtype 'auto', 'float32' or "
                              "'bfloat16'.")
        self.inner, self.settings, self.grad_accum = inner, s, grad_accum
        self.matmul_dtype = resolve_matmul_dtype(
            s.matmul_dtype, next(model.parameters()).device if mesh is None else mesh.device)
        self.defaults = inner.defaults
        module = unwrap(model)
        where = f"rank {mesh.rank}: " if mesh is not None else ""
        self.where = where   # names the rank in a refusal at a step
        if mesh is not None:
            check_plan(mesh.plan, where)
        check_model(module, where)   # before any collective: every rank refuses alike
        self.axis = self._replica_axis(mesh)
        W = self.axis.size
        self.space_size = mesh.axis("space").size if mesh is not None else 1
        self.device = mesh.device if mesh is not None else next(module.parameters()).device
        trainable = {id(p) for g in inner.param_groups for p in g["params"]}
        self.layers = [_Layer(n, m, s.max_factor_dim) for n, m in module.named_modules()
                       if _supported(m) and id(m.weight) in trainable
                       and (m.bias is None or id(m.bias) in trainable)]
        # the grid: R rows of n grad workers
        f = s.grad_worker_fraction
        n = max(1, round(f * W))
        if not 1 / W - 1e-9 <= f <= 1 or W % n:
            fractions = [k / W for k in range(1, W + 1) if W % k == 0]
            raise ConfigError(f"kfac grad_worker_fraction={f} on {W} replica ranks: it must be one "
                              f"of {fractions} (n/W with n dividing W).")
        self.workers, self.rows = n, W // n
        me = self.axis.rank
        self.my_row, self.my_col = divmod(me, n)
        self.row_axis, self.col_axis = self._grid_axes(mesh)
        # each layer's row by LPT on its eigendecomposition cost; inside the row, each factor's
        # eigendecomposition by LPT over the row's members
        self.layer_row = lpt([l.cost for l in self.layers], self.rows)
        self.factor_worker: dict[tuple[int, str], int] = {}
        for row in range(self.rows):
            mine = [i for i, r in enumerate(self.layer_row) if r == row]
            items = [(i, k) for i in mine for k in ("A", "G")]
            sizes = [self.layers[i].factor_cost(k) for i, k in items]
            for item, w in zip(items, lpt(sizes, n)):
                self.factor_worker[item] = w
        self.steps = 0
        self.kfac_state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            entry = {"kfac_steps": torch.zeros((), dtype=torch.int64)}
            if self.holds(i):
                for k in ("A", "G"):
                    shape = layer.factor_shape(k)
                    entry[f"kfac_{k}"] = torch.zeros(shape, device=self.device)
                    if not layer.diag[k]:   # a diagonal factor's eigenvectors are the identity
                        entry[f"kfac_Q{k}"] = torch.zeros(shape, device=self.device)
                    entry[f"kfac_d{k}"] = torch.zeros(shape[0], device=self.device)
            self.kfac_state[layer.weight] = entry
        self._arm()
        self._handles = [l.module.register_forward_hook(self._forward_hook(l)) for l in self.layers]

    # ------------------------------------------------------------------ layout
    @staticmethod
    def _replica_axis(mesh) -> Axis:
        if mesh is None:
            from ..comm import Ledger
            return Axis("data", 1, 0, None, Ledger(), (0,))
        return mesh.axis("data", "space")

    def _grid_axes(self, mesh) -> tuple[Axis, Axis]:
        """The row (grad workers) and column (gradient broadcast) groups of this rank; creating a
        group is collective, so every rank creates every row and every column."""
        n, R, ax = self.workers, self.rows, self.axis
        ranks = ax.global_ranks

        def groups(members_of, count, mine):
            out = None
            for k in range(count):
                members = tuple(ranks[j] for j in members_of(k))
                group = dist.new_group(list(members)) if 1 < len(members) < ax.size \
                    else (ax.group if len(members) == ax.size else None)
                if k == mine:
                    out = Axis(ax.name, len(members), members.index(ranks[ax.rank]), group,
                               ax.ledger, members)
            return out

        if ax.size == 1:
            return ax, ax
        row = groups(lambda k: range(k * n, (k + 1) * n), R, self.my_row)
        col = groups(lambda c: range(c, ax.size, n), n, self.my_col)
        return row, col

    def holds(self, i: int) -> bool:
        """Does this rank hold layer i's second-order state (is it one of its grad workers)?"""
        return self.layer_row[i] == self.my_row

    def memory_bytes(self) -> int:
        """Second-order state this rank holds (counted from its tensors)."""
        return sum(t.numel() * t.element_size() for e in self.kfac_state.values()
                   for k, t in e.items() if k != "kfac_steps")

    def memory_formula(self) -> int:
        """4 · Σ_{ℓ in my row} (2a² + a + 2g² + g), the module doc's formula (2a for a diagonal
        A, 2g for a diagonal G)."""
        return sum(4 * l.state_numel() for i, l in enumerate(self.layers) if self.holds(i))

    # ------------------------------------------------------------------ statistics (hooks)
    def _forward_hook(self, layer: _Layer):
        def hook(module, inputs, output):
            if not (self._capture and module.training and torch.is_grad_enabled()):
                return
            x = inputs[0].detach()
            # a layer that is not split over space runs replicated on its S ranks: weight 1/S
            weight = 1.0 / self.space_size
            if layer.conv:
                if isinstance(module, SpatialConv):
                    x, lo, hi, replicated = module.conv_input(x)
                    weight = weight if replicated else 1.0
                    kernel, stride, dil = module.kernel_size, module.stride, module.dilation
                else:
                    if isinstance(module.padding, str):
                        raise ConfigError(f"K-FAC: layer '{layer.name}' uses padding="
                                          f"{module.padding!r}; give the padding in numbers.")
                    if module.padding_mode != "zeros":
                        raise ConfigError(f"K-FAC: layer '{layer.name}' uses padding_mode="
                                          f"{module.padding_mode!r}; only 'zeros' is supported.")
                    lo = hi = tuple(module.padding)
                    kernel, stride, dil = module.kernel_size, module.stride, module.dilation
                rows = conv_patches(x, kernel, stride, dil, lo, hi, self.settings.factor_positions)
            else:
                rows = x.reshape(-1, x.shape[-1])
            if layer.bias is not None:
                rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], 1)
            rows = rows.float()
            A = ((rows * rows).sum(0) if layer.diag["A"] else self._gram(rows)) * weight
            layer.A_sum = A if layer.A_sum is None else layer.A_sum + A
            layer.a_count += rows.shape[0] * weight
            b = inputs[0].shape[0]
            output.register_hook(lambda g: self._grad_hook(layer, g, b, weight))
        return hook

    def _mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b in `matmul_dtype` (rounded inputs, float32 accumulation inside the kernel),
        returned in float32."""
        if self.matmul_dtype == torch.float32:
            return a @ b
        return (a.to(self.matmul_dtype) @ b.to(self.matmul_dtype)).float()

    def _gram(self, rows: torch.Tensor) -> torch.Tensor:
        """rowsᵀ rows (a factor's sum over its rows) in `matmul_dtype`, returned in float32."""
        low = rows.to(self.matmul_dtype)   # one rounded copy for both operands
        return self._mm(low.T, low)

    def _grad_hook(self, layer: _Layer, grad: torch.Tensor, samples: int, weight: float):
        g = grad.detach().float()
        g = (g.movedim(1, -1) if layer.conv else g).reshape(-1, layer.out)
        # B·g: the per-sample gradient rows, scaled after the product (B² on a g×g matrix, not B
        # on every row: the first convolution's rows are a copy as large as its activation)
        scale = (samples * self.grad_accum) ** 2 * weight
        G = ((g * g).sum(0) if layer.diag["G"] else self._gram(g)) * scale
        layer.G_sum = G if layer.G_sum is None else layer.G_sum + G
        # per sample (KFC: the sum over a sample's positions): under space each rank holds 1/S
        # of every sample's positions, and a replicated layer's rows weigh 1/S
        layer.g_count += samples / self.space_size

    # ------------------------------------------------------------------ optimizer interface
    @property
    def param_groups(self):
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.inner.param_groups = value

    @property
    def state(self):
        """The inner optimizer's state with K-FAC's entries added (empty while the inner
        optimizer has none, so DCP still creates the inner state before a load)."""
        if not self.inner.state:
            return {}
        out = {p: dict(s) for p, s in self.inner.state.items()}
        for p, entry in self.kfac_state.items():
            out[p] = {**out.get(p, {}), **entry}
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        self._arm()

    def _arm(self) -> None:
        """Capture statistics in the coming forward/backward passes if a factor update is due."""
        self._capture = self.steps % self.settings.factor_every == 0

    def capturing(self) -> bool:
        return self._capture

    @torch.no_grad()
    def step(self, closure=None):
        captured = any(l.A_sum is not None for l in self.layers)
        if not captured and self.steps % self.settings.factor_every == 0:
            # no forward ran under these hooks since the last step (e.g. DCP creating the inner
            # state with zero gradients): a plain first-order step, no collective, no count
            return self.inner.step(closure)
        s = self.settings
        if captured:
            self._update_factors()
        if self.steps % s.inverse_every == 0:
            self._eigen()
        lr = self.inner.param_groups[0]["lr"]
        grads = [self._grad_matrix(l) for l in self.layers]
        preconditioned = self._precondition(grads)
        vg = sum(float((v * g).sum()) for v, g in zip(preconditioned, grads))
        nu = min(1.0, math.sqrt(s.kl_clip / abs(vg * lr * lr))) if vg and lr else 1.0
        for layer, v in zip(self.layers, preconditioned):
            v = v * nu
            w = v[:, :layer.weight[0].numel()]
            layer.weight.grad.copy_(w.reshape(layer.weight.shape))
            if layer.bias is not None:
                layer.bias.grad.copy_(v[:, -1])
        self.steps += 1
        for entry in self.kfac_state.values():
            entry["kfac_steps"].fill_(self.steps)
        out = self.inner.step(closure)
        self._arm()
        return out

    def _grad_matrix(self, layer: _Layer) -> torch.Tensor:
        w = layer.weight.grad.reshape(layer.out, -1)
        if layer.bias is None:
            return w
        return torch.cat([w, layer.bias.grad.reshape(-1, 1)], 1)

    def _update_factors(self) -> None:
        """Step 1: one all-reduce of every layer's factor sums and row counts."""
        parts = []
        for l in self.layers:
            if l.A_sum is None or l.G_sum is None:
                # before the factors' all-reduce: every rank runs the same model, so all of them
                # refuse here alike, and none waits in a collective for the others
                raise UnusedParameterError(
                    f"{self.where}K-FAC: layer '{l.name}' ({type(l.module).__name__}) ran no "
                    f"{'forward' if l.A_sum is None else 'backward'} in step {self.steps}, but "
                    f"K-FAC preconditions every Linear and convolution the optimizer trains from "
                    f"statistics of each step's forward and backward. Use the layer in every "
                    f"step, freeze it (requires_grad_(False)) or remove it from the model, or "
                    f"train with optim.name='adamw' or 'sgd'.")
            parts += [l.A_sum.flatten(), l.G_sum.flatten(),
                      torch.tensor([l.a_count, l.g_count], device=l.A_sum.device)]
        flat = torch.cat(parts).to(self.device)
        all_reduce(flat, self.axis, tag="kfac")
        at, decay = 0, self.settings.factor_decay
        for i, l in enumerate(self.layers):
            A = flat[at:at + l.factor_numel("A")].view(l.factor_shape("A"))
            at += l.factor_numel("A")
            G = flat[at:at + l.factor_numel("G")].view(l.factor_shape("G"))
            at += l.factor_numel("G")
            a_count, g_count = flat[at:at + 2].tolist()
            at += 2
            l.reset()
            if not self.holds(i):
                continue
            e = self.kfac_state[l.weight]
            for key, new in (("kfac_A", A / a_count), ("kfac_G", G / g_count)):
                if self.steps == 0:
                    e[key].copy_(new)
                else:
                    e[key].mul_(decay).add_(new, alpha=1 - decay)

    def _eigen(self) -> None:
        """Step 2: each factor eigendecomposed by its worker, broadcast over the layer's row."""
        for i, l in enumerate(self.layers):
            if not self.holds(i):
                continue
            e = self.kfac_state[l.weight]
            for k in ("A", "G"):
                Q, d = e.get(f"kfac_Q{k}"), e[f"kfac_d{k}"]
                src = self.factor_worker[(i, k)]
                if self.row_axis.rank == src:
                    factor = e[f"kfac_{k}"]
                    if l.diag[k]:   # eigenvalues: the diagonal; inverse: 1 / (diagonal + damping)
                        d.copy_(factor.clamp_min(0) if self.settings.inverse == "eigen"
                                else 1 / (factor.clamp_min(0) + self._tikhonov(e, k)))
                    elif self.settings.inverse == "eigen":
                        vals, vecs = torch.linalg.eigh(factor.double())
                        Q.copy_(vecs)
                        d.copy_(vals.clamp_min(0))
                    else:
                        d.fill_(self._tikhonov(e, k))
                        Q.copy_(_damped_inverse(factor, float(d[0])))
                if self.workers > 1:
                    if Q is None:
                        broadcast(d, self.row_axis, src=src, tag="kfac")
                        continue
                    buf = torch.cat([Q.flatten(), d])
                    broadcast(buf, self.row_axis, src=src, tag="kfac")
                    Q.copy_(buf[:Q.numel()].view_as(Q))
                    d.copy_(buf[Q.numel():])

    def _precondition(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Step 3: the row's workers precondition; V broadcast down each column."""
        out = []
        lam = self.settings.damping
        for i, (l, grad) in enumerate(zip(self.layers, grads)):
            if self.holds(i):
                e = self.kfac_state[l.weight]
                QA, dA, QG, dG = e.get("kfac_QA"), e["kfac_dA"], e.get("kfac_QG"), e["kfac_dG"]
                if self.settings.inverse == "eigen":   # (no Q: a diagonal factor's is I)
                    v = grad if QG is None else self._mm(QG.T, grad)
                    v = v if QA is None else self._mm(v, QA)
                    v = v / (dG[:, None] * dA[None, :] + lam)
                    v = v if QG is None else self._mm(QG, v)
                    v = v if QA is None else self._mm(v, QA.T)
                else:   # QA, QG hold the damped inverses; a diagonal factor's inverse is in d
                    v = dG[:, None] * grad if QG is None else self._mm(QG, grad)
                    v = v * dA[None, :] if QA is None else self._mm(v, QA)
                v = v.contiguous()
            else:
                v = torch.empty_like(grad)
            if self.rows > 1:
                broadcast(v, self.col_axis, src=self.layer_row[i], tag="kfac")
            out.append(v)
        return out

    def _tikhonov(self, e: dict, k: str) -> float:
        """Factored Tikhonov damping (Martens & Grosse 2015, §6.3): A + π√λ·I and G + √λ/π·I
        with π = sqrt((tr A / a) / (tr G / g)), so the damping splits by the factors' scales."""
        A, G = e["kfac_A"], e["kfac_G"]
        diagonal = lambda f: f if f.dim() == 1 else f.diagonal()
        ta = float(diagonal(A).mean().clamp_min(1e-12))
        tg = float(diagonal(G).mean().clamp_min(1e-12))
        pi = math.sqrt(ta / tg)
        root = math.sqrt(self.settings.damping)
        return pi * root if k == "A" else root / pi

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        sd = self.inner.state_dict()
        index = {id(p): j for j, p in enumerate(p for g in self.inner.param_groups
                                                for p in g["params"])}
        state = dict(sd["state"])
        for p, entry in self.kfac_state.items():
            j = index[id(p)]
            state[j] = {**state.get(j, {}), **entry}
        return {**sd, "state": state}

    def load_state_dict(self, state_dict: dict) -> None:
        # keys as the saved param_groups list them (indices, or DCP's parameter names)
        saved = [k for g in state_dict["param_groups"] for k in g["params"]]
        params = dict(zip(saved, (p for g in self.inner.param_groups for p in g["params"])))
        inner_state = {}
        for j, entry in state_dict["state"].items():
            p = params[j]
            mine = self.kfac_state.get(p, {})
            for k, v in entry.items():
                if k in mine:
                    mine[k].copy_(v)
            rest = {k: v for k, v in entry.items() if not k.startswith("kfac_")}
            if rest:
                inner_state[j] = rest
        self.inner.load_state_dict({**state_dict, "state": inner_state})
        steps = {int(e["kfac_steps"]) for e in self.kfac_state.values()}
        self.steps = steps.pop() if steps else 0
        self._arm()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
