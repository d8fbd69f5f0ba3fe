"""Distributed K-FAC equals serial K-FAC, holds the second-order memory its formula says, moves
the bytes its formulas say, resumes bit-identically, and refuses the axes it does not support.

One 2-rank launch trains the tiny CosmoFlow (Conv3d, BatchNorm, Linear) four K-FAC steps
(eigendecompositions at steps 1 and 4) under data=2 and space=(1,1,2), each at
grad_worker_fraction 1/2 (memory-optimal) and 1 (communication-optimal), and resumes the first
from its step-2 checkpoint; this process runs the same four steps serially. The cut falls
between two eigendecompositions, so the resumed step 3 preconditions with the eigenvectors the
checkpoint carries (without them its preconditioned gradient is zero: dropping them from
`KFAC.state_dict` fails the resume check) and decays the checkpoint's factors. Weights after
four steps agree to 2e-5 relative at damping 0.1 (measured 2.3e-6 under data and under space):
the factor sums are added in another order, and preconditioning amplifies that rounding by up to
1/damping. Plain K-FAC moves the weights away from plain SGD's by 3.5 (relative) in these four
steps, so the comparison can fail. The serial run is the same code, so one step of a small
Conv2d + Linear net is also checked against K-FAC's formula solved in float64 apart from the code
(eigen, Cholesky, diagonal factors, KL clip off and on, SGD and AdamW bases), serially and on 2
ranks.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from exatrain.parallel import unwrap
from exatrain.train.config import ConfigError, load_config
from exatrain.optim.kfac import KFAC as KFACOptimizer, KFACSettings, check_plan
from exatrain.optim.kfac_factors import damped_inverse
from exatrain.train.run import setup
from exatrain.plan import Plan
from harness import max_rel_err_state, run_ranks

# The exact variant of the algorithm, against which every cheaper one is a named change: SGD as
# the base, eigendecompositions, every position, full factors, float32 products, factors every
# step. (The defaults, with AdamW and bfloat16 products, are tested on their own below: rounding
# to bfloat16 turns the 1e-7 differences of reordered sums into differences of 2^-8.)
EXACT = ("optim.kfac_base='sgd'", "optim.kfac_inverse='eigen'", "optim.kfac_factor_positions=0",
         "optim.kfac_max_factor_dim=0", "optim.kfac_matmul_dtype='float32'",
         "optim.kfac_factor_every=1")
KFAC = ("optim.name='kfac'", "optim.lr=0.05", "optim.kfac_inverse_every=3",
        "optim.kfac_damping=0.1", "train.steps=4", "train.eval_every=0", "schedule.warmup_steps=0",
        "train.checkpoint_every=2", "train.checkpoint_keep=3", *EXACT)


def _report(trainer, mesh) -> dict:
    opt = trainer.optimizer
    layers = opt.layers
    # a diagonal factor (wider than kfac_max_factor_dim) sends its n entries, a full one n²
    # (and n eigenvalues beside its n² eigenvectors)
    width = {"A": lambda l: l.a, "G": lambda l: l.g}
    full = lambda l, k: width[k](l) ** 2
    factor = 4 * (sum(width[k](l) if l.diag[k] else full(l, k) for l in layers for k in "AG")
                  + 2 * len(layers))
    eigen = 4 * sum(width[k](l) + (0 if l.diag[k] else full(l, k))
                    for i, l in enumerate(layers) if opt.grid.holds(i) for k in "AG")
    grad = 4 * sum(l.a * l.g for l in layers)
    return {"state": {k: v.detach().cpu().clone()
                      for k, v in unwrap(trainer.model).state_dict().items()},
            "memory": opt.memory_bytes(), "formula": opt.memory_formula(),
            "kfac_bytes": sum(mesh.ledger.bytes_by_axis(tag="kfac").values()),
            # 4 steps of factors and gradients; eigendecompositions at steps 1 and 4
            "expected_bytes": 4 * factor + 2 * eigen * (opt.grid.workers > 1)
                              + 4 * grad * (opt.grid.rows > 1),
            "run_dir": str(trainer.run_dir), "workers": opt.grid.workers, "rows": opt.grid.rows}


def kfac_runs(configs: dict, cut: str) -> dict:
    import torch.distributed as dist

    from test_spatial_training import _cut_at
    out = {}
    for name, config in configs.items():
        mesh, trainer = setup(config)
        trainer.fit()
        out[name] = _report(trainer, mesh)
        if name == "data-0.5":
            if mesh.rank == 0:
                _cut_at(Path(trainer.run_dir), Path(cut), 2)
            dist.barrier()
            mesh, trainer = setup(config, cut)
            trainer.fit()
            out["resumed"] = _report(trainer, mesh)
    mesh.close()
    return out


# the cheap variant for wide 3D convolutions: damped inverses by Cholesky, each conv's A from
# 8 strided positions per sample (the same ones on every rank, so data=2 still equals serial)
CHOLESKY = ("optim.kfac_inverse='cholesky'", "optim.kfac_factor_positions=8")
# the cheap variant for wide factors: those wider than 100 kept diagonal
DIAGONAL = ("optim.kfac_max_factor_dim=100",)


def _serial(config) -> dict:
    mesh, trainer = setup(config)
    try:
        trainer.fit()
        return _report(trainer, mesh)
    finally:
        mesh.close()


def test_kfac_distributed_equals_serial_at_every_fraction(tiny_config, tmp_path):
    configs = {f"{plan}-{f}": tiny_config(*KFAC, f"optim.kfac_grad_worker_fraction={f}", *extra)
               for plan, extra in (("data", ()), ("space", ("plan.space=[1,1,2]",)))
               for f in (0.5, 1.0)}
    configs["cholesky-data-0.5"] = tiny_config(*KFAC, *CHOLESKY,
                                               "optim.kfac_grad_worker_fraction=0.5")
    # factors wider than 100 kept diagonal: every conv's A (108-432 wide), the first dense
    # layer's G (128); the rest full
    configs["diagonal-data-0.5"] = tiny_config(*KFAC, *DIAGONAL,
                                               "optim.kfac_grad_worker_fraction=0.5")
    # (all positions: under space, factor_positions picks each block's own)
    configs["diagonal-cholesky-space-1.0"] = tiny_config(*KFAC, *DIAGONAL, CHOLESKY[0],
                                                         "plan.space=[1,1,2]")
    ranks = run_ranks(2, kfac_runs, configs, str(tmp_path / "cut"))
    serial = _serial(tiny_config(*KFAC))
    variants = {"cholesky": _serial(tiny_config(*KFAC, *CHOLESKY)),
                "diagonal-cholesky": _serial(tiny_config(*KFAC, *DIAGONAL, CHOLESKY[0])),
                "diagonal": _serial(tiny_config(*KFAC, *DIAGONAL))}
    # each variant is another optimizer: it moves the weights elsewhere than eigen's K-FAC
    for variant in variants.values():
        assert max_rel_err_state(variant["state"], serial["state"]) > 1e-3
    assert variants["diagonal"]["memory"] < serial["memory"] / 2
    total = serial["memory"]
    assert total == serial["formula"] > 0
    for name in configs:
        runs = [r[name] for r in ranks]
        variant = next((v for v in variants if name.startswith(v + "-")), None)
        reference = variants[variant] if variant else serial
        if variant:   # f = 1: every rank holds all of the serial state; f = 1/2: they split it
            copies = 2 if name.endswith("1.0") else 1
            assert sum(r["memory"] for r in runs) == copies * reference["memory"]
        for run in runs:
            assert max_rel_err_state(run["state"], reference["state"]) <= 2e-5, name
            assert run["memory"] == run["formula"]  # the module doc's formula, per rank
            assert run["kfac_bytes"] == run["expected_bytes"], name
        if variant:
            continue
        if name.endswith("0.5"):  # one grad worker per layer: the ranks split the state
            assert sum(r["memory"] for r in runs) == total
            assert all(0 < r["memory"] < total for r in runs)
            assert runs[0]["rows"] == 2 and runs[0]["workers"] == 1
        else:  # every rank a grad worker: all of it everywhere
            assert all(r["memory"] == total for r in runs)
    for r in ranks:  # resumed at step 2 (inverses of step 1 restored): the same weights at step 4
        a, b = r["data-0.5"]["state"], r["resumed"]["state"]
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_kfac_refuses_unsupported_axes(tiny_config):
    for axis, value in (("shard", 2), ("pipe", 2), ("trainer", 2), ("tensor", "[2]")):
        with pytest.raises(ConfigError, match=f"plan.{axis}=1"):
            tiny_config("optim.name='kfac'", f"plan.{axis}={value}")
    with pytest.raises(ValueError, match="tensor=4"):
        check_plan(Plan(data=2, tensor=4))
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        tiny_config("optim.name='kfac'", "parallel.activation_checkpointing='full'")



class _SmallNet(nn.Module):
    """A model written the way people write them: a padded, strided Conv2d and a Linear head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, stride=2, padding=1)
        self.head = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x):
        self.features = torch.relu(self.conv(x))
        self.features.retain_grad()
        self.logits = self.head(self.features.flatten(1))
        self.logits.retain_grad()
        return self.logits


