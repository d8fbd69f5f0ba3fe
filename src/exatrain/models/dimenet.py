"""DimeNet++ (Gasteiger et al., 2020): directional message passing on a molecule's edges and angles.

Input: a batch of molecules as (B, A, 4) rows [Z, x, y, z] (Z = 0 pads molecules shorter than A
atoms), as SchNet's (models/schnet.py). An edge j→i joins two real atoms i ≠ j closer than
`cutoff` Å; a triplet k→j→i is a pair of edges k→j, j→i with k ≠ i, and α_kji is the angle at j
between the directions to i and to k. The model carries one message m_ji per edge:

    bases, x = d / cutoff, u(x) = 1 - (p+1)(p+2)/2 x^p + p(p+2) x^(p+1) - p(p+1)/2 x^(p+2)
           (smooth envelope, p = envelope_exponent + 1; u = u' = u'' = 0 at the cutoff)
        radial     e_n(d)       = √2 · sin(f_n x) / x · u(x),        n = 1..R   (f_n learnt, from nπ)
        spherical  a_ln(d, α)   = √2 / |j_(l+1)(z_ln)| · j_l(z_ln x) · u(x) · Y_l(α),
                                  l = 0..S-1, n = 1..R, z_ln the n-th root of the spherical
                                  Bessel function j_l, Y_l(α) = √((2l+1)/4π) P_l(cos α)
                                  (spherical harmonics with m = 0: Legendre polynomials)
    embedding   h_i = Emb(Z_i);  m_ji = σ(W [h_j ‖ h_i ‖ σ(W_e e(d_ji))])
    interaction (× blocks):
        t_kj  = σ(W_down (σ(W_kj m_kj) ⊙ W_e2 W_e1 e(d_kj)))                      (int_emb wide)
        x_ji  = σ(W_up Σ_k (W_s2 W_s1 a(d_kj, α_kji)) ⊙ t_kj)  +  σ(W_ji m_ji)    (k ≠ i)
        h_ji  = residual layers before the skip (x_ji)      (each: h + σ(W₂ σ(W₁ h)))
        m_ji ← residual layers after the skip (σ(W h_ji) + m_ji)
    output (after the embedding and each block):
        P_i += W_out σ(…σ(W_o W_up' Σ_j (W_r e(d_ji)) ⊙ m_ji)…)
    y = Σ_i P_i · std + mean                                      (a sum over atoms, as the paper's)

σ = SiLU (swish). The "++" bottleneck: triplets work at int_emb (< hidden) channels, down- and
up-projected around the sum over k, and the spherical basis (S·R values) reaches them through
basis_emb (8) channels. As in the authors' code (not the paper's formula) the radial basis that
gates t_kj is that of d_kj. The spherical basis uses the envelope u(x) itself; the authors' code
divides it by x as well (their README lists that as a known flaw).

Dense form. As SchNet here, every edge slot (B, A, A, ·) and triplet slot (B, A, A, A, ·) of
the padded batch is computed, those that are no edge or triplet masked to zero, so the shapes
depend only on the batch's shape (no data-dependent `nonzero`, no scatter: torch.compile traces
the forward as one graph without breaks, tested).
The triplet sum never builds a (B, A, A, A, int_emb) tensor: W_s1 is linear, so the projected
spherical basis factors as Σ_l Y_l(α_kji) · (R_l(d_kj) W_s1,l) with R_l the S × R radial part,
and

    Σ_k a'(d_kj, α_kji) ⊙ t_kj = Σ_(k,l) Y[b, j, i, (k, l)] · Z[b, j, (k, l), :],
    Z[b, j, k, l, :] = (R_l(d_kj) W_s1,l W_s2) ⊙ t_kj

is one batched matrix product per (molecule, j) of (A × A·S) by (A·S × int_emb). Y, the masked
angular basis (B·A³·S numbers), is computed once per forward and shared by every block: it and
the cosines it is made from are the only triplet-sized tensors. The Bessel functions are evaluated in float64 (their upward
recurrence loses digits for x < l) and cast to the model's dtype.

Cost per molecule and forward, in FLOPs of the matrix products (2 per multiply-add), for A atom
slots, E = A² edge slots, H = hidden, I = int_emb, C = basis_emb, O = out_emb, S·R bases, r
residual layers per block (before + after the skip), L output layers:

    embedding     2·A·2H·H + 2·E·(R·H + H·H)
    each block    2·E·(H²·(3 + 2r) + R·C + C·H + H·I + S·R·C + S·C·I + I·H) + 2·A·E·S·I
    each output   2·E·R·H + 2·A·(H·O + L·O² + O)                      (blocks + 1 of them)
    angles        2·A·E·3

`DimeNetPlusPlus.flops_per_molecule(A)` evaluates it (tested equal to PyTorch's FLOP counter):
1.33 GFLOP at the paper's sizes and A = 29, QM9's padded molecule; the edge-level Linears
(E·H² terms) are 77 % of it, the triplet product 7 %. Training costs about three forwards.
The dense slots cost more than the real graph: QM9 molecules have 18.0 atoms, 281 edges within
5 Å and 4,296 triplets on average, against 841 edge and 24,389 triplet slots (3.0× and 5.7×),
the price of shapes that never depend on the data.

Paper sizes (the defaults here): hidden 128, 4 blocks, int_emb 64, basis_emb 8, out_emb 256,
6 radial and 7 spherical functions, cutoff 5 Å, envelope exponent 5, 1 residual layer before the
skip and 2 after, 3 output layers. The authors trained it on QM9 with 110,000 molecules, batch 32,
for 3 million steps.
"""

