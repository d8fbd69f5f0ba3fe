"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, resumable on another Plan, atomic.

Layout of a run directory:

    RUN_DIR/checkpoints/step_00000100/   DCP files of model + optimizer, and trainer_state.json
    RUN_DIR/checkpoints/latest           the name of the newest complete checkpoint

Atomicity: every rank writes into `step_N.partial`; only after DCP has finished on all ranks does
rank 0 write trainer_state.json, rename the folder to `step_N` and then replace `latest` (both
renames are atomic on POSIX file systems). A crash at any moment leaves either the previous good
checkpoint or the new complete one under a final name, never a half-written one.

Verification (`train.checkpoints.manifest`): rank 0 writes `manifest.json` (step, plan, config hash,
versions, a SHA-256 per file and a CRC-32 per saved tensor chunk) into the partial folder before
the rename, and `load` checks every file against it before DCP reads anything, so a truncated or
altered checkpoint is refused by name. Nothing is unpickled from an unverified file.

Keep-last-K: after each commit only the newest `train.checkpoint_keep` checkpoints stay.

Asynchronous saving (`train.checkpoint_async`, `Writer`): DCP's `async_save` copies the state to
host memory and writes the files from a background thread over its own gloo group (a collective
from that thread must not interleave with training's collectives on the default group); the
commit (manifest, rename, `latest`, pruning) happens when the write has finished, at the next
save or at the end of `fit`. `Writer.blocked_s` is the time the training loop spent inside saves.

Model and optimizer state go through DCP's `get_state_dict`/`set_state_dict`, which key tensors by
fully-qualified parameter name whatever wrapper (DDP, FSDP2) holds them, so a checkpoint written
under one Plan loads under another. ZeRO-1/2 (`parallel.zero.ZeroDataParallel`), whose optimizer
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
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ...parallel.data import unwrap
from ...parallel.tensor.state import for_checkpoint
from . import manifest as manifests
from ...errors import UserError

STATE_FILE = "trainer_state.json"


# _dcp_note: torch.distributed.checkpoint is imported where it is used, not with this module: it
# pulls DTensor, FSDP and sympy (~830 files), which every rank would open at `import exatrain`,
# long before (or without ever) saving a checkpoint (docs/how-to/startup.md).


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be read into this run: incomplete, or its manifest does not fit
    the model or the Plan.

    What to do: resume from a complete checkpoint (the message names it), or start the run with
    the model the checkpoint was written by.
    """


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
         config: dict | None = None, before_commit=None, group=None) -> Path:
    """Collective over `group` (None: every rank). Returns the final checkpoint path."""
    return Writer(asynchronous=False, group=group).save(run_dir, step, model, optimizer,
                                                        trainer_state, keep, config, before_commit)


class Writer:
    """Saves checkpoints synchronously or (asynchronous=True) in the background; see above."""

    def __init__(self, asynchronous: bool = False, group=None):
        self.asynchronous = asynchronous
        self.group = group        # the ranks that save together (None: all; LTFB: one trainer)
        self.blocked_s = 0.0      # time the caller spent inside save() and wait()
        self.saves = 0
        self._pending = None      # (future, commit) of an asynchronous save still writing
        self._group = None

    def save(self, run_dir, step: int, model, optimizer, trainer_state: dict, keep: int = 2,
             config: dict | None = None, before_commit=None, group=None) -> Path:
        import torch.distributed.checkpoint as dcp  # (see _dcp_note)

        t0 = time.perf_counter()
        self.group = group if group is not None else self.group
        self._finish_pending()
        root = checkpoint_dir(run_dir)
        final = root / f"step_{step:08d}"
        partial = root / f"step_{step:08d}.partial"
        if dist.get_rank(self.group) == 0:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
        dist.barrier(group=self.group)
        model_state, optim_state = _state_dicts(model, optimizer)
        state = {"model": for_checkpoint(model, model_state),
                 "optim": for_checkpoint(model, optim_state)}
        chunks = manifests.local_chunks(state, "")
        info = {"step": step, "plan": trainer_state.get("plan", ""),
                "world_size": dist.get_world_size(self.group),
                "config_sha256": manifests.config_hash(config)}

        def commit() -> None:
            if before_commit is not None:
                before_commit()
            _commit(root, partial, final, trainer_state, info, chunks, keep, self.group)

        if self.asynchronous:
            if self._group is None:  # a collective: every rank creates it at its first save
                ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
                self._group = dist.new_group(ranks=ranks, backend="gloo")
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._group)
            self._pending = (future, commit)
        else:
            dcp.save(state, checkpoint_id=str(partial), process_group=self.group)
            commit()
        self.saves += 1
        self.blocked_s += time.perf_counter() - t0
        return final

    def wait(self) -> None:
        """Finish (and commit) an asynchronous save still in flight. Collective."""
        t0 = time.perf_counter()
        self._finish_pending()
        self.blocked_s += time.perf_counter() - t0

    def _finish_pending(self) -> None:
        if self._pending is not None:
            future, commit = self._pending
            self._pending = None
            result = future.result()
            if hasattr(result, "upload_completion"):  # AsyncSaveResponse
                result.upload_completion.result()
            commit()


def _commit(root: Path, partial: Path, final: Path, trainer_state: dict, info: dict,
            chunks: dict, keep: int, group=None) -> None:
    """Collective over `group`: after every member's files are written, its rank 0 seals the
    checkpoint."""
    rank0 = dist.get_rank(group) == 0
    gathered = [None] * dist.get_world_size(group) if rank0 else None
    dist.gather_object(chunks, gathered, group=group, group_dst=0)  # also: all have written
    if rank0:
        _write_atomic(partial / STATE_FILE, json.dumps(trainer_state, indent=1))
        manifests.write(partial, info, manifests.merge_chunks(gathered))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_atomic(root / "latest", final.name)
        for old in sorted(p for p in root.glob("step_*") if not p.name.endswith(".partial"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)


def verify(path: str | Path) -> dict:
    """Check a checkpoint's files against its manifest; returns the manifest."""
    return manifests.verify(Path(path), error=CheckpointError)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the lines of metrics.jsonl past `step` (a restarted run writes them again)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step]
    _write_atomic(path, "".join(line + "\n" for line in kept))