@pytest.mark.parametrize("max_factor_dim,matmul_dtype", [(0, "float32"), (20, "float32"),
                                                          (0, "bfloat16")])
def test_kfac_factors_equal_their_definition(max_factor_dim, matmul_dtype):
    """After one step the factors are KFC's A = E[a aᵀ] over the unfolded input patches (here
    from F.unfold, not K-FAC's own patch code; a 1 appended for the bias) and G = E_samples[Σ_t
    (B·g)(B·g)ᵀ] over the output gradients of the mean loss; full and kept diagonal (wider than
    20: the conv's A, 28 wide, and the head's A, 65 wide)."""
    torch.manual_seed(0)
    model, x, y = _SmallNet(), torch.randn(3, 3, 8, 8), torch.randn(3, 2)
    settings = KFACSettings(max_factor_dim=max_factor_dim, matmul_dtype=matmul_dtype,
                            factor_positions=0)
    opt = KFACOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), settings=settings)
    nn.functional.mse_loss(model(x), y).backward()
    B = x.shape[0]
    ones = lambda rows: torch.cat([rows, torch.ones(rows.shape[0], 1)], 1)
    patches = nn.functional.unfold(x, 3, padding=1, stride=2).transpose(1, 2).reshape(-1, 27)
    mask = (model.features > 0).float()   # the conv's output gradient, through the relu
    conv_g = (model.features.grad * mask * B).permute(0, 2, 3, 1).reshape(-1, 4)
    head_g = model.logits.grad * B
    expected = {
        model.conv.weight: (ones(patches), conv_g),
        model.head.weight: (ones(model.features.detach().flatten(1)), head_g)}
    opt.step()
    for weight, (a_rows, g_rows) in expected.items():
        e = opt.kfac_state[weight]
        A = a_rows.T @ a_rows / a_rows.shape[0]
        G = g_rows.T @ g_rows / B
        A = A.diagonal() if max_factor_dim and A.shape[0] > max_factor_dim else A
        G = G.diagonal() if max_factor_dim and G.shape[0] > max_factor_dim else G
        if matmul_dtype == "float32":
            torch.testing.assert_close(e["kfac_A"], A, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(e["kfac_G"], G, rtol=1e-5, atol=1e-7)
        else:   # bfloat16 operands (8-bit mantissa), float32 state: within 1 % of the largest
            for got, want in ((e["kfac_A"], A), (e["kfac_G"], G)):
                assert got.dtype == torch.float32
                assert float((got - want).abs().max() / want.abs().max()) < 1e-2
    opt.close()


def test_bfloat16_products_precondition_like_float32():
    """One K-FAC step (factors, damped inverses, preconditioning, KL clip) with bfloat16 products
    moves the weights within 3 % of the float32 step, for both inverse methods."""
    for inverse in ("eigen", "cholesky"):
        moves = {}
        for dtype in ("float32", "bfloat16"):
            torch.manual_seed(0)
            model, x, y = _SmallNet(), torch.randn(6, 3, 8, 8), torch.randn(6, 2)
            before = [p.detach().clone() for p in model.parameters()]
            settings = KFACSettings(matmul_dtype=dtype, inverse=inverse, kl_clip=10.0)
            opt = KFACOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                settings=settings)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.close()
            moves[dtype] = torch.cat([(p.detach() - b).flatten()
                                      for p, b in zip(model.parameters(), before)])
        err = float((moves["bfloat16"] - moves["float32"]).norm() / moves["float32"].norm())
        assert 0 < err < 3e-2, (inverse, err)