from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F


def spherical_bessel(l_max: int, x: torch.Tensor) -> torch.Tensor:
    """j_0(x) … j_l_max(x) stacked on a new last axis, by the upward recurrence
    j_(l+1) = (2l+1)/x · j_l - j_(l-1). Call it in float64; x > 0."""
    sin = torch.sin(x)
    j = [sin / x]
    if l_max >= 1:
        j.append((j[0] - torch.cos(x)) / x)
    for l in range(1, l_max):
        j.append((2 * l + 1) / x * j[l] - j[l - 1])
    return torch.stack(j, dim=-1)


def spherical_bessel_roots(spherical: int, radial: int) -> torch.Tensor:
    """(spherical, radial) float64: the first `radial` positive roots z_ln of each j_l.

    j_0's roots are nπ; the roots of j_l interlace those of j_(l-1) (exactly one between two
    consecutive ones), so each is found by bisection on that bracket."""
    roots = torch.arange(1, radial + spherical, dtype=torch.float64) * math.pi
    table = [roots[:radial]]
    for l in range(1, spherical):
        lo, hi = roots[:-1].clone(), roots[1:].clone()
        f_lo = spherical_bessel(l, lo)[..., l]
        for _ in range(80):                          # 2^-80 of a bracket < π: float64 exact
            mid = 0.5 * (lo + hi)
            f_mid = spherical_bessel(l, mid)[..., l]
            left = torch.sign(f_mid) == torch.sign(f_lo)
            lo, f_lo = torch.where(left, mid, lo), torch.where(left, f_mid, f_lo)
            hi = torch.where(left, hi, mid)
        roots = 0.5 * (lo + hi)
        table.append(roots[:radial])
    return torch.stack(table)


def legendre(l_max: int, c: torch.Tensor) -> torch.Tensor:
    """P_0(c) … P_l_max(c) on a new last axis: (l+1) P_(l+1) = (2l+1) c P_l - l P_(l-1)."""
    p = [torch.ones_like(c), c]
    for l in range(1, l_max):
        p.append(((2 * l + 1) * c * p[l] - l * p[l - 1]) / (l + 1))
    return torch.stack(p[:l_max + 1], dim=-1)


def envelope(x: torch.Tensor, exponent: int) -> torch.Tensor:
    """u(x) of the module docstring, zero from x = 1 on."""
    p = exponent + 1
    u = 1 - (p + 1) * (p + 2) / 2 * x ** p + p * (p + 2) * x ** (p + 1) - p * (p + 1) / 2 * x ** (p + 2)
    return torch.where(x < 1, u, torch.zeros_like(u))


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin1 = nn.Linear(width, width)
        self.lin2 = nn.Linear(width, width)

    def forward(self, x):
        return x + F.silu(self.lin2(F.silu(self.lin1(x))))


class Embedding(nn.Module):
    def __init__(self, hidden: int, radial: int, max_z: int):
        super().__init__()
        self.hidden = hidden
        self.atom = nn.Embedding(max_z, hidden, padding_idx=0)
        self.rbf = nn.Linear(radial, hidden)
        self.lin = nn.Linear(3 * hidden, hidden)

    def forward(self, z, rbf):
        """m[b, i, j] = σ(W [h_j ‖ h_i ‖ σ(W_e e_ij)]), W applied in three parts (no (B,A,A,3H))."""
        h = self.atom(z)
        w_source, w_target, w_rbf = self.lin.weight.split(self.hidden, dim=1)
        source = h @ w_source.T                                     # (B, A, H), indexed by j
        target = h @ w_target.T + self.lin.bias                     # indexed by i
        edge = F.silu(self.rbf(rbf)) @ w_rbf.T
        return F.silu(target[:, :, None, :] + source[:, None, :, :] + edge)


