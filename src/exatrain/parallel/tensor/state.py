"""Full (unsharded) state dicts for tensor-parallel models: load into any grid, save back exactly.

A parameter split by a tensor strategy carries its layout as metadata:

    param.exatrain_layout = ((dim, Axis), ...)     outermost split first

meaning: take the full tensor, split `dim` into `Axis.size` equal chunks and keep chunk
`Axis.rank`, then apply the next entry to that chunk. For example the 3D weight of a Linear with
its output features on x, its input features on y and the rows sharded over z is

    ((0, tensor_x), (0, tensor_z), (1, tensor_y))

so its local block is W[x-th of X row blocks][z-th of Z sub-blocks, y-th of Y column blocks].
A tensor without `exatrain_layout` is replicated: every rank holds it whole.

`load_full_state_dict` slices each rank's part out of a full state dict (no communication: every
rank reads the full dict, e.g. `torch.load(path, mmap=True)`, so only the touched pages are read);
`full_state_dict` gathers the parts back (an all-gather per split, innermost first, through
`exatrain.comm`, tag "state"). Slicing and gathering move bits without arithmetic, so
`full_state_dict(load_full_state_dict(m, sd)) == sd` exactly. Keys are those of the plain model:
the tensor strategies keep every parameter's name, so a state dict moves between exatrain (any
grid) and plain PyTorch freely.

`dtensor_state_dict` / `for_checkpoint` turn a local state dict (model or optimizer, keyed by
parameter name) into DTensors on the mesh's tensor dims, which is what torch.distributed.checkpoint
needs to save and re-shard strategy-split tensors (plain tensors with one name on every rank would
be deduplicated: only one rank's part would be saved).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from ...comm.autograd import all_gather_dim
from ...comm.dtensor import is_dtensor
from ...errors import TensorSplitError

Layout = tuple  # tuple[tuple[int, Axis], ...]


def layout_of(tensor: torch.Tensor) -> Layout:
    return tuple(getattr(tensor, "exatrain_layout", ()))


def shard_of(full: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's part of `full` under `layout` (a view where possible; no communication)."""
    part = full
    for dim, axis in layout:
        if axis.size == 1:
            continue
        if part.shape[dim] % axis.size:
            raise TensorSplitError(f"dim {dim} of size {part.shape[dim]} does not split over the "
                                   f"{axis.size} ranks of {axis.name!r}")
        part = part.chunk(axis.size, dim)[axis.rank]
    return part


def full_shape(local_shape: Iterable[int], layout: Layout) -> tuple[int, ...]:
    shape = list(local_shape)
    for dim, axis in layout:
        shape[dim] *= axis.size
    return tuple(shape)


def gather_full(local: torch.Tensor, layout: Layout, tag: str = "state") -> torch.Tensor:
    """The full tensor from every rank's part (collective over the layout's axes)."""
    full = local.detach()
    for dim, axis in reversed(layout):
        full = all_gather_dim(full, axis, dim, tag=tag)
    return full.contiguous()


def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict entries as the parameter / buffer objects themselves (their
    metadata included), under the state-dict keys (wrappers such as activation checkpointing
    drop their own levels from these keys, not from named_parameters)."""
    return model.state_dict(keep_vars=True)


def full_state_dict(model: nn.Module, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The model's state with every split tensor gathered whole, keyed like the plain model.

    Collective: every rank of the mesh calls it (each gets the full dict). `cpu` moves the result
    to host memory.
    """
    out = {}
    for key, value in _state_tensors(model).items():
        layout = layout_of(value)
        if is_dtensor(value):  # sharded over `shard` by FSDP2 (tensor × shard)
            value = value.full_tensor()
        full = gather_full(value, layout) if layout else value.detach().clone()
        out[key] = full.cpu() if cpu else full
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True):
    """Copy each rank's part of the full `state` into the (tensor-parallel) `model`, in place.

    Keys and full shapes must match the plain model's; a mismatch raises naming the key, the shape
    found and the shape expected. Returns (missing_keys, unexpected_keys) like load_state_dict.
    """
    own = _state_tensors(model)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(f"full state dict does not match the model: missing {missing[:5]}"
                       f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                       f"{'...' if len(unexpected) > 5 else ''}")
    for key, target in own.items():
        if key not in state:
            continue
        layout = layout_of(target)
        value = state[key]
        want = full_shape(target.shape, layout)
        if tuple(value.shape) != want:
            raise ValueError(f"state[{key!r}] has shape {tuple(value.shape)} but the model expects "
                             f"the full shape {want} (its local part is {tuple(target.shape)}).")
        if target.is_meta:
            raise ValueError(f"{key} is on the meta device; parallelize the model first (it "
                             "allocates each rank's parts) or call model.to_empty(device=...).")
        target.copy_(shard_of(value, layout) if layout else value)
    return missing, unexpected


