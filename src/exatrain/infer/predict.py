"""Prediction: run a trained model over a data set under any Plan; write the outputs to HDF5.

    exatrain predict RUN_DIR [--data PATH] [--out FILE] [--nproc N] [--set plan.space=[1,1,2]]
    et.predict(run_dir, data, out, plan=et.Plan(space=(1, 1, 2)))   # on every rank of the job

What every rank does:

1. Read the run's `config.toml` (with `--set` overrides; a `plan` argument replaces its [plan])
   and rebuild the workload exactly as training did, so inputs get the same transforms
   (CosmoFlow standardises with statistics of the run's training samples: they must be readable
   at `data.path`, or pass `--set data.path=DIR`).
2. Lay the model out under the Plan as training does (`train.job.lay_out`: `parallelize`, and
   under bf16/fp16 norm layers that compute in fp32) and load only the model state of the
   newest (or `step`) checkpoint: DCP reads whatever this layout needs, so a checkpoint trained
   under one Plan predicts under another; no optimizer state is built.
3. Split the samples over the replica axes (data, shard) in global batches: global batch b is
   samples [b·B·R, (b+1)·B·R), replica r takes its r-th slice of B. Under `space` each rank
   reads only its block of every sample (an HDF5 hyperslab) and the model's blocks exchange
   halos, so a sample too large for one device is predicted whole. A replica whose slice of the
   last batch is empty runs one padding sample (a split or sharded forward is collective) and
   drops its output.
4. The first rank of each replica (space and tensor coordinates 0) holds the outputs; they are
   gathered over the replica axis per batch and rank 0 appends them to the file, so the file is
   written once, in sample order, with no duplicates. The file is written under a temporary name
   and renamed when complete.

Output layout (HDF5):

    predictions          (N, *output) float32   the model's outputs, in the workload's target units
    predictions/NAME     (N, *output) float32   instead, each output of a model returning several
                                                (a tuple, list or dict: NAME its key or position)
    sample_id            (N,) str               the data set's own ids (file names), else the index
    index                (N,) int64             position in the data set
    targets              (N, *target)           when the data carry targets
    predictions_physical (N, K), targets_physical   de-normalised, when the workload normalises
                                                    its targets (CosmoFlow: Omega_m, sigma_8, n_s, H0)
    attrs: run_dir, checkpoint, step, plan, world_size, workload, data, output_names, units, ...
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..plan import Plan
from ..train.checkpoints import checkpoint
from ..train.config import Config, load_config
from ..errors import UserError
from ..parallel.nested import call_on, cut_batch, fp32, map_tensors
from .writer import OutputMeaning, PredictionWriter


class PredictError(UserError, ValueError):
    """A run directory, data set or option that `exatrain predict` cannot use.

    What to do: the message names what would work: a run directory with a checkpoint, data of
    the shape the model was trained on, a Plan the checkpoint can be read under.
    """


# ------------------------------------------------------------------ what the outputs mean
@dataclass
class PredictAdapter:
    """Per workload: what its outputs mean and how to open a data set given by path."""
    meaning: Callable[[Config], OutputMeaning] = lambda config: OutputMeaning()
    # open_data(path, config, mesh, workload) -> (data set of whole or block samples, base set)
    open_data: Callable | None = None


def _cosmoflow_meaning(config) -> OutputMeaning:
    """The outputs are targets normalised over the training data's parameter ranges: those in its
    file's attributes (synthetic data), else the generator's (MLPerf data carry no ranges)."""
    from ..data.cosmoflow import PARAM_HIGH, PARAM_LOW, PARAM_NAMES, parameter_ranges
    lo, hi = parameter_ranges(Path(config.data.path), (PARAM_LOW, PARAM_HIGH))
    return OutputMeaning(
        names=PARAM_NAMES, units=("", "", "", "km/s/Mpc"),
        to_physical=lambda y: (lo + (np.asarray(y, dtype=np.float64) + 1) / 2 * (hi - lo)),
        normalisation="y = 2 (p - low) / (high - low) - 1 with low = "
                      f"{lo.tolist()}, high = {hi.tolist()}")


def _cosmoflow_open(path, config, mesh, workload):
    """A CosmoFlow file, per-sample directory, or data directory (its validation split)."""
    from ..data.cosmoflow import CosmoFlowDataset
    path = Path(path)
    if path.is_dir():
        for split in ("val.h5", "validation", "val"):
            if (path / split).exists():
                path = path / split
                break
    base_val = _base(workload.val_set)
    try:
        data_set = CosmoFlowDataset(path, transform=base_val.transform)
    except FileNotFoundError as exc:
        raise PredictError(f"--data {path}: {exc}") from None
    size = config.model.size
    if data_set.sample_shape[:3] != (size,) * 3:
        cube = "×".join(map(str, data_set.sample_shape[:3]))
        raise PredictError(
            f"--data {path} holds {cube} samples of {data_set.sample_shape[3]} channels, but the "
            f"run's model takes {size}³ samples (model.size={size} in its config.toml). Predict "
            f"with {size}³ data (e.g. `exatrain data cosmoflow --size {size} --out DIR`), or with "
            f"a run trained at model.size={data_set.sample_shape[0]}.")
    return _blocks(data_set, data_set.sample_shape[:3], mesh), data_set


def _hdf5_open(path, config, mesh, workload):
    """Any workload whose validation set is an `et.data.HDF5Dataset` (a user's own): the same
    layout at PATH, with the same dataset names and transform."""
    from ..data.arrays import HDF5Dataset
    like = _base(workload.val_set)
    data_set = HDF5Dataset(path, x=like.x_name, y=like.y_name, transform=like.transform,
                           channels=like.channels)
    if data_set.sample_shape != like.sample_shape:
        raise PredictError(
            f"--data {path} holds samples of shape {data_set.sample_shape} ('{like.x_name}'), but "
            f"the run's model was trained on samples of shape {like.sample_shape} (its validation "
            f"set {like.path}). Predict with data of that shape, or with a run trained on these.")
    return _blocks(data_set, data_set.sample_shape[1:], mesh), data_set


ADAPTERS: dict[str, PredictAdapter] = {
    # (this belongs beside the workload's build(); kept here while workloads/cosmoflow.py is
    # being changed elsewhere)
    "cosmoflow": PredictAdapter(meaning=_cosmoflow_meaning, open_data=_cosmoflow_open),
}


def _base(data_set):
    """The data set under a SpatialBlocks (or other) wrapper."""
    while hasattr(data_set, "dataset") and not hasattr(data_set, "sample_ids"):
        data_set = data_set.dataset
    return data_set


def _blocks(data_set, spatial_shape, mesh):
    if mesh.plan.space_degree == 1:
        return data_set
    from ..parallel.spatial import SpatialBlocks, block_region
    return SpatialBlocks(data_set, block_region(tuple(spatial_shape), mesh))


# ------------------------------------------------------------------ run directory
def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """The checkpoint to predict with: the newest complete one, or the one of `step`."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        what = "no such directory" if not run_dir.is_dir() else "it has no config.toml"
        raise PredictError(f"exatrain predict {run_dir}: not a run directory ({what}); pass the "
                           "directory `exatrain run` printed (runs/NAME-DATE-TIME).")
    if (run_dir / "trainer_00").is_dir():
        raise PredictError(f"exatrain predict {run_dir}: a population run (one run per trainer); "
                           f"pass one trainer's directory, e.g. {run_dir / 'trainer_00'}.")
    root = checkpoint.checkpoint_dir(run_dir)
    if step is not None:
        path = root / f"step_{step:08d}"
        if not (path / checkpoint.STATE_FILE).is_file():
            have = sorted(int(p.name[5:]) for p in root.glob("step_*")
                          if (p / checkpoint.STATE_FILE).is_file())
            raise PredictError(f"exatrain predict {run_dir} --step {step}: no complete checkpoint "
                               f"of that step; the run has {have or 'none'}.")
        return path
    path = checkpoint.latest(run_dir)
    if path is None:
        raise PredictError(
            f"exatrain predict {run_dir}: the run holds no complete checkpoint (looked in {root}). "
            "A run writes one at its end and every train.checkpoint_every steps: let it finish, "
            f"or resume it with `exatrain run --resume {run_dir}`.")
    return path


def run_config(run_dir: str | Path, overrides=(), plan: Plan | None = None) -> Config:
    """The run's configuration with `--set` overrides; `plan` replaces its [plan] section."""
    config = load_config(Path(run_dir) / "config.toml", list(overrides))
    if plan is not None:
        p = config.plan
        p.trainer, p.pipe, p.data, p.shard = plan.trainer, plan.pipe, plan.data, plan.shard
        p.space = list(plan.space)
        p.tensor = list(plan.tensor) if isinstance(plan.tensor, tuple) else [plan.tensor]
    return config


def check_plan(plan: Plan) -> Plan:
    """Prediction runs under data, shard (ZeRO-1/2/3) and space; refuse the other axes."""
    for axis, degree in (("trainer", plan.trainer), ("pipe", plan.pipe),
                         ("tensor", plan.tensor_degree)):
        if degree > 1:
            raise PredictError(f"predict under {plan}: the {axis} axis is not supported for "
                               "prediction yet; put those ranks on data, shard (weights too "
                               f"large for one device) or space (samples too large), e.g. "
                               f"--set plan.{axis}=1.")
    return plan.require_implemented()


def replica_batches(n: int, per_replica: int, replicas: int, replica: int) -> list[list[int]]:
    """This replica's sample indices, batch by batch: global batch b is samples
    [b·B·R, (b+1)·B·R) and replica r takes its r-th slice of B. Every replica runs the same
    number of batches (a split or sharded forward is collective): an empty slice of the last
    batch becomes one padding sample, [n - 1], whose output is dropped."""
    global_batch = per_replica * replicas
    out = []
    for b in range(math.ceil(n / global_batch)):
        lo = b * global_batch + replica * per_replica
        out.append(list(range(lo, min(lo + per_replica, n))) or [n - 1])
    return out


# ------------------------------------------------------------------ the job
def predict(run_dir: str | Path, data: str | Path | None = None, out: str | Path | None = None,
            plan: Plan | None = None, *, step: int | None = None, batch_size: int = 0,
            overrides: tuple[str, ...] | list[str] = (), verbose: bool = True) -> dict:
    """Predict with the model of `run_dir` over `data` (default: the run's validation set) and
    write `out` (default RUN_DIR/predictions.h5). Runs on every rank of the job (like `fit`);
    returns the summary on every rank. Without a launcher, a Plan of more than one rank (given,
    or the run's) has its ranks started here, locally.

    Args:
        run_dir: a finished (or checkpointed) run directory.
        data: data in a layout the run's workload reads; default: its validation set.
        out: the output HDF5 file; default RUN_DIR/predictions.h5.
        plan: the Plan to predict under; default: the run's.
        step: a checkpoint's step; default: the latest.
        batch_size: samples per batch; 0: the run's `train.batch_size`.
        overrides: `"section.key=value"` strings applied to the run's config.
        verbose: print progress and the summary on rank 0.
    """
    from ..launch import detect
    from ..mesh import init

    run_dir = Path(run_dir)
    path = find_checkpoint(run_dir, step)
    config = run_config(run_dir, overrides, plan)
    launch = detect()
    if launch is None and ranks_needed(config) > 1:  # no launcher: start the ranks here
        from ..launch import spawn
        check_plan(config.plan.resolve(ranks_needed(config)))  # refuse before spawning
        kwargs = dict(run_dir=str(run_dir), data=data, out=out, plan=plan, step=step,
                      batch_size=batch_size, overrides=list(overrides), verbose=verbose)
        return spawn(predict_rank, ranks_needed(config), args=(kwargs,))[0]
    world = launch.world_size if launch else 1
    resolved = check_plan(config.plan.resolve(world))
    out = Path(out) if out else run_dir / "predictions.h5"
    backend = None if config.run.backend == "auto" else config.run.backend
    mesh = init(resolved, backend=backend, timeout_s=config.run.timeout_s)
    try:
        return _predict_on(mesh, config, run_dir, path, data, out, batch_size, verbose)
    finally:
        mesh.close()


def _predict_on(mesh, config: Config, run_dir: Path, path: Path, data, out: Path,
                batch_size: int, verbose: bool) -> dict:
    """predict() on this rank of a live mesh."""
    from ..comm import all_gather_object, broadcast_object
    from ..data.loader import collate, no_inherited_garbage
    from ..data.arrays import HDF5Dataset
    from ..parallel.data import unwrap
    from ..parallel.precision import Precision
    from ..parallel.spatial import gather_output
    from ..workloads import get_workload
    from ..train.job import lay_out

    resolved = mesh.plan
    torch.manual_seed(config.run.seed)
    module = get_workload(config.run.workload)
    try:
        workload = module.build(config, mesh)
    except FileNotFoundError as exc:
        raise PredictError(
            f"exatrain predict rebuilds the run's workload from {run_dir / 'config.toml'}, "
            f"which reads the data at data.path={getattr(config.data, 'path', '?')!r} (input "
            f"statistics come from the training samples): {exc}. Make those data readable "
            "there, or pass --set data.path=DIR.") from None
    adapter = ADAPTERS.get(config.run.workload, PredictAdapter())
    if adapter.open_data is None and isinstance(_base(workload.val_set), HDF5Dataset):
        adapter = PredictAdapter(open_data=_hdf5_open)
    if data is None:
        data_set, data_name = workload.val_set, "the run's validation set"
    elif adapter.open_data is None:
        raise PredictError(
            f"--data: the {config.run.workload!r} workload has no reader for a data set given "
            "by path; leave --data out to predict the run's validation set, and point it at "
            "your data with --set data.<key>=PATH (the keys of its [data] section).")
    else:
        data_set, _ = adapter.open_data(data, config, mesh, workload)
        data_name = str(data)
    if len(data_set) == 0:
        raise PredictError(f"--data {data_name}: the data set has no samples.")
    # laid out as training lays it out (train.job.lay_out): whole samples or blocks, compile, and
    # under bf16/fp16 its norm layers computing in fp32, so prediction computes what training did
    model = lay_out(workload, config, mesh, training=False)
    state = checkpoint.load_model(path, model)
    model = unwrap(model)
    model.eval()
    precision = Precision(config.parallel.precision, mesh.device)
    meaning = adapter.meaning(config)
    replica_axis = mesh.axis("data", "shard") if resolved.shard > 1 else mesh.axis("data")
    leader = all(v == 0 for k, v in mesh.coords.items()
                 if k.startswith(("space", "tensor")))
    split_outputs = resolved.space_degree > 1 and "space" in workload.metric_axes
    per_replica = max(1, (batch_size or config.train.batch_size) // replica_axis.size)
    writer = PredictionWriter(out, meaning) if mesh.rank == 0 else None
    n = len(data_set)
    base = _base(data_set)
    ids = [str(i) for i in base.sample_ids()] if hasattr(base, "sample_ids") \
        else [str(i) for i in range(n)]
    batches = replica_batches(n, per_replica, replica_axis.size, replica_axis.rank)
    workers = max(0, config.train.num_workers)
    with no_inherited_garbage(workers):   # starts the workers
        loader = iter(torch.utils.data.DataLoader(data_set, batch_sampler=batches,
                                                  collate_fn=workload.collate_fn or collate,
                                                  num_workers=workers))
    failure = None
    start = time.perf_counter()
    try:
        with torch.no_grad():
            for b, batch in enumerate(loader):
                x, y = (batch[0], batch[1]) if isinstance(batch, (list, tuple)) else (batch, None)
                with precision.autocast():
                    output = call_on(model, workload.decode_inputs(
                        map_tensors(x, lambda t: t.to(mesh.device))))
                if split_outputs:
                    output = gather_output(output, mesh)
                if not leader:
                    continue
                first = (b * replica_axis.size + replica_axis.rank) * per_replica
                keep = max(0, min(per_replica, n - first))  # 0: a padding sample
                rows = len(batches[b])   # the batch's samples (a collate_fn's graphs: not rows)
                mine = (first, keep, map_tensors(fp32(cut_batch(output, keep, rows)),
                                                 torch.Tensor.cpu),
                        None if y is None else y[:keep])
                parts = all_gather_object(mine, replica_axis, tag="predict")
                if writer is not None and failure is None:
                    try:
                        for lo, count, rows, targets in parts:
                            if count:
                                writer.append(lo, rows, targets, ids[lo:lo + count])
                    except Exception as exc:  # tell the others below, do not strand them
                        failure = exc
    except BaseException:
        if writer is not None:
            writer.abandon()
        raise
    wall = time.perf_counter() - start
    summary = None
    if writer is not None:
        if failure is None:
            try:
                summary = writer.close(attrs={
                    "run_dir": str(run_dir.resolve()), "checkpoint": str(path.resolve()),
                    "step": int(state["step"]), "plan": str(resolved),
                    "trained_plan": str(state.get("plan", "")), "world_size": mesh.world_size,
                    "workload": config.run.workload, "data": data_name,
                    "precision": config.parallel.precision,
                    "config": (run_dir / "config.toml").read_text()})
            except Exception as exc:
                failure = exc
        if failure is not None:
            writer.abandon()
            summary = {"error": f"{type(failure).__name__}: {failure}"}
        else:
            summary.update(samples=n, wall_s=wall, samples_per_s=n / wall, out=str(out),
                           step=int(state["step"]), checkpoint=str(path), plan=str(resolved),
                           world_size=mesh.world_size, data=data_name,
                           input_bytes_read_rank0=int(getattr(data_set, "bytes_read", 0)))
    summary = broadcast_object(summary, mesh.world)
    if "error" in summary:
        if failure is not None:
            raise failure
        raise RuntimeError(f"rank 0 could not write {out}: {summary['error']}")
    if verbose and mesh.rank == 0:
        print(format_summary(summary), flush=True)
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"exatrain predict: {summary['samples']} samples of {summary['data']} in "
             f"{summary['wall_s']:.2f} s ({summary['samples_per_s']:.1f} samples/s) under "
             f"{summary['plan']} on {summary['world_size']} rank(s), checkpoint step "
             f"{summary['step']}",
             f"  wrote {summary['out']}"]
    if "mae" in summary:
        text = f"  MAE vs targets {summary['mae']:.4f}"
        physical = summary.get("mae_physical")
        if physical:
            units = dict(zip(summary.get("outputs", ()), summary.get("units", ())))
            text += " (normalised); per target: " + ", ".join(
                f"{n} {v:.4g}{' ' + units[n] if units.get(n) else ''}" for n, v in physical.items())
        lines.append(text)
    return "\n".join(lines)


def predict_rank(kwargs: dict) -> dict:
    """What each spawned rank of `exatrain predict --nproc N` runs."""
    return predict(**kwargs)


def ranks_needed(config: Config) -> int:
    """The fewest ranks the configured Plan runs on (plan.data = 0 fills: 1 replica)."""
    p = config.plan
    return math.prod([p.trainer, p.pipe, p.data or 1, p.shard, *p.space, *p.tensor])