class Interaction(nn.Module):
    def __init__(self, hidden, int_emb, basis_emb, radial, spherical, before_skip, after_skip):
        super().__init__()
        self.spherical, self.radial = spherical, radial
        self.rbf1 = nn.Linear(radial, basis_emb, bias=False)
        self.rbf2 = nn.Linear(basis_emb, hidden, bias=False)
        self.sbf1 = nn.Linear(spherical * radial, basis_emb, bias=False)
        self.sbf2 = nn.Linear(basis_emb, int_emb, bias=False)
        self.lin_kj = nn.Linear(hidden, hidden)
        self.lin_ji = nn.Linear(hidden, hidden)
        self.down = nn.Linear(hidden, int_emb, bias=False)
        self.up = nn.Linear(int_emb, hidden, bias=False)
        self.before = nn.ModuleList(Residual(hidden) for _ in range(before_skip))
        self.lin = nn.Linear(hidden, hidden)
        self.after = nn.ModuleList(Residual(hidden) for _ in range(after_skip))

    def forward(self, m, rbf, radial_sbf, angular):
        """m, rbf: (B, A, A, ·) on edges [b, i, j] = j→i; radial_sbf: (B, A, A, S, R) on edges;
        angular: (B, A_j, A_i, A_k·S) masked Y_l(α_kji)."""
        b, a = m.shape[:2]
        x_ji = F.silu(self.lin_ji(m))
        # t[b, j, k] = message k→j, gated by the radial basis of d_kj, down to int_emb
        t = F.silu(self.down(F.silu(self.lin_kj(m)) * self.rbf2(self.rbf1(rbf))))
        w1 = self.sbf1.weight.view(-1, self.spherical, self.radial)      # (basis_emb, S, R)
        basis = self.sbf2(torch.einsum("bjkln,cln->bjklc", radial_sbf, w1))  # (B, A, A, S, I)
        z = (basis * t[:, :, :, None, :]).reshape(b * a, a * self.spherical, -1)
        summed = torch.bmm(angular.reshape(b * a, a, -1), z)               # [b·j, i, I]
        x_kj = F.silu(self.up(summed.view(b, a, a, -1).transpose(1, 2)))  # back to [b, i, j]
        h = x_ji + x_kj
        for layer in self.before:
            h = layer(h)
        h = F.silu(self.lin(h)) + m
        for layer in self.after:
            h = layer(h)
        return h


class Output(nn.Module):
    def __init__(self, hidden, out_emb, radial, layers):
        super().__init__()
        self.rbf = nn.Linear(radial, hidden, bias=False)
        self.up = nn.Linear(hidden, out_emb, bias=False)
        self.layers = nn.ModuleList(nn.Linear(out_emb, out_emb) for _ in range(layers))
        self.out = nn.Linear(out_emb, 1, bias=False)
        nn.init.zeros_(self.out.weight)                    # the paper's output initialisation

    def forward(self, m, rbf):
        """Per-atom contributions (B, A) from the edges j→i into each atom i."""
        x = self.up((self.rbf(rbf) * m).sum(dim=2))
        for layer in self.layers:
            x = F.silu(layer(x))
        return self.out(x).sum(dim=-1)                    # (B, A): its one output