def placements_for(tensor: torch.Tensor, dims: tuple[str, ...]):
    """DTensor placements over the mesh dims `dims` (e.g. the tensor dims) for `tensor`'s layout.

    DTensor splits a dim over its mesh dims left to right; where the layout splits a dim first
    over a later mesh dim (the 3D GCN's weight: input features, then depth), the inner axis gets
    a `_StridedShard` whose split factor is the size of those outer, later axes.
    """
    return _placements(layout_of(tensor), dims)


def _placements(layout: Layout, dims: tuple[str, ...]):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    layout = [(dim, axis) for dim, axis in layout if axis.size > 1]
    placements = [Replicate() for _ in dims]
    for i, (dim, axis) in enumerate(layout):
        where = dims.index(axis.name)
        factor = math.prod(a.size for d, a in layout[:i] if d == dim and dims.index(a.name) > where)
        placements[where] = _StridedShard(dim, split_factor=factor) if factor > 1 else Shard(dim)
    return placements


def tensor_dims(mesh) -> tuple[str, ...]:
    return tuple(d for d in mesh.plan.degrees() if d.startswith("tensor"))


def dtensor_state_dict(model: nn.Module, state: dict, mesh) -> dict:
    """Wrap every split tensor of `state` (keyed by parameter name, nested dicts allowed, as in
    DCP's optimizer state) into a DTensor on the mesh's tensor dims; others pass unchanged.

    A tensor is wrapped when its key names a split parameter and its shape is that parameter's
    local shape (so optimizer moments are wrapped and scalar step counters are not).

    Under tensor × shard a ZeRO / FSDP2 chunk of a split parameter arrives as a DTensor on the
    `shard` mesh whose whole is the tensor-parallel piece: it becomes a DTensor on the (shard,
    tensor) mesh whose layout is the piece's, then dim 0 chunked over shard. DTensor shards left
    to right over mesh dims, so when both split dim 0 the shard placement is a `_StridedShard`
    (torchtitan's FSDP2 + TP layout, see `placements_for`).
    """
    from torch.distributed.tensor import DTensor

    dims = tensor_dims(mesh)
    sub = mesh.device_mesh[dims] if len(dims) > 1 else mesh.device_mesh[dims[0]]
    split = {name: p for name, p in _state_tensors(model).items() if layout_of(p)}
    shard = mesh.axis("shard") if mesh.plan.shard > 1 else None
    with_shard = ("shard", *dims)
    sharded_sub = mesh.device_mesh[with_shard] if shard is not None else None

    def whole_shape(param):
        shape = list(param.shape)
        for dim, axis in layout_of(param):
            shape[dim] *= axis.size
        return torch.Size(shape)

    def wrap(value, param):
        if isinstance(value, dict):
            return {k: wrap(v, split.get(k, param) if isinstance(k, str) else param)
                    for k, v in value.items()}
        if is_dtensor(value):
            if (shard is None or param is None or value.shape != param.shape
                    or value.device_mesh.mesh_dim_names != ("shard",)):
                return value
            if param.shape[0] % shard.size:
                raise TensorSplitError(f"a checkpoint under {mesh.plan} needs dim 0 of every "
                                       f"tensor-parallel piece to divide over shard={shard.size}; "
                                       f"a piece of shape {tuple(param.shape)} does not.")
            shape = whole_shape(param)
            layout = layout_of(param) + ((0, shard),)
            return DTensor.from_local(value.to_local(), sharded_sub, _placements(layout, with_shard),
                                      run_check=False, shape=shape,
                                      stride=torch.empty(shape, device="meta").stride())
        if isinstance(value, torch.Tensor) and param is not None and value.shape == param.shape:
            return DTensor.from_local(value, sub, placements_for(param, dims), run_check=False)
        return value

    return wrap(state, None)


def for_checkpoint(model: nn.Module, state: dict) -> dict:
    """`state` (a model or optimizer state dict keyed by parameter name, e.g. from DCP's
    `get_state_dict`) ready for `torch.distributed.checkpoint.save` / `load`: split tensors become
    DTensors that share memory with the local tensors, so a load writes straight into them. A
    model without tensor parallelism gets `state` back unchanged.

    Without this, DCP sees one plain tensor per name on every rank, keeps one rank's part and
    drops the others' (it deduplicates what it takes for replicas).
    """
    inner = getattr(model, "module", model)
    stages = [getattr(s, "module", s) for s in getattr(model, "stage_wrappers", ())]  # pipe
    tp = next((getattr(m, "exatrain_tensor", None) for m in (model, inner, *stages)
               if getattr(m, "exatrain_tensor", None) is not None), None)
    return state if tp is None else dtensor_state_dict(model, state, tp.mesh)
