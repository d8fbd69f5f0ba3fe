"""The Python API: train your own model on your own data, under any Plan and any launcher.

    import exatrain as et
    summary = et.fit(model, train_set, val_set, loss=F.mse_loss,
                     metrics={"mae": lambda out, y: (out - y).abs()},
                     plan=et.Plan(data=2), train={"steps": 200, "batch_size": 8},
                     optim={"lr": 1e-3})

`fit` runs on every rank of the job: start the script with `torchrun --nproc-per-node N`,
`srun`, `exatrain run script.py --nproc N`, or, from a notebook, `et.launch(fn, nproc=N)` with
`fn` importable from a module. It uses the same Trainer, checkpoints, metrics.jsonl and
summary.json as `exatrain run`; the keyword sections are the config file's (run, plan, train,
optim, schedule, parallel), checked the same way.

The model: give an nn.Module built identically on every rank, or a zero-argument function
that builds it (called after seeding with run.seed, so every rank builds the same weights). A
module is made equal on every rank by a broadcast of its parameters and buffers from rank 0
(4 bytes per fp32 element, over the whole job, tag "control") before any strategy is applied.

The run is put together by `train.job.build`, as `exatrain run`'s is, so the options mean the
same: `run.init_from` loads its weights into the model (unless resuming), `parallel.precision`
runs it in bf16/fp16 with fp32 norm layers, and `data.stage_to` (from a `config` with a [data]
section, or EXATRAIN_STAGE_TO) copies the file or directory of each `et.data.HDF5Dataset` given
to node-local storage and reads the copy (other data sets are read where they are, said once).
"""

from __future__ import annotations

import contextvars
import dataclasses
import runpy
import sys
from pathlib import Path
from typing import Callable

import tomli_w
import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.data import Dataset, default_collate

from ..comm import broadcast, broadcast_object
from ..mesh import init
from ..plan import Plan, PlanError
from ..workloads.samples import check_sample
from ..workloads.user import Task, float64_input_named, uncompiled, workload_from_task
from .config import FIXED_SECTIONS, Config, ConfigError, build_section, load_config, validate
from .job import build, find_resume_checkpoint, make_run_dir, stage_data_sets


# the summaries of the fit calls of the script that run_script runs (None outside one)
_script_summaries: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "exatrain_script_summaries", default=None)


# set by `exatrain plan SCRIPT.py --world N` (`plan_script`): the script's first et.fit call
# predicts its Plans (`et.plans` on its model, first sample, loss and sections) instead of
# training, and stops the script (`ScriptPlanned`)
_plan_request: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "exatrain_plan_request", default=None)


class ScriptPlanned(Exception):
    """Raised by et.fit under `plan_script`: carries `et.plans`' (ranked, refused) and what they
    were predicted for; `plan_script` catches it (the script's later code does not run)."""

    def __init__(self, result: dict):
        super().__init__("et.fit planned, not run (exatrain plan SCRIPT.py)")
        self.result = result


