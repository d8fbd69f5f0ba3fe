"""run_job: what every rank executes for `exatrain run` (under any launcher)."""

from __future__ import annotations

import time
from pathlib import Path

import tomli_w
import torch

from ..comm import broadcast_object
from ..mesh import init
from ..parallel import parallelize
from ..workloads import get_workload
from . import checkpoint
from .config import Config
from .console import TrainConsole
from .trainer import Trainer


class ResumeError(FileNotFoundError):
    pass


def make_run_dir(config: Config) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(config.run.out_dir) / f"{config.run.name or config.run.workload}-{stamp}"
    path, n = base, 1
    while path.exists():
        path, n = Path(f"{base}-{n}"), n + 1
    path.mkdir(parents=True)
    return path


def find_resume_checkpoint(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ResumeError(f"--resume {run_dir}: no such run directory.")
    path = checkpoint.latest(run_dir)
    if path is None:
        raise ResumeError(
            f"--resume {run_dir}: it holds no complete checkpoint (looked in "
            f"{checkpoint.checkpoint_dir(run_dir)}). Checkpoints are written every "
            f"train.checkpoint_every steps and at the end; start a new run instead.")
    return path


def pipeline_example(workload, config: Config, plan) -> "torch.Tensor | None":
    """One per-replica batch of inputs, from which `pipe` traces the model and sizes its stages."""
    if plan.pipe == 1:
        return None
    per_replica = config.train.batch_size // (plan.data * plan.shard)
    return torch.stack([workload.train_set[i][0] for i in range(per_replica)])


def setup(config: Config, resume_dir: str | None = None) -> tuple:
    """Join the job, build workload, model and Trainer on this rank. Returns (mesh, trainer)."""
    from ..launch import detect

    launch = detect()
    plan = config.plan.resolve(launch.world_size if launch else 1)
    backend = None if config.run.backend == "auto" else config.run.backend
    mesh = init(plan, backend=backend, timeout_s=config.run.timeout_s)
    try:
        workload_module = get_workload(config.run.workload)
        failure = None
        if mesh.rank == 0:
            try:
                workload_module.prepare(config)
            except Exception as exc:  # tell the others now, or they wait out run.timeout_s
                failure = exc
        message = broadcast_object(f"{type(failure).__name__}: {failure}" if failure else None,
                                   mesh.world)
        if failure is not None:
            raise failure
        if message is not None:
            raise RuntimeError(f"rank 0 could not prepare the data: {message}")
        resume_from = find_resume_checkpoint(resume_dir) if resume_dir else None
        if mesh.rank == 0:
            run_dir = Path(resume_dir) if resume_dir else make_run_dir(config)
            (run_dir / "config.toml").write_text(tomli_w.dumps(config.to_dict()))
        else:
            run_dir = None
        run_dir = Path(broadcast_object(str(run_dir) if run_dir else None, mesh.world))
        torch.manual_seed(config.run.seed)  # identical initial weights on every rank
        workload = workload_module.build(config, mesh)
        model = parallelize(workload.model, mesh, config.parallel,
                            example=pipeline_example(workload, config, plan))
        workload.model = model  # drop the plain model: under tensor plans it is the full size
        console = TrainConsole() if mesh.rank == 0 else None
        trainer = Trainer(mesh, workload, config, model, run_dir=run_dir, console=console)
        if resume_from:
            trainer.resume(resume_from)
            if console:
                console.print(f"resumed from {resume_from} at step {trainer.step}")
        return mesh, trainer
    except BaseException:
        mesh.close()
        raise


def run_job(config: Config, resume_dir: str | None = None) -> dict:
    """Train per `config` on this rank; returns the run summary."""
    mesh, trainer = setup(config, resume_dir)
    try:
        return trainer.fit()
    finally:
        mesh.close()
