"""parallelize(): lay a plain module out over the mesh, applying strategies in a fixed order.

Order (torchtitan's, for the same reasons):

    [pipe: split into stages, then per stage:] tensor -> space -> activation checkpointing
    -> compile -> shard -> data

Layer-splitting strategies first, because they replace modules; then memory and compile wrappers,
which act on the replaced modules; sharding and data replication last, since they only need the
final parameters. Each strategy lives in its own module and is imported only when its axis is used.

Gradient synchronisation over the replicated axes:
  data only        all-reduce over `data`, mean
  data × space     all-reduce over `data+space`: summed over the spatial ranks of one sample
                   (each holds a partial weight gradient), averaged over the data replicas
  shard            the sharding strategy reduce-scatters over `shard` and all-reduces over `data`
  tensor           the tensor strategy syncs each parameter over the axes its metadata names
"""

from __future__ import annotations

import importlib

from torch import nn

from ..mesh import Mesh
from .data import data_parallel
from .options import ParallelOptions


def _strategy(name: str):
    return importlib.import_module(f"exatrain.parallel.{name}")


def parallelize(model: nn.Module, mesh: Mesh, options=None, example=None) -> nn.Module:
    """Return a module that trains like `model` on one process, laid out over `mesh`.

    `options` is a `ParallelOptions` (the config's [parallel] section); None means defaults.
    `example`: one per-replica batch of inputs; needed to split the model under `pipe`.
    """
    if options is None:
        options = ParallelOptions()
    plan = mesh.plan
    if plan.tensor_degree > 1 and _strategy("graph").has_graph_convs(model):  # 3D GCN (Plexus)
        return _strategy("graph").parallelize_graph(model, mesh, options)
    if plan.tensor_degree > 1:  # places the model itself: a meta-device model is built shard by shard
        return _strategy("tensor").parallelize_tensor(model, mesh, options)
    model = model.to(mesh.device)
    if plan.pipe > 1:  # split into stages, then lay out each of this rank's stages
        return _strategy("pipe").pipeline_parallel(
            model, mesh, options, example, lambda stage: _lay_out_stage(stage, mesh, options))
    return _lay_out_stage(model, mesh, options)


def _lay_out_stage(model: nn.Module, mesh: Mesh, options) -> nn.Module:
    """space -> activation checkpointing -> compile -> shard -> data, on one (stage) module."""
    plan = mesh.plan
    if plan.space_degree > 1:
        model = _strategy("spatial").parallelize_spatial(model, mesh)
    if options.activation_checkpointing != "none" or options.compile:
        model = _strategy("memory").apply_checkpointing_and_compile(model, options)
    if plan.shard > 1:
        return _strategy("shard").parallelize_shard(model, mesh, options)
    if plan.space_degree > 1:
        return data_parallel(model, mesh.axis("data", "space"), replicas=plan.data,
                             bucket_cap_mb=options.bucket_cap_mb, device=mesh.device,
                             broadcast_buffers=False)
    return data_parallel(model, mesh.axis("data"), bucket_cap_mb=options.bucket_cap_mb,
                         device=mesh.device)
