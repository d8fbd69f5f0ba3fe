"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, resumable on another Plan, atomic.

Layout of a run directory:

    RUN_DIR/checkpoints/step_00000100/   DCP files of model + optimizer, and trainer_state.json
    RUN_DIR/checkpoints/latest           the name of the newest complete checkpoint

Atomicity: every rank writes into `step_N.partial`; only after DCP has finished on all ranks does
rank 0 write trainer_state.json, rename the folder to `step_N` and then replace `latest` (both
renames are atomic on POSIX file systems). A crash at any moment leaves either the previous good
checkpoint or the new complete one under a final name, never a half-written one.

Model and optimizer state go through DCP's `get_state_dict`/`set_state_dict`, which key tensors by
fully-qualified parameter name whatever wrapper (DDP, FSDP2) holds them, so a checkpoint written
under one Plan loads under another. ZeRO-1/2 (`parallel.shard.ZeroDataParallel`), whose optimizer
steps per-rank chunks rather than the model's parameters, writes the same layout itself: the full
model state, and optimizer state keyed by parameter name as `Shard(0)` DTensors, exactly what
FSDP2 (ZeRO-3) writes. DCP reads whatever pieces the loading Plan needs, so a checkpoint moves
between stages, shard degrees and world sizes (e.g. ZeRO-3 on 4 ranks to plain data parallelism
on 2).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from ..parallel.tensor.state import for_checkpoint

STATE_FILE = "trainer_state.json"


class CheckpointError(RuntimeError):
    pass


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    root = checkpoint_dir(run_dir)
    marker = root / "latest"
    if marker.is_file():
        path = root / marker.read_text().strip()
        if (path / STATE_FILE).is_file():
            return path
    complete = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file()
                      and not p.name.endswith(".partial"))
    return complete[-1] if complete else None


def save(run_dir: str | Path, step: int, model, optimizer, trainer_state: dict, keep: int = 2,
         group=None) -> Path:
    """Collective over `group` (None: every rank). Returns the final checkpoint path."""
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:08d}"
    partial = root / f"step_{step:08d}.partial"
    rank0 = dist.get_rank(group) == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
    dist.barrier(group=group)
    model_state, optim_state = _state_dicts(model, optimizer)
    dcp.save({"model": for_checkpoint(model, model_state),
              "optim": for_checkpoint(model, optim_state)}, checkpoint_id=str(partial),
             process_group=group)
    if rank0:
        _write_atomic(partial / STATE_FILE, json.dumps(trainer_state, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_atomic(root / "latest", final.name)
        for old in sorted(p for p in root.glob("step_*") if not p.name.endswith(".partial"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return final


def load(path: str | Path, model, optimizer, group=None) -> dict:
    """Collective over `group` (None: every rank): load model and optimizer state in place;
    return the trainer state."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{path} is not a complete exatrain checkpoint (no {STATE_FILE}).")
    zero = _zero(model)
    if zero is not None:
        _init_optimizer_state(optimizer)  # DCP loads into existing tensors
    model_state, optim_state = _state_dicts(model, optimizer)
    # Hyperparameters come from the config (and the schedule, every step), not the checkpoint:
    # DCP keeps one rank's `param_groups`, which under `pipe` names only that rank's layers.
    live_groups = copy.deepcopy(optim_state.get("param_groups"))
    # tensor-parallel parts become DTensors sharing memory with the local tensors: DCP loads
    # straight into model_state / optim_state, resharding from whatever grid wrote them
    dcp.load({"model": for_checkpoint(model, model_state),
              "optim": for_checkpoint(model, optim_state)}, checkpoint_id=str(path),
             process_group=group)
    if live_groups is not None:
        optim_state["param_groups"] = live_groups
    state = {"model": model_state, "optim": optim_state}
    if zero is not None:
        set_model_state_dict(zero.module, state["model"])
        zero.load_optimizer_state_dict(optimizer, state["optim"])
        zero.refresh_shards()
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    return json.loads((path / STATE_FILE).read_text())


def _zero(model):
    from ..parallel.shard import ZeroDataParallel
    return model if isinstance(model, ZeroDataParallel) else None


def _state_dicts(model, optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts keyed by parameter name, whatever holds them."""
    zero = _zero(model)
    if zero is not None:
        return get_model_state_dict(zero.module), zero.optimizer_state_dict(optimizer)
    return get_state_dict(model, optimizer)


@torch.no_grad()
def _init_optimizer_state(optimizer) -> None:
    """Create the optimizer's lazily-built state (a step with zero gradients and lr 0)."""
    missing = [p for g in optimizer.param_groups for p in g["params"] if not optimizer.state.get(p)]
    if not missing:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in missing:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
