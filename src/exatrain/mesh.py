"""init(plan): the process group and a DeviceMesh with named axes, and rank coordinates.

The mesh dimensions, outermost first, are Plan.degrees(): trainer, pipe, data, shard, space_d,
space_h, space_w, and tensor (1D) or tensor_x, tensor_y, tensor_z (3D). Ranks are laid out
row-major, so the innermost (most talkative) axes get neighbouring ranks: on a node with G GPUs,
the first G ranks of any innermost group share the node.

Backend: NCCL with one GPU per local rank when CUDA is present, gloo otherwise. A rank uses
the GPU at local_rank mod the number it sees (all of the node's, or only its own as `srun
--gpus-per-task 1` binds them), and two ranks on one physical GPU are refused by name
(`launch/gpus.py`). With
EXATRAIN_SHARE_GPU=1 the local ranks share the node's GPU(s) over gloo instead (rank r on GPU
r mod G): a check of multi-rank code with CUDA tensors on a machine with one GPU, where NCCL
refuses two ranks per device (scripts/gpu-figures.sh).
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .comm import Axis, Ledger
from .comm.inject import SlowLinks
from .launch.env import LaunchError, detect
from .launch.gpus import gpu_index, refuse_shared_gpus
from .launch.local import free_port
from .launch.teardown import tear_down
from .plan import Plan

SHARE_GPU_ENV = "EXATRAIN_SHARE_GPU"  # "1": local ranks share the GPU(s) over gloo

# Top-level axis name -> its mesh dimensions (space and tensor expand to several).
def _dims_of(plan: Plan, name: str) -> tuple[str, ...]:
    dims = tuple(plan.degrees())
    if name in dims:
        return (name,)
    expanded = tuple(d for d in dims if d.startswith(name + "_"))
    if not expanded:
        raise KeyError(f"unknown mesh axis {name!r}; axes are {', '.join(dims)} "
                       "(and the groups space, tensor)")
    return expanded


class Mesh:
    """The live counterpart of a Plan: process group, DeviceMesh, axes with groups, a ledger.

    Made by `et.init(plan)`, not by hand. `mesh.axis("data")` is an axis's group,
    `mesh.coords` this rank's coordinates, `mesh.ledger` the communication ledger.
    """

    def __init__(self, plan: Plan, device: torch.device, backend: str, device_mesh: DeviceMesh,
                 local_rank: int, keep_group: bool = False):
        self.plan = plan
        self.keep_group = keep_group  # see close()
        self.device = device
        self.backend = backend
        self.device_mesh = device_mesh
        self.local_rank = local_rank
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.ledger = Ledger(slow=SlowLinks.from_env(self.rank))  # EXATRAIN_INJECT_SLOW: tests
        self.group = None  # the job's process group for whole-job collectives (None: the default)
        self._grid = torch.arange(self.world_size).reshape(tuple(plan.degrees().values()))
        self._axes: dict[tuple[str, ...], Axis] = {}

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate along every mesh dimension."""
        where = (self._grid == self.rank).nonzero()[0].tolist()
        return dict(zip(self.plan.degrees(), where))

    def coord(self, name: str) -> int:
        """This rank's position along an axis or group of axes (row-major over its dims)."""
        return self.axis(name).rank

    def axis(self, *names: str) -> Axis:
        """The Axis over the product of the named axes, e.g. axis("data"), axis("data", "space").

        Groups are created on first use; every rank must ask for the same axes in the same order
        (true for SPMD code), because creating a group is itself collective.
        """
        dims = tuple(d for n in names for d in _dims_of(self.plan, n))
        key = tuple(sorted(dims, key=list(self.plan.degrees()).index))
        if key in self._axes:
            return self._axes[key]
        order = list(self.plan.degrees())
        positions = [order.index(d) for d in key]
        rest = [i for i in range(len(order)) if i not in positions]
        size = math.prod(self._grid.shape[i] for i in positions)
        rows = self._grid.permute(*rest, *positions).reshape(-1, size).tolist()
        mine = next(row for row in rows if self.rank in row)
        group = None
        if size > 1:
            if size == self.world_size:
                group = dist.group.WORLD
            elif len(key) == 1:  # the DeviceMesh made this dimension's groups already
                group = self.device_mesh.get_group(key[0])
            else:
                # new_group is collective over the whole world: create every row, keep ours.
                for row in rows:
                    g = dist.new_group(row)
                    if row is mine:
                        group = g
        axis = Axis("+".join(names), size, mine.index(self.rank), group, self.ledger, tuple(mine))
        self._axes[key] = axis
        return axis

    @property
    def world(self) -> Axis:
        """The whole job as one axis."""
        return self.axis("trainer", "pipe", "data", "shard", "space", "tensor")

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Release the mesh. A launched job's process group (env:// rendezvous on the launcher's
        MASTER_PORT) stays for the next mesh of the same process, which reuses it: creating it
        again on the same port hangs both ranks in `init_process_group` (measured, torch 2.13),
        which is what a second `predict`, `fit` or tuner measurement in one launch met. The
        process's own single-rank group and the planner's fake group are destroyed."""
        if dist.is_initialized() and not self.keep_group:
            dist.destroy_process_group()

    def trainer_mesh(self) -> "TrainerMesh":
        """This rank's trainer as a mesh of its own (collective: every rank calls it once)."""
        return TrainerMesh(self)