def test_damped_inverse_in_float32_and_its_float64_fallback():
    torch.manual_seed(0)
    rows = torch.randn(64, 200) * torch.logspace(0, -4, 200)   # condition ~1e8 before damping
    factor = rows.T @ rows / 64
    inverse = damped_inverse(factor, 1e-3)
    assert inverse.dtype == torch.float32
    exact = torch.linalg.inv(factor.double() + 1e-3 * torch.eye(200, dtype=torch.float64))
    assert float((inverse.double() - exact).norm() / exact.norm()) < 1e-4
    # singular in float32 (1 + 1e-10 rounds to 1), positive definite in float64: the float64
    # inverse, in float32
    singular = torch.ones(2, 2)
    inverse = damped_inverse(singular, 1e-10)
    exact = torch.linalg.inv(singular.double() + 1e-10 * torch.eye(2, dtype=torch.float64))
    assert inverse.dtype == torch.float32
    torch.testing.assert_close(inverse.double(), exact, rtol=1e-4, atol=0)


# ---------------------------------------------------------------------- K-FAC against its formula
LR, DAMPING, WEIGHT_DECAY = 0.1, 0.05, 0.01


def _kfac_inputs():
    torch.manual_seed(0)
    return _SmallNet(), torch.randn(6, 3, 8, 8), torch.randn(6, 2)


