"""Forces from a learned energy: F = -∂E/∂x, the way machine-learned interatomic potentials
(DimeNet++ on OC20 in MLPerf HPC's OpenCatalyst, SchNet, NequIP) predict them.

`Forces(energy)` wraps a model that maps a batch of atoms (B, A, 4) rows [Z, x, y, z] to one
energy per structure (B,). Its forward returns the forces (B, A, 3): the negative gradient of the
energy with respect to every atom's position. In training the gradient is taken with
`create_graph=True`, so the loss on the forces reaches the weights through a second
differentiation (the step costs about three forwards and two backwards of the energy model);
in evaluation (`model.eval()`, under `torch.no_grad()` too) the forces are plain, detached
values. Forces derived this way are conservative by construction (the curl of a gradient is
zero) and rotate with the structure when the energy is invariant.

The sum of the batch's energies is differentiated once: structures do not interact, so
∂(Σ_b E_b)/∂x_(b,i) = ∂E_b/∂x_(b,i). Padding slots (Z = 0) take no part in the energy and get
zero forces.

Communication: none of its own. Under `data` and `shard` with ZeRO-1/2 the derivative is local
to each rank's samples; exatrain refuses, before the first step, the Plans whose layers cannot
be differentiated twice (parallel/derivatives.py).
"""

from __future__ import annotations

import torch
from torch import nn


class Forces(nn.Module):
    """The forces of a learned energy, F = -dE/dx, as a model: `Forces(energy)(atoms)`.

    `energy` maps atoms (B, A, 4), rows [Z, x, y, z] (Z = 0 for padding), to one energy per
    structure (B,); the forward returns the forces (B, A, 3). In training the gradient keeps its
    graph, so a loss on the forces trains the energy's weights (a second derivative); in
    evaluation the forces are plain values, computed even under `torch.no_grad()`.

        def model():
            return et.models.Forces(et.models.DimeNetPlusPlus(cutoff=6.0, max_z=80))

        # frames: samples (atoms (A, 4), forces (A, 3)), padded to A atoms with Z = 0
        et.fit(model, frames, val_frames, loss=F.l1_loss, plan=et.Plan(data=4))

    Plans: `data`, `shard` with `parallel.zero_stage = 2` (or 1), and 1D `tensor` where the
    energy's layers split (not DimeNet++'s); the others are refused before the first step,
    naming why. A parameter that only shifts the energy by a constant
    (the last bias of a per-atom readout) moves no force, so a loss on the forces alone gives
    it no gradient: freeze it (`requires_grad_(False)`), or data parallelism refuses it by name.
    """

    def __init__(self, energy: nn.Module):
        super().__init__()
        self.energy = energy

    def forward(self, atoms: torch.Tensor) -> torch.Tensor:
        # gradients on even under torch.no_grad(): evaluation differentiates the energy too
        with torch.enable_grad():
            positions = atoms[..., 1:].detach().requires_grad_(True)
            energy = self.energy(torch.cat([atoms[..., :1].detach(), positions], dim=-1))
            (gradient,) = torch.autograd.grad(energy.sum(), positions,
                                              create_graph=self.training)
        return -gradient
