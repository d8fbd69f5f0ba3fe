"""run_job: what every rank executes for `exatrain run` (under any launcher).

Restarts (`train.resilience.restart`): a run directory that outlives its processes -- EXATRAIN_RUN_DIR (set by
`exatrain run --max-restarts`) or, under torchrun, one named by TORCHELASTIC_RUN_ID -- is resumed
from its last complete checkpoint whenever the ranks start again.

The run is put together by `train.job.build`, the composition root it shares with the
population's driver and `et.fit`; joining the job, the run directory and the checkpoint to resume
are there too.
"""

from __future__ import annotations

import os
import shutil
import time

from .checkpoints import checkpoint
from .config import Config
# the composition root and setup steps shared with the population's driver and et.fit;
# ResumeError, pipeline_example and stage_input are still importable from here, as they were
from .job import (ResumeError, build, find_resume_checkpoint, join, pipeline_example,
                  prepare_run, stage_input)
from .resilience.elastic import Formation, elastic_launch
from .resilience.restart import cleanup_failed_start, record_failure, stable_run_dir

__all__ = ["setup", "run_job", "job_figures",
           # from .job, importable here as they were
           "ResumeError", "find_resume_checkpoint", "pipeline_example", "stage_input"]


def setup(config: Config, resume_dir: str | None = None,
          job_figures: dict | None = None) -> tuple:
    """Join the job, build workload, model and Trainer on this rank (`job.build`; `job_figures`:
    how the ranks were started, for the summary). Returns (mesh, trainer)."""
    setup_times = {"init_start": time.time()}  # MLPerf's init and staging phases
    mesh = join(config)
    run_dir = None
    stable = stable_run_dir(config)
    if resume_dir is None and stable is not None and checkpoint.latest(stable) is not None:
        resume_dir = str(stable)  # restarted: go on from the last complete checkpoint
    try:
        resume_from = find_resume_checkpoint(resume_dir) if resume_dir else None
        setup_times["staging_start"] = time.time()  # the data's preparation counts as staging
        workload_module, run_dir = prepare_run(config, mesh, resume_dir, stable)
        # torchrun --nnodes MIN:MAX: this start is one formation of the run (its accumulation
        # keeps the resumed micro-batch; the summary lists the re-formations)
        formation = Formation.begin(run_dir, mesh, resume_from, config) if elastic_launch() \
            else None
        built = build(config, mesh, workload_module.build, run_dir=run_dir,
                      resume_from=resume_from, setup_times=setup_times, job_figures=job_figures)
        if formation is not None:
            built.trainer.add_job_figures(formation.started(mesh.rank == 0))
        return mesh, built.trainer
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
        from ..population.run import run_population
        return run_population(config, resume_dir, figures)
    mesh, trainer = setup(config, resume_dir, figures)
    try:
        summary = trainer.fit()
        trainer.finished(summary)  # W&B, MLflow: the summary, pictures, logs; the end
        return summary
    except BaseException as exc:
        trainer.finished(None, exc)  # a tracked run that failed says so
        record_failure(trainer.run_dir, mesh.rank, mesh.ledger, trainer.step, exc)
        cleanup_failed_start(trainer.run_dir, mesh.rank, trainer.step,
                             resumed=resume_dir is not None)
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