class TrainerMesh:
    """One trainer of the population, seen as a job of its own.

    It has the parent's interface (plan, rank, world_size, axis, world, coords, ledger, device,
    device_mesh) with the `trainer` dimension taken away: its plan is the intra-trainer Plan
    (trainer=1), its ranks are numbered 0.. within the trainer exactly as a job of that size
    numbers them, and every axis is the parent's group for the same dims, which never spans two
    trainers (a group spans only the dims it names, and `trainer` is never among them). So every
    strategy, the Trainer and the workloads run unchanged inside one trainer; only the
    population code asks the parent for the `trainer` axis: the K ranks, one per trainer, at this
    rank's position inside its trainer (the "corresponding ranks" that exchange models).

    `group` is a real process group over the trainer's ranks even when it has only one rank
    (collective checkpointing needs a group that excludes the other trainers).
    """

    def __init__(self, parent: Mesh):
        self.parent = parent
        self.plan = parent.plan.intra_trainer()
        self.device, self.backend = parent.device, parent.backend
        self.local_rank, self.ledger = parent.local_rank, parent.ledger
        # slicing it by dim names (FSDP2's shard mesh, the tensor dims) gives this rank's sub-mesh
        self.device_mesh = parent.device_mesh
        self.trainers = parent.plan.trainer
        self.trainer_axis = parent.axis("trainer")
        self.trainer = self.trainer_axis.rank
        self.world = parent.axis("pipe", "data", "shard", "space", "tensor")
        self.rank, self.world_size = self.world.rank, parent.world_size // self.trainers
        rows = parent._grid.reshape(self.trainers, -1).tolist()
        self.group = None
        for row in rows:  # new_group is collective over the whole world: make all, keep ours
            g = dist.new_group(row) if self.trainers > 1 else dist.group.WORLD
            if parent.rank in row:
                self.group = g

    def axis(self, *names: str) -> Axis:
        names = tuple(n for n in names if n != "trainer")
        if not names:
            return Axis("trainer-local", 1, 0, None, self.ledger, (self.parent.rank,))
        return self.parent.axis(*names)

    @property
    def coords(self) -> dict[str, int]:
        return {k: v for k, v in self.parent.coords.items() if k != "trainer"}

    def coord(self, name: str) -> int:
        return self.axis(name).rank

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        self.parent.close()


def init(plan: Plan, backend: str | None = None, timeout_s: float = 600.0) -> Mesh:
    """Create (or join) the process group and the named mesh for `plan`.

    The rank and rendezvous come from the launcher's environment (torchrun, Slurm, flux, LSF,
    Open MPI/PMI, or `exatrain run --nproc N`); a plain process is world size 1.
    A Plan whose product is not the world size, or that uses an axis not implemented yet, is
    refused here, before any work starts.

    Args:
        plan: the Plan; its product must be the job's world size.
        backend: `"nccl"` or `"gloo"`; default nccl where there is a GPU, else gloo.
        timeout_s: seconds a collective may wait before the job fails with a timeout.
    """
    launch = detect()
    world = launch.world_size if launch else 1
    plan.validate(world)
    plan.require_implemented()
    local_rank = launch.local_rank if launch else 0
    share = os.environ.get(SHARE_GPU_ENV) == "1"
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and not share else "gloo"
    if share and not torch.cuda.is_available():
        raise LaunchError(
            f"rank {launch.rank if launch else 0}: {SHARE_GPU_ENV}=1 puts every rank's tensors "
            f"on a shared GPU, but this machine has no CUDA device; unset {SHARE_GPU_ENV} to "
            "run on the CPU.")
    cuda = backend == "nccl" or share
    if cuda:  # the GPU this rank sees at local_rank mod visible: all of the node's, or its own
        index = gpu_index(local_rank, torch.cuda.device_count(), launch.rank if launch else 0)
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # imported before the default group exists: its functions take `group=group.WORLD` as a
        # default argument, evaluated at import, which would hold this group (and on rank 0 the
        # TCPStore server) past destroy_process_group to the interpreter's finalization, where
        # their threads are joined in no order (launch.teardown). torch imports it lazily, with
        # torch._dynamo, after init when nothing has imported it before.
        importlib.import_module("torch.distributed.nn.functional")
        if launch:
            launch.export(os.environ)
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{free_port()}"
        rank = launch.rank if launch else 0
        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, world = next(dist.rendezvous(init_method, rank, world, timeout=timeout))
        store.set_timeout(timeout)
        if backend == "nccl" and world > 1:  # NCCL fails on a shared GPU far from the cause
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            refuse_shared_gpus(store, rank, world, uuid, device.index,
                               os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        # the prefix init_process_group gives a store it rendezvoused itself
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
        if launch:
            # the group stays for the next mesh (Mesh.close); a script under srun or torchrun
            # ends without `exatrain run` to end it, so the group made here is ended at exit,
            # while the interpreter is whole (once, however many times init made one)
            atexit.unregister(tear_down)
            atexit.register(tear_down)
    device_mesh = init_device_mesh(device.type, tuple(plan.degrees().values()),
                                   mesh_dim_names=tuple(plan.degrees()))
    return Mesh(plan, device, backend, device_mesh, local_rank, keep_group=launch is not None)