def _plan_instead(request: dict, model, train_set, loss, config: Config, collate_fn=None):
    """What et.fit does under `exatrain plan SCRIPT.py`: no process group, no run directory, no
    step; the model is built (weights unused), traced on the first training sample under fake
    tensors with the script's loss and its target, at the sections' batch, optimizer and
    precision."""
    plans = request["planner"]  # et.plans, handed down by the plan command (tune sits above)
    built = uncompiled(model() if not isinstance(model, nn.Module) else model)[0]
    if collate_fn is not None:
        from ..errors import ArgumentError
        raise ArgumentError("exatrain plan models batches that stack samples along one dim; a "
                            "collate_fn's batches (graphs of different sizes) are not modelled. "
                            "Plan on a data set of padded samples of the largest size, or try "
                            "Plans with data, shard or 1D tensor on a short run.")
    check_sample("train_set", train_set)
    # the first sample as a batch of one, collated as the loader does (NumPy arrays become
    # tensors; a copy, where a TensorDataset's sample is a view of the whole set's tensor, which
    # the trace of saved tensors, `tune.spec.trace_saved_bytes`, would count whole by storage)
    x, target = default_collate([train_set[0]])

    # the planner traces batches of 1, 2 and 4: the target is repeated to the batch of the
    # input the model was last given (an output's first dim need not be the batch)
    traced = {"batch": 1}

    def traced_loss(out):
        n = traced["batch"]
        return loss(out, tree_map(lambda t: t.expand(n, *t.shape[1:]) if isinstance(t, torch.Tensor)
                                  and t.dim() and n > 1 else t, target))
    kwargs = dict(world=request["world"], batch=config.train.batch_size,
                  system=request.get("system", "cpu-local"),
                  precision=config.parallel.precision, optimizer=config.optim.name)
    hook = built.register_forward_pre_hook(lambda module, inputs: traced.update(
        batch=inputs[0].shape[0]))
    try:
        with float64_input_named(x):
            ranked, refused = plans(built, x, loss=traced_loss, refused=True, **kwargs)
    finally:
        hook.remove()
    raise ScriptPlanned({"model": type(built).__name__, "sample_shape": tuple(x.shape[1:]),
                         **kwargs, "ranked": ranked, "refused": refused})


def plan_script(path: str, world: int, planner, system: str = "cpu-local",
                argv: list[str] | None = None) -> dict:
    """Run a script that calls et.fit, in one process, until its first et.fit call, which
    predicts every Plan of `world` ranks for its model with `planner` (`et.plans`) instead of
    training (`exatrain plan SCRIPT.py --world N`). Returns `_plan_instead`'s result."""
    token = _plan_request.set({"world": world, "system": system, "planner": planner})
    try:
        run_script(path, argv)
    except ScriptPlanned as planned:
        return planned.result
    finally:
        _plan_request.reset(token)
    raise ConfigError(f"exatrain plan {path}: the script ended without calling exatrain.fit "
                      "(is the call under `if __name__ == \"__main__\":`? It runs as __main__).")


@dataclasses.dataclass
class NoOptions:
    """[model] and [data] of a job started from Python: the objects are given, not configured."""


def make_config(config=None, **sections) -> Config:
    """A Config from a TOML path, a Config, or nothing, with keyword sections on top."""
    if isinstance(config, (str, Path)):
        base = load_config(config)
    elif isinstance(config, Config):
        base = config
    elif config is None:
        base = None
    else:
        raise TypeError(f"config must be a TOML path or an exatrain Config, got {config!r}")
    unknown = set(sections) - set(FIXED_SECTIONS)
    if unknown:
        raise ConfigError(f"unknown section(s) {sorted(unknown)}; fit takes "
                          f"{', '.join(FIXED_SECTIONS)}")
    built = {}
    for name, cls in FIXED_SECTIONS.items():
        values = dataclasses.asdict(getattr(base, name)) if base is not None else {}
        values.update(sections.get(name) or {})
        built[name] = build_section(cls, values, name)
    if base is None or built["run"].workload == "cosmoflow":
        built["run"].workload = "python"
    out = Config(**built, model=base.model if base else NoOptions(),
                 data=base.data if base else NoOptions())
    validate(out)
    return out


def _same_on_every_rank(model: nn.Module, mesh) -> None:
    for t in [*model.parameters(), *model.buffers()]:
        if not t.is_meta:
            broadcast(t.data, mesh.world, src=0, tag="control")


