"""parallelize(): lay a plain module out over the mesh, applying strategies in a fixed order.

Order (torchtitan's, for the same reasons): tensor -> space -> activation checkpointing ->
compile -> shard -> data. Layer-splitting strategies first, because they replace modules; then
memory and compile wrappers, which act on the replaced modules; data replication last, since it
only needs the final parameters.
"""

from __future__ import annotations

from torch import nn

from ..mesh import Mesh
from .data import data_parallel


def parallelize(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Return a module that trains like `model` on one process, laid out over `mesh`."""
    model = model.to(mesh.device)
    return data_parallel(model, mesh.axis("data"), device=mesh.device)
