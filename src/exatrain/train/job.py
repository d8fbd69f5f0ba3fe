"""The composition root of a run, and the setup steps every entry point shares.

`build` is the one place a run is put together, in this order:

    stage the input -> seed -> workload -> run.init_from -> parallelize (+ fp32 norms)
    -> Trainer (its optimizer, precision, compile counters) -> staging/setup figures -> resume

`exatrain run` (`run.setup`), the population's driver (`population.run.setup_population`) and
`et.fit` (`fit.fit`) all call it, so `run.init_from`, `data.stage_to` (and EXATRAIN_STAGE_TO),
`parallel.precision`, `parallel.compile`, whole samples or blocks (`workload.spatial_io()`) and
the pipeline's example batch mean the same through each. What differs is passed in: how the
workload is made (a built-in or `module:build` workload, a population member's partition, a
user's Task), how its input is staged (`stage_input`: data.path; `stage_data_sets`: the files
of et.fit's data sets) and which Trainer holds it (the population's). `exatrain predict`
(infer/predict.py) builds no Trainer, but lays its model out with `lay_out`, training's step.

Also here: joining the job, naming and creating the run directory, finding the checkpoint to
resume. The set-up's looks at a user's model and data are `train.user_checks`'. Nothing here imports the entry points: they (and `resilience.restart`) import this
module.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import tomli_w
import torch

from ..comm import broadcast_object
from ..errors import UserError, relayed
from ..mesh import init
from ..parallel import parallelize
from ..parallel.precision import Precision, keep_norms_fp32
from ..workloads import get_workload
from .checkpoints import checkpoint
from .config import Config
from .resilience.elastic import plan_for_world
from .user_checks import (check_collate, check_derivatives, check_equals_plain,
                          check_the_loss_is_a_batch_mean, find_reads_outside, first_inputs)


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
    if path is None and (run_dir / "group_00").is_dir():  # replica groups: a run per group start
        path = latest_group_checkpoint(run_dir / "group_00")
    if path is None:
        raise ResumeError(
            f"--resume {run_dir}: it holds no complete checkpoint (looked in "
            f"{checkpoint.checkpoint_dir(run_dir)}). Checkpoints are written every "
            f"train.checkpoint_every steps and at the end; start a new run instead.")
    return path


def latest_group_checkpoint(group_dir: Path) -> Path | None:
    """The newest complete checkpoint of a replica group (`[fault_tolerance]`): each start of
    the group has its own run directory under `RUN/group_KK/`."""
    found = [p for p in map(checkpoint.latest, group_dir.iterdir() if group_dir.is_dir() else [])
             if p is not None]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def pipeline_example(workload, config: Config, plan) -> "torch.Tensor | None":
    """One per-replica batch of inputs, from which `pipe` traces the model and sizes its stages
    (under space: this rank's blocks, where the data set reads blocks). Under space × tensor
    without pipe: the whole samples' batch as a shape on the meta device (read from one sample),
    from which the channel/filter switch point is placed by the byte rule of
    parallel/tensor/switch.py, as the planner does."""
    per_replica = config.train.batch_size // (plan.data * plan.shard)
    inputs = lambda n: first_inputs(workload, n)
    switch = plan.space_degree > 1 and plan.tensor_degree > 1 and not plan.tensor_3d
    if (plan.pipe > 1 or switch) and not isinstance(inputs(1), torch.Tensor):
        from ..errors import DataError
        how = ("pipe's stages pass one tensor from stage to stage" if plan.pipe > 1 else
               "the switch from space to tensor is placed from one input's shapes")
        raise DataError(
            f"{plan}: the model takes several inputs, and {how}. Give the model one input (the "
            f"extra ones as channels, or concatenated and split in forward), or use a Plan "
            f"without {'pipe' if plan.pipe > 1 else 'space × tensor'} (data, shard, tensor and "
            f"space take several).")
    if plan.pipe == 1:
        if plan.space_degree == 1 or plan.tensor_degree == 1 or plan.tensor_3d:
            return None
        block = workload.decode_inputs(inputs(1)).shape[1:]
        parts = tuple(plan.space)[4 - len(block):]          # the blocks' (d, h, w) split
        if not workload.input_blocks:                       # the data set holds whole samples
            parts = (1,) * len(parts)
        whole = (block[0], *(n * p for n, p in zip(block[1:], parts)))
        return torch.empty((per_replica, *whole), device="meta")
    return workload.decode_inputs(inputs(per_replica))


def join(config: Config):
    """Join the job: the mesh of the configured Plan over this launch's ranks (this rank's host
    malloc set up per run.host_memory first)."""
    from ..launch import detect
    from ..launch.host_memory import keep_freed_host_memory

    keep_freed_host_memory(config.run.host_memory)

    launch = detect()
    # under torchrun --nnodes MIN:MAX a restart may find fewer (or more) ranks: data follows them
    options = config.plan
    if config.fault_tolerance.enabled:  # this replica group's ranks form a job of their own
        from .resilience.replicas import group_plan_options
        options = group_plan_options(config)
    plan = plan_for_world(options, launch.world_size if launch else 1)
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


# ---------------------------------------------------------------------- staging the input
def staging_dir(config: Config) -> str:
    """Where this run stages its input: EXATRAIN_STAGE_TO (a batch script's override), else
    data.stage_to; "" for none (also for a [data] section without the key)."""
    from ..data.stage import STAGE_ENV
    return os.environ.get(STAGE_ENV) or getattr(config.data, "stage_to", "") or ""


def stage_input(config: Config, mesh) -> dict:
    """Collective: copy the files this run reads (the workload's `input_files(config)`, else all
    of data.path) to node-local storage when `data.stage_to` (or the EXATRAIN_STAGE_TO
    environment variable) names a directory, and point data.path at the copy; under
    data.shuffle = "node" each node copies only its shard of per-sample training files.
    Returns the staging figures for the summary (empty when nothing is staged)."""
    from ..data.stage import stage_files
    if not hasattr(config.data, "stage_to"):  # a user's workload: its data are its own business
        return {}
    to = staging_dir(config)
    if not to:
        return {}
    listed = getattr(get_workload(config.run.workload), "input_files", None)
    result = stage_files(Path(config.data.path), Path(to), mesh,
                         files=(lambda: listed(config)) if listed else None,
                         node_shard=getattr(config.data, "shuffle", "global") == "node")
    config.data.path = str(result.path)  # the copy, for this process's workload only
    return result.figures()


def stage_data_sets(config: Config, mesh, data_sets: dict) -> tuple[dict, dict]:
    """Collective: `data.stage_to` (or EXATRAIN_STAGE_TO) for data sets given as objects
    (`et.fit`): each `et.data.HDF5Dataset` among `data_sets` ({name: data set}) has its file or
    directory staged as `stage_input` stages data.path, and is opened again on the copy (same
    dataset names, transform and channel layout). Data sets that are not files exatrain reads
    are read where they are, and rank 0 says so. Returns (staging figures, the data sets)."""
    from ..data.arrays import HDF5Dataset
    from ..data.stage import stage_files
    to = staging_dir(config)
    if not to:
        return {}, data_sets
    out, figures, staged = dict(data_sets), [], {}
    for name, ds in data_sets.items():
        if type(ds) is not HDF5Dataset:  # a subclass may read more than its path: leave it
            if mesh.rank == 0:
                print(f"exatrain: data.stage_to={to}: {name} ({type(ds).__name__}) is not an "
                      "et.data.HDF5Dataset, so exatrain cannot tell which files it reads; it is "
                      "read where it is.", file=sys.stderr, flush=True)
            continue
        key = ds.path.resolve()
        if key not in staged:
            result = stage_files(ds.path, Path(to), mesh)
            staged[key] = result.path
            figures.append(result.figures())
        out[name] = HDF5Dataset(staged[key], x=ds.x_name, y=ds.y_name, transform=ds.transform,
                                channels=ds.channels)
    return _merged_figures(figures), out


def _merged_figures(figures: list[dict]) -> dict:
    """One data set's staging figures, or several summed (their directories joined)."""
    if len(figures) < 2:
        return figures[0] if figures else {}
    out = {k: sum(f[k] for f in figures) for k in figures[0]
           if k not in ("stage_copier_rank", "staged_to")}
    out["stage_copier_rank"] = figures[0]["stage_copier_rank"]
    out["staged_to"] = ", ".join(f["staged_to"] for f in figures)
    return out


# ---------------------------------------------------------------------- the composition root
def lay_out(workload, config: Config, mesh, training: bool = True):
    """The workload's model laid out over `mesh` per config.parallel (`parallelize`: the
    pipeline's example batch, whole samples or blocks per `workload.spatial_io()`, compile),
    its norm layers computing in fp32 under a mixed `parallel.precision`, for training and
    prediction (`training=False`: a forward's own derivative is taken once, not twice) alike."""
    find_reads_outside(workload, mesh)
    check_derivatives(workload, config, mesh, training)
    options = config.parallel
    if workload.compile:   # the user's torch.compile(model): compiled after the layout
        options = dataclasses.replace(options, compile=True)
    model = parallelize(workload.model, mesh, options,
                        example=pipeline_example(workload, config, mesh.plan),
                        **workload.spatial_io())
    if Precision(config.parallel.precision, mesh.device).mixed:
        keep_norms_fp32(model)
    return model


@dataclass
class Built:
    """A run put together by `build`."""
    mesh: object          # the mesh the model and the Trainer live on (a trainer's, in a population)
    workload: object      # its model is the laid-out one
    model: object
    trainer: object
    staged: dict = field(default_factory=dict)  # staging figures (empty when nothing was staged)


def build(config: Config, mesh, make_workload: Callable, *, run_dir: Path | None,
          resume_from: Path | None = None, stage: Callable = stage_input,
          make_trainer: Callable | None = None, job_mesh=None,
          setup_times: dict | None = None, job_figures: dict | None = None) -> Built:
    """Collective: put a run together on this rank (see the module doc for the order).

    Args:
        config: the run's config (a population member's, in a population).
        mesh: the mesh the model is laid out over and trained on.
        make_workload: `(config, mesh) -> Workload`, called after staging and seeding.
        run_dir: the run directory the Trainer writes.
        resume_from: a checkpoint to resume; `run.init_from` is then not applied.
        stage: `(config, mesh) -> figures`, staging the input (over `job_mesh`).
        make_trainer: `(mesh, workload, config, model, run_dir=, console=, **figures) -> Trainer`,
            `figures` being the Trainer's keywords setup_times, stage_figures and job_figures.
        job_mesh: the whole job's mesh (default `mesh`): it stages, and its rank 0 prints.
        setup_times: the MLPerf setup phases so far (e.g. init_start); staging's are added.
        job_figures: how the ranks were started (`run.job_figures`), in the summary.
    """
    from ..launch import detect
    from ..observe.console import TrainConsole
    from .trainer import Trainer

    job_mesh = job_mesh or mesh
    times = dict(setup_times or {})
    times.setdefault("staging_start", time.time())
    staged = stage(config, job_mesh)
    times["staging_stop"] = time.time()
    if staged:
        times["staged_bytes"] = staged["staged_bytes"]
    torch.manual_seed(config.run.seed)  # identical initial weights on every rank
    workload = make_workload(config, mesh)
    check_collate(workload, config, mesh)
    if config.run.init_from and not resume_from:
        from .checkpoints.export import load_initial_weights
        load_initial_weights(workload.model, config.run.init_from)
    check_the_loss_is_a_batch_mean(workload, config, mesh)   # training only: not in lay_out
    model = lay_out(workload, config, mesh)
    check_equals_plain(workload, model, config, mesh)        # training only: not in lay_out
    workload.model = model  # drop the plain model: under tensor plans it is the full size
    console = TrainConsole() if job_mesh.rank == 0 else None
    make_trainer = make_trainer or Trainer
    launch = detect()
    times["local_world_size"] = launch.local_world_size if launch else 1
    trainer = make_trainer(mesh, workload, config, model, run_dir=run_dir, console=console,
                           setup_times=times, stage_figures=staged, job_figures=job_figures)
    if resume_from:
        trainer.resume(resume_from)
        if console:
            console.print(f"resumed from {resume_from} at step {trainer.step}")
    return Built(mesh, workload, model, trainer, staged)
