"""Joining the job and preparing its run: the setup steps that every entry point shares.

`run_job` (train/run.py), the population's driver (train/population.py) and `et.fit`
(train/fit.py) each build their own Trainer, but they join the job, name and create the run
directory, find the checkpoint to resume and shape the pipeline's example batch alike, here.
Nothing here imports them: they (and `resilience.restart`) import this module.
"""

from __future__ import annotations

import time
from pathlib import Path

import tomli_w
import torch

from ..comm import broadcast_object
from ..errors import UserError, relayed
from ..mesh import init
from ..workloads import get_workload
from .checkpoints import checkpoint
from .config import Config


class ResumeError(UserError, FileNotFoundError):
    """`--resume DIR` names a directory that holds no complete checkpoint to resume.

    What to do: name a run directory with a checkpoint, or start a new run (no `--resume`).
    """


def fresh_run_dir(config: Config) -> Path:
    """A new run directory's path, `OUT_DIR/NAME-YYYYmmdd-HHMMSS[-n]` (not created)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # a user workload is named by its file or module: "dir/unet.py:build" -> "unet"
    name = config.run.name or Path(config.run.workload.split(":")[0]).name.removesuffix(".py")
    base = Path(config.run.out_dir) / f"{name.split('.')[-1]}-{stamp}"
    path, n = base, 1
    while path.exists():
        path, n = Path(f"{base}-{n}"), n + 1
    return path


def make_run_dir(config: Config, stable: Path | None = None) -> Path:
    if stable is not None:
        stable.mkdir(parents=True, exist_ok=True)
        return stable
    path = fresh_run_dir(config)
    path.mkdir(parents=True)
    return path


def find_resume_checkpoint(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ResumeError(f"--resume {run_dir}: no such run directory.")
    path = checkpoint.latest(run_dir)
    if path is None and (run_dir / "trainer_00").is_dir():  # a population: one run per trainer
        path = checkpoint.latest(run_dir / "trainer_00")
    if path is None:
        raise ResumeError(
            f"--resume {run_dir}: it holds no complete checkpoint (looked in "
            f"{checkpoint.checkpoint_dir(run_dir)}). Checkpoints are written every "
            f"train.checkpoint_every steps and at the end; start a new run instead.")
    return path


def pipeline_example(workload, config: Config, plan) -> "torch.Tensor | None":
    """One per-replica batch of inputs, from which `pipe` traces the model and sizes its stages
    (under space: this rank's blocks, where the data set reads blocks). Under space × tensor
    without pipe: the whole samples' batch as a shape on the meta device (read from one sample),
    from which the channel/filter switch point is placed by the byte rule of
    parallel/tensor/switch.py, as the planner does."""
    per_replica = config.train.batch_size // (plan.data * plan.shard)
    if plan.pipe == 1:
        if plan.space_degree == 1 or plan.tensor_degree == 1 or plan.tensor_3d:
            return None
        block = workload.decode_inputs(workload.train_set[0][0].unsqueeze(0)).shape[1:]
        parts = tuple(plan.space)[4 - len(block):]          # the blocks' (d, h, w) split
        if not workload.input_blocks:                       # the data set holds whole samples
            parts = (1,) * len(parts)
        whole = (block[0], *(n * p for n, p in zip(block[1:], parts)))
        return torch.empty((per_replica, *whole), device="meta")
    return workload.decode_inputs(torch.stack([workload.train_set[i][0] for i in range(per_replica)]))


def join(config: Config):
    """Join the job: the mesh of the configured Plan over this launch's ranks (this rank's host
    malloc set up per run.host_memory first)."""
    from ..launch import detect
    from ..launch.host_memory import keep_freed_host_memory

    keep_freed_host_memory(config.run.host_memory)

    launch = detect()
    plan = config.plan.resolve(launch.world_size if launch else 1)
    backend = None if config.run.backend == "auto" else config.run.backend
    return init(plan, backend=backend, timeout_s=config.run.timeout_s)


def prepare_run(config: Config, mesh, resume_dir: str | None, stable: Path | None = None):
    """Collective: rank 0 prepares the data and the run directory (`stable`: the one that
    outlives restarts, see train.restart). Returns (workload module, run directory) on every
    rank."""
    workload_module = get_workload(config.run.workload)
    failure = None
    if mesh.rank == 0:
        try:
            workload_module.prepare(config)
        except Exception as exc:  # tell the others now, or they wait out run.timeout_s
            failure = exc
    relay = broadcast_object(relayed(failure, "prepare the data") if failure else None,
                             mesh.world)
    if failure is not None:
        raise failure
    if relay is not None:
        cls, message = relay
        raise cls(message)
    if mesh.rank == 0:
        run_dir = Path(resume_dir) if resume_dir else make_run_dir(config, stable)
        (run_dir / "config.toml").write_text(tomli_w.dumps(config.to_dict()))
    else:
        run_dir = None
    return workload_module, Path(broadcast_object(str(run_dir) if run_dir else None, mesh.world))
