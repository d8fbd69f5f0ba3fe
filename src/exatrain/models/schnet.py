"""SchNet (Schütt et al., 2017/2018): continuous-filter convolutions on interatomic distances.

Input: a batch of molecules as (B, A, 4) rows [Z, x, y, z] (Z = 0 pads molecules shorter than A
atoms). The batch becomes one graph whose nodes are the real atoms and whose edges are the
ordered pairs (i, j), i ≠ j, of the same molecule closer than `cutoff` Å.

    x_i  = embedding(Z_i)                                   (F features per atom)
    e_ij = exp(-γ (d_ij - μ_k)²), k = 1..K                  (radial basis of the distance)
    interaction (× T, residual):
        W_ij = Dense(ssp(Dense(e_ij))) · ½(cos(π d_ij / cutoff) + 1)     filter, smooth at cutoff
        m_i  = Σ_j Linear(x)_j ⊙ W_ij                        (index_add_ over edges)
        x_i += Dense(ssp(Dense(m_i)))
    y = mean_i Dense(ssp(Dense(x_i)))   per molecule (scatter mean), then · std + mean

ssp(x) = softplus(x) - log 2. The scatters are `index_add_`, so no compiled extension is needed.
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

    def forward(self, x, rbf, distance, src, dst):
        envelope = 0.5 * (torch.cos(distance * math.pi / self.cutoff) + 1.0)
        w = self.filter2(shifted_softplus(self.filter1(rbf))) * envelope[:, None]
        messages = self.into(x)[src] * w
        m = torch.zeros_like(x).index_add_(0, dst, messages)
        return x + self.out2(shifted_softplus(self.out1(m)))


class SchNet(nn.Module):
    def __init__(self, features: int = 64, interactions: int = 3, rbf: int = 32,
                 cutoff: float = 5.0, max_z: int = 10, target_mean: float = 0.0,
                 target_std: float = 1.0):
        super().__init__()
        self.cutoff = cutoff
        self.embedding = nn.Embedding(max_z, features, padding_idx=0)
        self.register_buffer("centres", torch.linspace(0.0, cutoff, rbf))
        self.gamma = 0.5 / float(self.centres[1] - self.centres[0]) ** 2
        self.interactions = nn.ModuleList(Interaction(features, rbf, cutoff)
                                          for _ in range(interactions))
        self.head1 = nn.Linear(features, features // 2)
        self.head2 = nn.Linear(features // 2, 1)
        self.register_buffer("target", torch.tensor([target_mean, target_std]))

    def graph(self, atoms: torch.Tensor):
        """Atoms, edges and molecule index of a padded batch (see the module docstring)."""
        z = atoms[..., 0].round().long()
        present = z > 0
        batch, slots = atoms.shape[:2]
        flat = torch.cumsum(present.flatten(), 0).reshape(batch, slots) - 1   # atom numbers
        molecule = torch.arange(batch, device=atoms.device)[:, None].expand(batch, slots)[present]
        pairs = present[:, :, None] & present[:, None, :] & \
            ~torch.eye(slots, dtype=torch.bool, device=atoms.device)
        b, i, j = pairs.nonzero(as_tuple=True)
        pos = atoms[..., 1:]
        distance = (pos[b, i] - pos[b, j]).norm(dim=-1)
        near = distance < self.cutoff
        return z[present], molecule, flat[b, j][near], flat[b, i][near], distance[near]

    def forward(self, atoms: torch.Tensor) -> torch.Tensor:
        z, molecule, src, dst, distance = self.graph(atoms)
        x = self.embedding(z)
        rbf = torch.exp(-self.gamma * (distance[:, None] - self.centres) ** 2)
        for block in self.interactions:
            x = block(x, rbf, distance, src, dst)
        per_atom = self.head2(shifted_softplus(self.head1(x))).squeeze(-1)
        batch = atoms.shape[0]
        total = per_atom.new_zeros(batch).index_add_(0, molecule, per_atom)
        count = per_atom.new_zeros(batch).index_add_(0, molecule, torch.ones_like(per_atom))
        return total / count.clamp_min(1.0) * self.target[1] + self.target[0]