def fit(model: nn.Module | Callable[[], nn.Module], train_set: Dataset, val_set: Dataset,
        loss: Callable, metrics: dict | None = None, *, plan: Plan | None = None,
        config: str | Path | Config | None = None, baselines: dict | None = None,
        resume: str | None = None, collate_fn: Callable | None = None,
        **sections: dict) -> dict:
    """Train `model` on `train_set`, evaluating on `val_set` every `train.eval_every` steps.

    Call it on every rank of the job (a plain process is one rank): start the script with
    `exatrain run SCRIPT --nproc N`, `torchrun`, `srun`, or `et.launch`. It writes a run
    directory (config.toml, metrics.jsonl, summary.json, checkpoints/) like `exatrain run`.

    Args:
        model: an `nn.Module` built the same way on every rank (rank 0's weights are broadcast),
            or a zero-argument function that builds it, called after seeding with `run.seed`.
        train_set: a map-style `Dataset` (`__getitem__` and `__len__`) of `(input, target)`,
            each one tensor or NumPy array (the target may be a number), batched as
            `DataLoader` batches them; other samples are refused before the first step, naming
            what they hold.
        val_set: the same for validation, evaluated every `train.eval_every` steps and at the
            end (the summary's `val_loss`); required.
        loss: `loss(output, target)` returning the batch-mean loss; `output` as the model
            returns it: one tensor, or a tuple, namedtuple, list or dict of them (several
            heads, an auxiliary loss).
        metrics: `{name: metric}`, each a callable `(output, target)` of per-sample values (a
            `Mean`), an `et.Mean` or an `et.Ratio`; reported as `val_<name>`.
        plan: the Plan; its product must equal the job's ranks. Default: `plan` section, else
            data parallelism over all ranks.
        config: a TOML path or a `Config` to start from; the keyword sections go on top.
        baselines: figures copied into the summary, e.g. `{"baseline_mae": 0.5}`.
        resume: a run directory to continue from its latest checkpoint.
        collate_fn: how a list of samples becomes a batch `(input, target)`, as `DataLoader`'s
            `collate_fn`, for samples that do not stack: graphs of different sizes (their nodes
            concatenated, the edges offset, a graph index per node). The target has one row per
            sample. Under data, shard and 1D tensor; pipe, space, 3D tensor over z, branches
            and K-FAC are refused by name, and `exatrain plan` does not model it. None: stacked.
        **sections: configuration sections as dicts, named as in a config file: `run`, `plan`,
            `train`, `optim`, `schedule`, `parallel`, `population`, `observe`, `mlperf`, e.g.
            `train={"steps": 200, "batch_size": 8}`; checked as a config file is.

    Returns:
        The run summary on every rank (also RUN_DIR/summary.json): `val_loss`, `val_<name>` of
        every metric, `steps`, `samples_per_s`, ... ([Run summary](summary.md)).
    """
    from ..launch import detect

    config = make_config(config, **sections)
    if _plan_request.get() is not None:   # `exatrain plan SCRIPT.py`: predict, do not train
        _plan_instead(_plan_request.get(), model, train_set, loss, config, collate_fn)
    launch = detect()
    world = launch.world_size if launch else 1
    if plan is None:
        plan = config.plan.resolve(world)
    elif plan.world_size != world:
        raise PlanError(
            f"{plan} needs {plan.world_size} ranks but this process is one of {world}. Start the "
            f"script with `exatrain run SCRIPT --nproc {plan.world_size}`, `torchrun "
            f"--nproc-per-node {plan.world_size} SCRIPT`, srun, or et.launch(fn, "
            f"nproc={plan.world_size}).")
    backend = None if config.run.backend == "auto" else config.run.backend
    mesh = init(plan, backend=backend, timeout_s=config.run.timeout_s)
    try:
        run_dir = None
        if mesh.rank == 0:
            run_dir = Path(resume) if resume else make_run_dir(config)
            (run_dir / "config.toml").write_text(tomli_w.dumps(config.to_dict()))
        run_dir = Path(broadcast_object(str(run_dir) if run_dir else None, mesh.world))
        data_sets = {"train_set": train_set, "val_set": val_set}

        def stage(config: Config, mesh) -> dict:
            """data.stage_to: the files of the given data sets, where exatrain can tell them."""
            figures, staged = stage_data_sets(config, mesh, data_sets)
            data_sets.update(staged)
            return figures

        def make_workload(config: Config, mesh):
            """The user's Task (after seeding with run.seed): the model built, or made equal on
            every rank. Under space the parallel model hands back whole outputs, so the user's
            loss and metrics are the serial ones; it cuts whole samples into blocks, or takes
            the blocks a data set with read(index, region) reads (workloads.user.reads_blocks)."""
            built = model() if not isinstance(model, nn.Module) else model.to(mesh.device)
            if isinstance(model, nn.Module):
                _same_on_every_rank(built, mesh)
            return workload_from_task(Task(model=built, loss=loss, metrics=dict(metrics or {}),
                                           baselines=dict(baselines or {}),
                                           collate_fn=collate_fn, **data_sets), mesh)

        trainer = build(config, mesh, make_workload, run_dir=run_dir, stage=stage,
                        resume_from=find_resume_checkpoint(resume) if resume else None).trainer
        try:
            summary = trainer.fit()
        except BaseException as exc:
            trainer.finished(None, exc)  # a tracked run that failed says so
            raise
        trainer.finished(summary)  # W&B, MLflow: the summary, pictures, logs; the end
        if _script_summaries.get() is not None:  # for `exatrain run SCRIPT` to print
            _script_summaries.get().append(summary)
        return summary
    finally:
        mesh.close()