def last_logged_step(run_dir: str | Path) -> int:
    """The highest step in a run's metrics.jsonl (train.log_every=1: the last step completed);
    0 without one."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    return max((json.loads(line).get("step", 0) for line in path.read_text().splitlines()
                if line.strip()), default=0)


def full_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The full, unsharded model state dict of a checkpoint, read on one process (no process
    group): DCP reassembles every tensor from the chunks of whatever Plan wrote it. Verified
    against the manifest first, and each tensor against its chunks' CRC-32s where it was whole."""
    import torch.distributed.checkpoint as dcp  # (see _dcp_note)
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    manifest = verify(path)
    state: dict = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
    model = state["model"]
    for key, tensor in model.items():
        entry = manifest["tensors"].get(f"model.{key}")
        whole = ",".join(["0"] * tensor.dim())
        if entry and list(entry["crc32"]) == [whole] and \
                manifests.tensor_crc(tensor) != entry["crc32"][whole]:
            raise CheckpointError(f"checkpoint {path}: tensor model.{key} does not match the "
                                  "CRC-32 in its manifest.")
    return model


def load(path: str | Path, model, optimizer, group=None) -> dict:
    """Collective over `group` (None: every rank): load model and optimizer state in place;
    return the trainer state."""
    import torch.distributed.checkpoint as dcp  # (see _dcp_note)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{path} is not a complete exatrain checkpoint (no {STATE_FILE}).")
    verify(path)  # before DCP reads (and unpickles its metadata) anything
    zero = _zero_units(model)
    if zero:
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
    if zero:
        from ...parallel.zero import zero_load_optimizer_state_dict
        set_model_state_dict(unwrap(model), state["model"])
        zero_load_optimizer_state_dict(zero, optimizer, state["optim"])
        for unit in zero:
            unit.refresh_shards()
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    return json.loads((path / STATE_FILE).read_text())


def load_model(path: str | Path, model, group=None) -> dict:
    """Collective over `group`: load only the model state of a checkpoint in place (prediction:
    no optimizer is built). DCP reads the pieces this rank's layout needs, whatever Plan wrote
    them. Returns the trainer state (its `step`, `plan`)."""
    import torch.distributed.checkpoint as dcp  # (see _dcp_note)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{path} is not a complete exatrain checkpoint (no {STATE_FILE}).")
    verify(path)  # before DCP reads (and unpickles its metadata) anything
    zero = _zero_units(model)
    module = unwrap(model) if zero else model
    state = get_model_state_dict(module)
    dcp.load({"model": for_checkpoint(model, state)}, checkpoint_id=str(path), process_group=group)
    set_model_state_dict(module, state)
    for unit in zero:
        unit.refresh_shards()
    return json.loads((path / STATE_FILE).read_text())


def _zero_units(model) -> list:
    """The ZeRO-1/2 wrappers whose optimizer steps shards, not the model's parameters."""
    from ...parallel.zero import zero_units
    return zero_units(model)


def _state_dicts(model, optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts keyed by parameter name, whatever holds them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    zero = _zero_units(model)
    if zero:
        from ...parallel.zero import zero_optimizer_state_dict
        return get_model_state_dict(unwrap(model)), zero_optimizer_state_dict(zero, optimizer)
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