def _kfac_reference(inverse="eigen", max_factor_dim=0) -> tuple[dict, float]:
    """One K-FAC step of `_SmallNet` from its definition, in float64, written apart from
    `optim/kfac*.py`: per layer the factors A (input patches by F.unfold, a 1 for the bias) and
    G (per-sample output gradients), each replaced by its diagonal when wider than
    `max_factor_dim` > 0, and the preconditioned gradient V solved on the Kronecker product,

        eigen     vec(V) = (A ⊗ G + λI)⁻¹ vec(∇)
        cholesky  vec(V) = ((A + π√λ·I) ⊗ (G + √λ/π·I))⁻¹ vec(∇),  π = sqrt((tr A/a) / (tr G/g))

    (∇ the g × a gradient matrix, bias last, vec column-major) by torch.linalg.solve.
    Returns {"conv.weight": V's weight part, "conv.bias": ..., ...} and Σ_layers ⟨V, ∇⟩."""
    model, x, y = _kfac_inputs()
    m, X, B = model.double(), x.double(), x.shape[0]
    nn.functional.mse_loss(m(X), y.double()).backward()
    ones = lambda rows: torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], 1)
    patches = nn.functional.unfold(X, 3, padding=1, stride=2).transpose(1, 2).reshape(-1, 27)
    conv_g = (m.features.grad * (m.features > 0) * B).permute(0, 2, 3, 1).reshape(-1, 4)
    rows = {"conv": (ones(patches), conv_g),
            "head": (ones(m.features.detach().flatten(1)), m.logits.grad * B)}
    lam, out, vg = DAMPING, {}, 0.0
    eye = lambda n: torch.eye(n, dtype=torch.float64)
    for name, (a_rows, g_rows) in rows.items():
        layer = getattr(m, name)
        A, G = a_rows.T @ a_rows / a_rows.shape[0], g_rows.T @ g_rows / B
        if max_factor_dim:
            A = A.diag().diag() if A.shape[0] > max_factor_dim else A
            G = G.diag().diag() if G.shape[0] > max_factor_dim else G
        grad = torch.cat([layer.weight.grad.reshape(layer.weight.shape[0], -1),
                          layer.bias.grad[:, None]], 1)
        a, g = A.shape[0], G.shape[0]
        if inverse == "eigen":
            K = torch.kron(A, G) + lam * eye(a * g)
        else:
            pi = ((A.trace() / a) / (G.trace() / g)).sqrt()
            K = torch.kron(A + pi * lam ** 0.5 * eye(a), G + lam ** 0.5 / pi * eye(g))
        V = torch.linalg.solve(K, grad.T.reshape(-1)).reshape(a, g).T   # vec⁻¹, column-major
        vg += float((V * grad).sum())
        out[f"{name}.weight"] = V[:, :-1].reshape(layer.weight.shape)
        out[f"{name}.bias"] = V[:, -1]
    return out, vg


