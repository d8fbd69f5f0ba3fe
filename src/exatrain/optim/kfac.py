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

The work is split over the replica ranks as KAISA does (Pauloski et al., SC21): the grid of grad
workers, the three communication steps and their bytes per rank are in `optim.kfac_assign`; the
settings and the plans K-FAC runs under in `optim.kfac_settings`; factor statistics (patches,
the matmul dtype, damped inverses) in `optim.kfac_factors`.

A factor wider than `max_factor_dim` is kept diagonal (Distributed Shampoo's fallback for wide
dimensions): only its diagonal is summed, all-reduced (a floats, not a²) and inverted
(elementwise), and its eigenvectors are the identity, so it costs a in place of a² (and of a² + a
in the eigen broadcast), 2a in place of 2a² + a in the state held per rank (`optim.kfac_assign`), and applying it costs g·a
flops instead of g·a². A 3D convolution's A is C_in·27 wide: in the default CosmoFlow the last
two (1,728 and 3,456 wide) took ~90 % of the preconditioning flops.

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

import torch
from torch import nn

from ..comm import all_reduce, broadcast
from ..mesh import Mesh
from ..parallel.branches import SplitBranches
from ..parallel.data import UnusedParameterError, unwrap
from ..parallel.spatial.conv import SpatialConv
from ..errors import ConfigError
from .kfac_assign import WorkerGrid
from .kfac_factors import KFACLayer, conv_patches, damped_inverse, preconditionable, \
    resolve_matmul_dtype
from .kfac_settings import KFACSettings, check_plan

__all__ = ["KFAC", "KFACSettings", "check_model", "check_plan"]


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
        s.check()
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
        self.space_size = mesh.axis("space").size if mesh is not None else 1
        self.device = mesh.device if mesh is not None else next(module.parameters()).device
        trainable = {id(p) for g in inner.param_groups for p in g["params"]}
        self.layers = [KFACLayer(n, m, s.max_factor_dim) for n, m in module.named_modules()
                       if preconditionable(m) and id(m.weight) in trainable
                       and (m.bias is None or id(m.bias) in trainable)]
        # the grid: R rows of n grad workers (creating its groups is collective)
        self.grid = WorkerGrid(mesh, [(l.factor_cost("A"), l.factor_cost("G"))
                                      for l in self.layers], s.grad_worker_fraction)
        self.steps = 0
        self.decompositions = 0   # factor refreshes (eigen or Cholesky) this process ran
        self.kfac_state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            entry = {"kfac_steps": torch.zeros((), dtype=torch.int64)}
            if self.grid.holds(i):
                for k in ("A", "G"):
                    shape = layer.factor_shape(k)
                    entry[f"kfac_{k}"] = torch.zeros(shape, device=self.device)
                    if not layer.diag[k]:   # a diagonal factor's eigenvectors are the identity
                        entry[f"kfac_Q{k}"] = torch.zeros(shape, device=self.device)
                    entry[f"kfac_d{k}"] = torch.zeros(shape[0], device=self.device)
            self.kfac_state[layer.weight] = entry
        self._arm()
        self._handles = [l.module.register_forward_hook(self._forward_hook(l)) for l in self.layers]

    def memory_bytes(self) -> int:
        """Second-order state this rank holds (counted from its tensors)."""
        return sum(t.numel() * t.element_size() for e in self.kfac_state.values()
                   for k, t in e.items() if k != "kfac_steps")

    def memory_formula(self) -> int:
        """4 · Σ_{ℓ in my row} (2a² + a + 2g² + g), the module doc's formula (2a for a diagonal
        A, 2g for a diagonal G)."""
        return sum(4 * l.state_numel() for i, l in enumerate(self.layers) if self.grid.holds(i))

    # ------------------------------------------------------------------ statistics (hooks)
    def _forward_hook(self, layer: KFACLayer):
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

    def _grad_hook(self, layer: KFACLayer, grad: torch.Tensor, samples: int, weight: float):
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
            self.decompositions += 1
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

    def _grad_matrix(self, layer: KFACLayer) -> torch.Tensor:
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
        all_reduce(flat, self.grid.axis, tag="kfac")
        at, decay = 0, self.settings.factor_decay
        for i, l in enumerate(self.layers):
            A = flat[at:at + l.factor_numel("A")].view(l.factor_shape("A"))
            at += l.factor_numel("A")
            G = flat[at:at + l.factor_numel("G")].view(l.factor_shape("G"))
            at += l.factor_numel("G")
            a_count, g_count = flat[at:at + 2].tolist()
            at += 2
            l.reset()
            if not self.grid.holds(i):
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
            if not self.grid.holds(i):
                continue
            e = self.kfac_state[l.weight]
            for k in ("A", "G"):
                Q, d = e.get(f"kfac_Q{k}"), e[f"kfac_d{k}"]
                src = self.grid.factor_worker[(i, k)]
                if self.grid.row_axis.rank == src:
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
                        Q.copy_(damped_inverse(factor, float(d[0])))
                if self.grid.workers > 1:
                    if Q is None:
                        broadcast(d, self.grid.row_axis, src=src, tag="kfac")
                        continue
                    buf = torch.cat([Q.flatten(), d])
                    broadcast(buf, self.grid.row_axis, src=src, tag="kfac")
                    Q.copy_(buf[:Q.numel()].view_as(Q))
                    d.copy_(buf[Q.numel():])

    def _precondition(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Step 3: the row's workers precondition; V broadcast down each column."""
        out = []
        lam = self.settings.damping
        for i, (l, grad) in enumerate(zip(self.layers, grads)):
            if self.grid.holds(i):
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
            if self.grid.rows > 1:
                broadcast(v, self.grid.col_axis, src=self.grid.layer_row[i], tag="kfac")
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