def run_script(path: str, argv: list[str] | None = None) -> list[dict]:
    """Run a Python script as `__main__` with `argv` as its sys.argv[1:] (what every rank of
    `exatrain run SCRIPT -- ARGS` does); returns the summaries of the et.fit calls it made."""
    sys.argv = [str(path), *(argv or [])]
    token = _script_summaries.set([])
    try:
        runpy.run_path(str(path), run_name="__main__")
        return _script_summaries.get()
    finally:
        _script_summaries.reset(token)


def has_main_guard(source: str) -> bool:
    """Whether a script's top level has an `if __name__ == "__main__":` block."""
    import ast

    def is_guard(test) -> bool:
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1
                and isinstance(test.ops[0], ast.Eq)):
            return False
        sides = [test.left, test.comparators[0]]
        return any(isinstance(a, ast.Name) and a.id == "__name__" for a in sides) and \
            any(isinstance(a, ast.Constant) and a.value == "__main__" for a in sides)

    return any(isinstance(node, ast.If) and is_guard(node.test)
               for node in ast.parse(source).body)


def script_refusal(path: str | Path, start_method: str) -> str | None:
    """Why the script at `path` cannot run on ranks whose loader workers start by `start_method`
    (the platform's: fork on Linux, spawn on macOS and Windows), or None. A worker started by
    spawn or forkserver imports the main script again; without a `__main__` guard that runs its
    top level, et.fit included, once more inside the worker. Under fork a worker is a copy of
    its rank and imports nothing. (Refused whatever `train.num_workers` the script sets: that
    is known only once it runs.)"""
    if start_method == "fork":
        return None
    try:
        source = Path(path).read_text()
    except OSError:
        return None   # running it names the missing file
    if has_main_guard(source):
        return None
    return (f"{path} has no `if __name__ == \"__main__\":` guard, and loader workers here start "
            f"by {start_method!r}, which imports the script again in every worker (training "
            f"again there, where it waits for ranks that never come); put the script's "
            f"top-level code under the guard")


def launch(fn, nproc: int, args: tuple = ()) -> list:
    """Start `nproc` local ranks (e.g. from a notebook) running `fn(*args)`, or the script at
    path `fn` as `__main__` (with or without a `__main__` guard, as under torchrun); returns
    each rank's result. `fn` must be importable from a module (spawned ranks import it), not
    defined in a notebook cell."""
    import multiprocessing

    from ..launch import LaunchError, spawn
    if isinstance(fn, (str, Path)):
        # the ranks' loader workers start as the caller's processes do (launch.local)
        refusal = script_refusal(fn, multiprocessing.get_start_method())
        if refusal:
            raise LaunchError(refusal)
        return spawn(run_script, nproc, args=(str(fn), list(args)))
    return spawn(fn, nproc, args=tuple(args))