KFAC_CASES = {   # name: (inverse, max_factor_dim, KL clip scale ν (None: clip off), base)
    "eigen": ("eigen", 0, None, "sgd"),
    "eigen-clipped": ("eigen", 0, 0.3, "sgd"),
    "cholesky": ("cholesky", 0, None, "sgd"),
    "cholesky-clipped": ("cholesky", 0, 0.3, "sgd"),
    # wider than 20 kept diagonal: the conv's A (28 wide) and the head's A (65)
    "eigen-diagonal": ("eigen", 20, None, "sgd"),
    "cholesky-diagonal": ("cholesky", 20, None, "sgd"),
    "eigen-adamw": ("eigen", 0, None, "adamw"),
    "eigen-clipped-adamw": ("eigen", 0, 0.3, "adamw"),
}


def _kfac_expected(case: str) -> tuple[dict, float]:
    """The reference ν·V of `case`, and the κ given to the code under test: 1e30 with the clip
    off (ν = 1), else κ = ν²·η²·Σ⟨V, ∇⟩, so that the clip's formula
    ν = min(1, sqrt(κ / (η² Σ⟨V, ∇⟩))) scales the step by the case's ν."""
    inverse, dim, nu, _ = KFAC_CASES[case]
    V, vg = _kfac_reference(inverse, dim)
    assert vg > 0
    if nu is None:
        return V, 1e30
    kappa = nu * nu * LR * LR * vg
    assert abs(min(1.0, (kappa / (LR * LR * vg)) ** 0.5) - nu) < 1e-12
    return {k: nu * v for k, v in V.items()}, kappa


def _kfac_step(case: str, kappa: float, rank: int = 0, world: int = 1, mesh=None,
               fraction: float = 1.0):
    """One step of the code under test on this rank's share of the batch (the data-parallel
    gradient: the mean of the ranks' gradients); returns (weights before, the gradients K-FAC
    hands its base optimizer, weights after)."""
    inverse, dim, _, base = KFAC_CASES[case]
    model, x, y = _kfac_inputs()
    share = x.shape[0] // world
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    settings = KFACSettings(damping=DAMPING, kl_clip=kappa, inverse=inverse, max_factor_dim=dim,
                            grad_worker_fraction=fraction, matmul_dtype="float32",
                            factor_positions=0, factor_every=1)   # the formula's exact variant
    inner = (torch.optim.SGD(model.parameters(), lr=LR) if base == "sgd" else
             torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY))
    opt = KFACOptimizer(model, inner, mesh, settings=settings)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    nn.functional.mse_loss(model(x), y).backward()
    if world > 1:
        import torch.distributed as dist
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    handed, step = {}, inner.step

    def spy(*args, **kwargs):
        handed.update({k: v.grad.detach().clone() for k, v in model.named_parameters()})
        return step(*args, **kwargs)
    inner.step = spy
    opt.step()
    opt.close()
    return before, handed, {k: v.detach().clone() for k, v in model.named_parameters()}


def _check_step(case: str, expected: dict, before: dict, handed: dict, after: dict) -> None:
    """The gradient handed to the base optimizer is the reference ν·V, and the weights move by
    the base optimizer's first step of it: SGD (no momentum) −η·ν·V; AdamW
    −η·wd·w − η·ν·V / (|ν·V| + ε) (after one step m̂ = g and v̂ = g²)."""
    base = KFAC_CASES[case][3]
    for key, want in expected.items():
        scale = float(want.abs().max())
        torch.testing.assert_close(handed[key].double(), want, rtol=1e-4, atol=1e-4 * scale,
                                   msg=lambda m: f"{case} {key}: {m}")
        w = before[key].double()
        step = (-LR * want if base == "sgd"
                else -LR * WEIGHT_DECAY * w - LR * want / (want.abs() + 1e-8))
        atol = 1e-4 * (LR * scale if base == "sgd" else LR)
        torch.testing.assert_close(after[key].double() - w, step, rtol=1e-4, atol=atol,
                                   msg=lambda m: f"{case} {key}: {m}")


@pytest.mark.parametrize("case", list(KFAC_CASES))
def test_kfac_step_equals_its_formula(case):
    """One step of `_SmallNet` (Conv2d + Linear) moves the weights by −η·ν·(A ⊗ G + λI)⁻¹ vec(∇),
    solved in float64 apart from the code (`_kfac_reference`), with the KL clip off (ν = 1)
    and on (κ set so that the clip's formula gives ν = 0.3), for eigen and Cholesky inverses,
    diagonal factors, and an AdamW base (there the reference is the gradient AdamW receives,
    ν·V, and AdamW's first step of it: `_check_step`).

    Mutations of `optim/kfac*.py` run by hand (then reverted) and failing here: damping tripled
    in the eigen path (`+ lam` → `+ 3 * lam`) and eigenvectors stored transposed
    (`Q.copy_(vecs)` → `Q.copy_(vecs.T)`): every eigen case (eigen-diagonal through G's
    eigenvectors); Cholesky's damping tripled (`sqrt(damping)` → `sqrt(3 * damping)` in
    `_tikhonov`, or `factor + 3 * damping * eye` in `damped_inverse`): every cholesky case; the KL clip dropped (`v = v * nu` → `v = v`): every
    clipped case (the AdamW one by the gradient it receives)."""
    expected, kappa = _kfac_expected(case)
    _check_step(case, expected, *_kfac_step(case, kappa))


