"""Elastic re-formation under torchelastic (`torchrun --nnodes MIN:MAX --max-restarts N`).

When a node is lost (or one joins), torchrun's agents stop the workers of the nodes that are
left, agree on a new membership (c10d rendezvous) and start the workers again with the new
WORLD_SIZE. Each start of `exatrain run` is then a *formation* of the same run: it finds its run
directory (named by TORCHELASTIC_RUN_ID, `restart.stable_run_dir`), resumes from the last
complete checkpoint, and trains on a Plan that fits the ranks it has:

- Plan: `plan.data = 0` (the default) lets `data` take what the other axes leave; `pipe`,
  `shard`, `space` and `tensor` are the config's, fixed. A re-formation whose world the fixed axes
  do not divide is refused by name (`plan_for_world`): the job then needs at least that many
  ranks (`--nnodes MIN` no lower than it).
- Global batch, learning-rate schedule and sample order: `train.batch_size` is the global batch;
  step s takes the same samples whatever the number of replicas (trainer.py, "Batches"), and the
  schedule runs on steps. Fewer replicas give each a larger share, which `keep_micro_batch` turns
  into gradient accumulation where it would grow past the micro-batch the resumed checkpoint's
  formation ran (the largest known to fit in a rank's memory): each rank then takes that
  micro-batch, `grad_accum` times a step. Under `pipe` the share is cut by the pipeline's
  micro-batches instead (grad_accum stays 1).
- Every formation writes one line to RUN_DIR/formations.jsonl (rank 0): its world size and Plan,
  the step it resumed from, the steps redone (the last step the previous formation logged minus
  that step) and the seconds lost (from the resumed checkpoint's commit to this formation's
  first step: everything in between is either redone or waiting). The summary's `reformations`
  lists every formation after the first, with `world_sizes` [before, after].

metrics.jsonl keeps every step once: resuming drops its lines past the checkpoint's step
(`Trainer.resume`), which the new formation then writes again.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ...plan import Plan, PlanError
from ..checkpoints.checkpoint import STATE_FILE, last_logged_step, truncate_metrics

FORMATIONS_FILE = "formations.jsonl"


def elastic_launch() -> bool:
    """Whether torchelastic (torchrun) started this process: its agent may start it again."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return bool(run_id) and run_id != "none"


def plan_for_world(options, world_size: int) -> Plan:
    """The Plan of `options` (config.plan) on `world_size` ranks. Under torchrun after a restart
    (TORCHELASTIC_RESTART_COUNT > 0) a Plan that no longer fits is refused as a re-formation,
    naming the fixed axes and the ranks they need."""
    try:
        return options.resolve(world_size)
    except PlanError as exc:
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        if not elastic_launch() or restarts == 0:
            raise
        tensor = options.tensor[0] if len(options.tensor) == 1 else tuple(options.tensor)
        fixed = Plan(trainer=options.trainer, pipe=options.pipe, shard=options.shard,
                     space=tuple(options.space), tensor=tensor)
        axes = ", ".join(f"{a}={getattr(fixed, a)}" for a in ("trainer", "pipe", "shard", "space",
                                                              "tensor")
                         if getattr(fixed, a) not in (1, (1, 1, 1)))
        hint = ("set plan.data = 0 so that the data replicas follow the world"
                if options.data else
                f"only the data replicas shrink; {axes or 'the other axes'} need a multiple of "
                f"{fixed.world_size} ranks: keep at least that many (torchrun --nnodes MIN:MAX "
                f"with MIN nodes holding {fixed.world_size} ranks or more)")
        raise PlanError(f"the job re-formed on {world_size} ranks (torchrun restart {restarts}) "
                        f"and its Plan cannot shrink to them: {exc} For an elastic job, {hint}."
                        ) from exc


def checkpoint_state(path: Path | None) -> dict:
    """The trainer state of checkpoint `path` (its step, world size, micro-batch); {} for none."""
    if path is None or not (Path(path) / STATE_FILE).is_file():
        return {}
    return json.loads((Path(path) / STATE_FILE).read_text())


def keep_micro_batch(config, plan: Plan, resumed: dict) -> int:
    """Set `config.train.grad_accum` so that this formation's per-rank micro-batch is no larger
    than the one the resumed checkpoint's formation ran (`resumed["micro_batch"]`): the smallest
    accumulation, at least the configured one, that splits the global batch evenly. Returns the
    micro-batch. Without a checkpoint, or under `pipe`, the config's accumulation stands."""
    t = config.train
    replicas = plan.data * plan.shard
    cap = resumed.get("micro_batch")
    accum = t.grad_accum
    if cap and plan.pipe == 1:
        while accum <= t.batch_size and (t.batch_size % (replicas * accum)
                                         or t.batch_size // (replicas * accum) > cap):
            accum += 1
        if accum > t.batch_size:  # no even split at or under the cap: keep the config's
            accum = t.grad_accum
    t.grad_accum = accum
    return t.batch_size // (replicas * accum) if t.batch_size % (replicas * accum) == 0 else 0


@dataclass
class Formation:
    """This start of an elastic run: what it resumed and when (see the module doc)."""
    run_dir: Path
    world_size: int
    plan: str
    resumed_step: int
    last_logged_step: int       # the previous formations' last step in metrics.jsonl
    checkpoint_time: float | None  # when the resumed checkpoint was committed (epoch seconds)
    grad_accum: int
    micro_batch: int

    @classmethod
    def begin(cls, run_dir: Path, mesh, resume_from: Path | None, config) -> "Formation":
        """Before resuming (which drops metrics.jsonl's lines past the checkpoint): what the
        previous formations reached. Sets the accumulation (`keep_micro_batch`)."""
        state = checkpoint_state(resume_from)
        micro = keep_micro_batch(config, mesh.plan, state)
        last_logged = last_logged_step(run_dir)
        if not state and mesh.rank == 0:  # starting over: its lines are written again
            truncate_metrics(Path(run_dir) / "metrics.jsonl", 0)
        return cls(Path(run_dir), mesh.world_size, str(mesh.plan), int(state.get("step", 0)),
                   last_logged,
                   (Path(resume_from) / STATE_FILE).stat().st_mtime if state else None,
                   config.train.grad_accum, micro)

    def started(self, is_main: bool) -> dict:
        """The formation is built and resumed; its first step comes next. Rank 0 appends this
        formation to formations.jsonl and returns the summary's figures: `reformations` (every
        formation after the first) and `formations` (how many); the other ranks return {}."""
        if not is_main:
            return {}
        now = time.time()
        path = self.run_dir / FORMATIONS_FILE
        earlier = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] \
            if path.is_file() else []
        line = {"world_size": self.world_size, "plan": self.plan,
                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0),
                "resumed_from_step": self.resumed_step,
                "steps_redone": max(0, self.last_logged_step - self.resumed_step),
                "seconds_lost": (now - self.checkpoint_time) if self.checkpoint_time
                else None,
                "grad_accum": self.grad_accum, "micro_batch": self.micro_batch, "time": now}
        if not earlier:
            line.update(steps_redone=0, seconds_lost=0.0)  # the first formation: nothing lost
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")
        formations = [*earlier, line]
        reformations = [{**after, "world_sizes": [before["world_size"], after["world_size"]]}
                        for before, after in zip(formations, formations[1:])]
        return {"reformations": reformations, "formations": len(formations)}
