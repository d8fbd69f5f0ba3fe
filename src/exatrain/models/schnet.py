"""SchNet (Schütt et al., 2017/2018): continuous-filter convolutions on interatomic distances.

Input: a batch of molecules as (B, A, 4) rows [Z, x, y, z] (Z = 0 pads molecules shorter than A
atoms). Within each molecule every ordered pair (i, j), i ≠ j, of real atoms closer than `cutoff`
Å exchanges a message.

    x_i  = embedding(Z_i)                                   (F features per atom)
    e_ij = exp(-γ (d_ij - μ_k)²), k = 1..K                  (radial basis of the distance)
    interaction (× T, residual):
        W_ij = Dense(ssp(Dense(e_ij))) · ½(cos(π d_ij / cutoff) + 1) · [pair (i, j) within cutoff]
        m_i  = Σ_j Linear(x)_j ⊙ W_ij
        x_i += Dense(ssp(Dense(m_i)))
    y = mean over the molecule's real atoms of Dense(ssp(Dense(x_i))), then · std + mean
        (readout="sum": the sum over them, for an extensive property such as an energy)

ssp(x) = softplus(x) - log 2. Every pair of atom slots of a molecule is computed, as dense
(B, A, A, ·) tensors, with the pairs that exchange no message masked to zero: QM9's molecules
have at most 29 atoms, so the dense form costs little, and its shapes depend only on the batch's
shape, never on the data — the model compiles to one graph and needs no scatter (a sparse edge
list built with `nonzero` has a data-dependent length, which breaks a compiled graph every step).
Padded slots carry features that reach neither a real atom nor the readout.
"""

from __future__ import annotations

import math

import torch
from torch import nn
import torch.nn.functional as F


def shifted_softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x) - math.log(2.0)


class Interaction(nn.Module):
    def __init__(self, features: int, rbf: int, cutoff: float):
        super().__init__()
        self.cutoff = cutoff
        self.filter1 = nn.Linear(rbf, features)
        self.filter2 = nn.Linear(features, features)
        self.into = nn.Linear(features, features, bias=False)
        self.out1 = nn.Linear(features, features)
        self.out2 = nn.Linear(features, features)

    def forward(self, x, rbf, envelope):
        """x: (B, A, F); rbf: (B, A, A, K); envelope: (B, A, A), zero for pairs without a message."""
        w = self.filter2(shifted_softplus(self.filter1(rbf))) * envelope[..., None]
        m = torch.einsum("bjf,bijf->bif", self.into(x), w)   # m_i = Σ_j Linear(x)_j ⊙ W_ij
        return x + self.out2(shifted_softplus(self.out1(m)))


class SchNet(nn.Module):
    def __init__(self, features: int = 64, interactions: int = 3, rbf: int = 32,
                 cutoff: float = 5.0, max_z: int = 10, target_mean: float = 0.0,
                 target_std: float = 1.0, readout: str = "mean"):
        super().__init__()
        if readout not in ("mean", "sum"):
            raise ValueError(f"readout={readout!r}: 'mean' or 'sum'")
        self.cutoff, self.readout = cutoff, readout
        self.embedding = nn.Embedding(max_z, features, padding_idx=0)
        self.register_buffer("centres", torch.linspace(0.0, cutoff, rbf))
        self.gamma = 0.5 / float(self.centres[1] - self.centres[0]) ** 2
        self.interactions = nn.ModuleList(Interaction(features, rbf, cutoff)
                                          for _ in range(interactions))
        self.head1 = nn.Linear(features, features // 2)
        self.head2 = nn.Linear(features // 2, 1)
        self.register_buffer("target", torch.tensor([target_mean, target_std]))

    def pairs(self, atoms: torch.Tensor):
        """Real-atom mask (B, A), distances and the cutoff envelope of every pair (B, A, A), the
        envelope zero where (i, j) exchange no message (see the module docstring)."""
        z = atoms[..., 0].round().long()
        present = z > 0
        slots = atoms.shape[1]
        pos = atoms[..., 1:]
        distance = (pos[:, :, None, :] - pos[:, None, :, :]).norm(dim=-1)
        near = present[:, :, None] & present[:, None, :] & (distance < self.cutoff) & \
            ~torch.eye(slots, dtype=torch.bool, device=atoms.device)
        envelope = 0.5 * (torch.cos(distance * math.pi / self.cutoff) + 1.0) * near
        return z, present, distance, envelope

    def forward(self, atoms: torch.Tensor) -> torch.Tensor:
        z, present, distance, envelope = self.pairs(atoms)
        x = self.embedding(z)
        rbf = torch.exp(-self.gamma * (distance[..., None] - self.centres) ** 2)
        for block in self.interactions:
            x = block(x, rbf, envelope)
        per_atom = self.head2(shifted_softplus(self.head1(x))).squeeze(-1) * present
        if self.readout == "sum":
            return per_atom.sum(dim=1) * self.target[1] + self.target[0]
        count = present.sum(dim=1).clamp_min(1).to(per_atom.dtype)
        return per_atom.sum(dim=1) / count * self.target[1] + self.target[0]