DISTRIBUTED_CASES = ("eigen-clipped", "cholesky", "eigen-diagonal", "eigen-clipped-adamw")


def _kfac_ranks(kappas: dict) -> dict:
    import exatrain as et
    mesh = et.init(Plan(data=2))
    try:
        return {(case, f): _kfac_step(case, kappa, mesh.rank, 2, mesh, f)
                for case, kappa in kappas.items() for f in (0.5, 1.0)}
    finally:
        mesh.close()


def test_kfac_distributed_step_equals_its_formula():
    """The same step on 2 data ranks (3 samples each), with one grad worker per layer (f = 1/2:
    each preconditioned gradient computed on one rank and broadcast) and with both ranks
    workers (f = 1), equals the float64 reference of the whole batch on every rank, not only
    the serial run of the same code. Each of the four mutations listed under
    `test_kfac_step_equals_its_formula` fails here too."""
    expected = {case: _kfac_expected(case) for case in DISTRIBUTED_CASES}
    ranks = run_ranks(2, _kfac_ranks, {case: kappa for case, (_, kappa) in expected.items()})
    for results in ranks:
        for (case, fraction), (before, handed, after) in results.items():
            _check_step(case, expected[case][0], before, handed, after)


def kfac_default_runs(configs: dict) -> dict:
    out = {}
    for name, config in configs.items():
        mesh, trainer = setup(config)
        try:
            trainer.fit()
            out[name] = {k: v.detach().cpu().clone()
                         for k, v in unwrap(trainer.model).state_dict().items()}
        finally:
            mesh.close()
    return out


def test_kfac_at_its_defaults_trains_distributed_like_serial(tiny_config):
    """`optim.name = "kfac"` alone (AdamW base, Cholesky, 64 positions, diagonal wide factors,
    products in bfloat16 where the CPU multiplies it fast) under data=2 against one process: the
    whole state within 2e-2 of serial after 4 steps in bfloat16 (measured 9.5e-3: rounding to
    8 mantissa bits turns the 1e-7 differences of reordered sums into differences of 2^-8), and
    within 1e-4 with float32 products (measured 3.5e-5), so that it is the rounding and nothing
    else."""
    from exatrain.bench.kfac_branches import norm_error
    from exatrain.optim.kfac_factors import fast_bfloat16

    base = ("optim.name='kfac'", "train.steps=4", "train.eval_every=0",
            "schedule.warmup_steps=0", "optim.kfac_inverse_every=3")
    configs = {"defaults": tiny_config(*base, "plan.data=2"),
               "float32": tiny_config(*base, "plan.data=2", "optim.kfac_matmul_dtype='float32'")}
    ranks = run_ranks(2, kfac_default_runs, configs)
    bound = {"defaults": 2e-2 if fast_bfloat16(torch.device("cpu")) else 1e-4, "float32": 1e-4}
    for name, config in configs.items():
        serial = kfac_default_runs({name: tiny_config(*base, *(
            ["optim.kfac_matmul_dtype='float32'"] if name == "float32" else []))})[name]
        for rank in ranks:
            assert norm_error(rank[name], serial) <= bound[name], name


def test_auto_products_are_bfloat16_where_the_device_multiplies_it_fast():
    from exatrain.optim.kfac_factors import fast_bfloat16, resolve_matmul_dtype

    cpu = torch.device("cpu")
    expected = torch.bfloat16 if fast_bfloat16(cpu) else torch.float32
    assert resolve_matmul_dtype("auto", cpu) == expected
    assert resolve_matmul_dtype("float32", cpu) == torch.float32
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert fast_bfloat16(cpu) == ("avx512_bf16" in flags or "amx_bf16" in flags)
