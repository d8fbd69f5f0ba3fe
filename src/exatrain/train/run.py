"""run_job: what every rank executes for `exatrain run` (under any launcher).

Restarts (`train.restart`): a run directory that outlives its processes -- EXATRAIN_RUN_DIR (set by
`exatrain run --max-restarts`) or, under torchrun, one named by TORCHELASTIC_RUN_ID -- is resumed
from its last complete checkpoint whenever the ranks start again.

The setup steps it shares with the population's driver and `et.fit` (joining the job, the run
directory, the checkpoint to resume, the pipeline's example batch) are in `train.job`.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from ..parallel import parallelize
from ..workloads import get_workload
from .checkpoints import checkpoint
from .config import Config
# the setup steps shared with the population's driver and et.fit; ResumeError is still
# importable from here, as it was
from .job import (ResumeError, find_resume_checkpoint, join, pipeline_example,  # noqa: F401
                  prepare_run)
from .monitor.console import TrainConsole
from .resilience.restart import cleanup_failed_start, record_failure, stable_run_dir
from .trainer import Trainer


def stage_input(config: Config, mesh) -> dict:
    """Collective: copy the files this run reads (the workload's `input_files(config)`, else all
    of data.path) to node-local storage when `data.stage_to` (or the EXATRAIN_STAGE_TO
    environment variable) names a directory, and point data.path at the copy; under
    data.shuffle = "node" each node copies only its shard of per-sample training files.
    Returns the staging figures for the summary (empty when nothing is staged)."""
    from ..data.stage import STAGE_ENV, stage_files
    if not hasattr(config.data, "stage_to"):  # a user's workload: its data are its own business
        return {}
    stage_to = os.environ.get(STAGE_ENV) or config.data.stage_to
    if not stage_to:
        return {}
    listed = getattr(get_workload(config.run.workload), "input_files", None)
    result = stage_files(Path(config.data.path), Path(stage_to), mesh,
                         files=(lambda: listed(config)) if listed else None,
                         node_shard=getattr(config.data, "shuffle", "global") == "node")
    config.data.path = str(result.path)  # the copy, for this process's workload only
    return result.figures()


def setup(config: Config, resume_dir: str | None = None) -> tuple:
    """Join the job, build workload, model and Trainer on this rank. Returns (mesh, trainer)."""
    setup_times = {"init_start": time.time()}  # MLPerf's init and staging phases
    mesh = join(config)
    run_dir = None
    stable = stable_run_dir(config)
    if resume_dir is None and stable is not None and checkpoint.latest(stable) is not None:
        resume_dir = str(stable)  # restarted: go on from the last complete checkpoint
    try:
        resume_from = find_resume_checkpoint(resume_dir) if resume_dir else None
        setup_times["staging_start"] = time.time()
        workload_module, run_dir = prepare_run(config, mesh, resume_dir, stable)
        staged = stage_input(config, mesh)
        setup_times["staging_stop"] = time.time()
        if staged:
            setup_times["staged_bytes"] = staged["staged_bytes"]
        torch.manual_seed(config.run.seed)  # identical initial weights on every rank
        workload = workload_module.build(config, mesh)
        if config.run.init_from and not resume_from:
            from .checkpoints.export import load_initial_weights
            load_initial_weights(workload.model, config.run.init_from)
        model = parallelize(workload.model, mesh, config.parallel,
                            example=pipeline_example(workload, config, mesh.plan),
                            **workload.spatial_io())
        workload.model = model  # drop the plain model: under tensor plans it is the full size
        console = TrainConsole() if mesh.rank == 0 else None
        trainer = Trainer(mesh, workload, config, model, run_dir=run_dir, console=console)
        trainer.stage_figures = staged
        from ..launch import detect
        launch = detect()
        trainer.observer.setup_times.update(setup_times,
                                            local_world_size=launch.local_world_size if launch else 1)
        if resume_from:
            trainer.resume(resume_from)
            if console:
                console.print(f"resumed from {resume_from} at step {trainer.step}")
        return mesh, trainer
    except BaseException:
        if mesh.rank == 0 and run_dir is not None and not resume_dir and stable is None:
            shutil.rmtree(run_dir, ignore_errors=True)  # failed before its first step: no trace
        mesh.close()
        raise


def run_job(config: Config, resume_dir: str | None = None,
            restart_history: list[dict] | None = None) -> dict:
    """Train per `config` on this rank; returns the run summary. `restart_history`: given by
    `exatrain run`'s supervisor (`resilience.restart.supervise`), the restarts before this start."""
    figures = job_figures(restart_history)
    if config.plan.trainer > 1:
        from .population import run_population
        return run_population(config, resume_dir, figures)
    mesh, trainer = setup(config, resume_dir)
    trainer.job_figures = figures
    try:
        summary = trainer.fit()
        trainer.observer.finished(summary)  # W&B, MLflow: the summary, pictures, logs; the end
        return summary
    except BaseException as exc:
        trainer.observer.finished(None, exc)  # a tracked run that failed says so
        record_failure(trainer, exc)
        cleanup_failed_start(trainer, resumed=resume_dir is not None)
        raise
    finally:
        mesh.close()


def job_figures(restart_history: list[dict] | None) -> dict:
    """The summary's figures of how the ranks were started: `launcher` (launch.detect; "local"
    when none, as for `exatrain run --nproc N`'s own ranks); under Slurm `requeues`, how often
    the scheduler requeued this job (SLURM_RESTART_COUNT; the batch script of
    `--print-batch-script slurm` requeues on the wall-time warning); under `exatrain run`'s
    supervisor `restarts`, `restart_history` and `lost_steps` (steps trained again)."""
    from ..launch import detect
    from ..launch.local import SPAWNED_ENV

    launch = detect()  # before init, which exports torchrun's variables for torch.distributed
    out = {"launcher": "local" if launch is None or os.environ.get(SPAWNED_ENV)
           else launch.source}
    if "SLURM_JOB_ID" in os.environ:
        out["requeues"] = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if restart_history is not None:
        out.update(restarts=len(restart_history), restart_history=restart_history,
                   lost_steps=sum(h["failed_after_step"] - h["resumed_from_step"]
                                  for h in restart_history))
    return out