class DimeNetPlusPlus(nn.Module):
    def __init__(self, hidden: int = 128, blocks: int = 4, int_emb: int = 64, basis_emb: int = 8,
                 out_emb: int = 256, radial: int = 6, spherical: int = 7, cutoff: float = 5.0,
                 envelope_exponent: int = 5, before_skip: int = 1, after_skip: int = 2,
                 output_layers: int = 3, max_z: int = 10, target_mean: float = 0.0,
                 target_std: float = 1.0):
        super().__init__()
        self.cutoff, self.exponent = cutoff, envelope_exponent
        self.spherical, self.radial = spherical, radial
        self.sizes = dict(hidden=hidden, blocks=blocks, int_emb=int_emb, basis_emb=basis_emb,
                          out_emb=out_emb, before_skip=before_skip, after_skip=after_skip,
                          output_layers=output_layers)
        self.frequencies = nn.Parameter(torch.arange(1, radial + 1, dtype=torch.float32) * math.pi)
        roots = spherical_bessel_roots(spherical, radial)
        self.register_buffer("roots", roots, persistent=False)
        # √2 / |j_(l+1)(z_ln)|: each radial function has unit norm on [0, 1] with weight x²
        norm = math.sqrt(2.0) / spherical_bessel(spherical, roots).gather(
            -1, torch.arange(1, spherical + 1)[:, None, None].expand(-1, radial, 1)).squeeze(-1).abs()
        self.register_buffer("sbf_norm", norm, persistent=False)
        self.embedding = Embedding(hidden, radial, max_z)
        self.interactions = nn.ModuleList(
            Interaction(hidden, int_emb, basis_emb, radial, spherical, before_skip, after_skip)
            for _ in range(blocks))
        self.outputs = nn.ModuleList(Output(hidden, out_emb, radial, output_layers)
                                     for _ in range(blocks + 1))
        self.register_buffer("target", torch.tensor([target_mean, target_std]))

    def geometry(self, atoms: torch.Tensor):
        """Atomic numbers (B, A), real-atom mask, the radial basis on edges (B, A, A, R), the
        radial part of the spherical basis on edges (B, A, A, S, R) and the masked angular basis
        (B, A_j, A_i, A_k·S), every value zero where there is no edge or triplet."""
        z = atoms[..., 0].round().long()
        present = z > 0
        b, a = z.shape
        pos = atoms[..., 1:]
        vec = pos[:, None, :, :] - pos[:, :, None, :]            # [b, j, n] = x_n - x_j
        distance = vec.norm(dim=-1)
        edge = present[:, :, None] & present[:, None, :] & (distance < self.cutoff) & \
            ~torch.eye(a, dtype=torch.bool, device=atoms.device)
        safe = torch.where(edge, distance, torch.full_like(distance, 0.5 * self.cutoff))
        x = safe / self.cutoff
        u = envelope(x, self.exponent) * edge
        rbf = math.sqrt(2.0) * torch.sin(self.frequencies * x[..., None]) / x[..., None] * u[..., None]
        x64 = x.double()[..., None]
        j = torch.stack([spherical_bessel(l, x64 * self.roots[l].double())[..., l]
                         for l in range(self.spherical)], dim=-2)       # j_l(z_ln x): (…, S, R)
        radial_sbf = (j * self.sbf_norm.double()).to(atoms.dtype) * u[..., None, None]
        unit = vec / safe[..., None]
        cos = torch.bmm(unit.reshape(b * a, a, 3), unit.reshape(b * a, a, 3).transpose(1, 2))
        cos = cos.view(b, a, a, a).clamp(-1.0, 1.0)                     # [b, j, i, k]
        triplet = edge[:, :, :, None] & edge[:, :, None, :] & \
            ~torch.eye(a, dtype=torch.bool, device=atoms.device)
        scale = torch.tensor([math.sqrt((2 * l + 1) / (4 * math.pi)) for l in range(self.spherical)],
                             dtype=atoms.dtype, device=atoms.device)
        angular = legendre(self.spherical - 1, cos) * scale * triplet[..., None]
        return z, present, rbf, radial_sbf, angular.reshape(b, a, a, a * self.spherical)

    def forward(self, atoms: torch.Tensor) -> torch.Tensor:
        z, present, rbf, radial_sbf, angular = self.geometry(atoms)
        m = self.embedding(z, rbf)
        per_atom = self.outputs[0](m, rbf)
        for block, output in zip(self.interactions, self.outputs[1:]):
            m = block(m, rbf, radial_sbf, angular)
            per_atom = per_atom + output(m, rbf)
        return (per_atom * present).sum(dim=1) * self.target[1] + self.target[0]

    def flops_per_molecule(self, slots: int = 29) -> int:
        """FLOPs (2 per multiply-add) of the matrix products of one forward on `slots` atom
        slots (the dense form: every slot, real or padding; the module docstring's formula).
        Elementwise work (activations, bases, masks) is left out."""
        s = self.sizes
        h, i, c, o = s["hidden"], s["int_emb"], s["basis_emb"], s["out_emb"]
        a, e, r, sp = slots, slots * slots, self.radial, self.spherical
        embedding = 2 * a * h * 2 * h + 2 * e * (r * h + h * h)
        block = 2 * e * (2 * h * h + r * c + c * h + h * i + sp * r * c + sp * c * i + i * h
                         + h * h + 2 * h * h * (s["before_skip"] + s["after_skip"])) \
            + 2 * a * e * sp * i
        output = 2 * e * r * h + 2 * a * (h * o + s["output_layers"] * o * o + o)
        angles = 2 * a * e * 3
        return embedding + s["blocks"] * block + (s["blocks"] + 1) * output + angles
