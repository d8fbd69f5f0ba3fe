"""Measure one Plan on this machine: a few training steps on spawned ranks, synthetic batches.

`measure(config, plan, options, steps)` spawns plan.world_size ranks (gloo on CPU), builds the
config's model with `parallelize`, and times `steps` optimizer steps (forward, loss, backward,
AdamW) after one warm-up step on random inputs of the right shapes (token ids for a GPT, cubes
or this rank's spatial blocks for CosmoFlow). Per rank it records, as the Trainer does:

  step_s            median of the per-step maximum over ranks (a step ends with its slowest rank)
  step_s_min        the fastest of those steps: on a shared machine, the one least disturbed
  state_bytes       `train.memory.state_bytes` at the optimizer step (largest rank)
  step_peak_bytes   the most memory held during the second step: the state held when it begins
                    (parameters, optimizer state, gradient buffers that persist) plus
                    `train.memory.StepPeak` of its forward + backward (largest rank)
  ledger_bytes      bytes per mesh axis of one step (rank 0; tags other than metric/state)
"""

from __future__ import annotations

import statistics
import time

import torch

from ..plan import Plan
from .cost import Options


def _rank(config, plan_dict: dict, options: Options, steps: int) -> dict:
    from ..mesh import init
    mesh = init(Plan(**plan_dict))
    try:
        return measure_on(mesh, config, options, steps)
    finally:
        mesh.close()


def measure_on(mesh, config, options: Options, steps: int) -> dict:
    """This rank's figures (module doc) for `mesh`'s Plan; `steps` timed after 2 untimed."""
    from ..parallel import parallelize
    from ..parallel.options import ParallelOptions
    from ..parallel.shard import build_optimizer_for
    from ..train.memory import StepPeak, state_bytes
    from .dryrun import _build, _inputs

    plan = mesh.plan
    torch.manual_seed(0)
    model, shape, loss_fn = _build(config, on_meta=False)
    popts = ParallelOptions(zero_stage=options.zero_stage, precision=options.precision,
                            activation_checkpointing=options.checkpointing,
                            bucket_cap_mb=options.bucket_cap_mb)
    net = parallelize(model, mesh, popts)
    optim = build_optimizer_for(net, lambda ps: torch.optim.AdamW(ps, lr=1e-5))
    per_rank = options.batch // (plan.data * plan.shard)
    x, y = _inputs(config, shape, mesh, per_rank)
    if config.run.workload == "gpt":
        gen = torch.Generator().manual_seed(mesh.rank)
        x = torch.randint(0, shape.vocab_size, x.shape, generator=gen)
        y = torch.randint(0, shape.vocab_size, x.shape, generator=gen)
    else:
        x = torch.randn(x.shape)
        y = torch.randn(y.shape)
    times, state, peak, ledger = [], {}, None, {}
    for i in range(steps + 2):
        mesh.barrier()
        mark = mesh.ledger.snapshot()
        tracker = StepPeak(mesh.device)
        t0 = time.perf_counter()
        if i == 1:   # the second step: the first also creates persistent buffers
            start = state_bytes(net, optim)["total"]   # what is held when the step begins
            with tracker.track():
                out = net(x)
                loss_fn(out, y).backward()
        else:
            loss_fn(net(x), y).backward()
        optim.step()
        if i == 1:
            state = state_bytes(net, optim)
            peak = start + tracker.bytes
            for (axis, _op, tag), e in mesh.ledger.since(mark).entries.items():
                if tag not in ("metric", "state"):
                    ledger[axis] = ledger.get(axis, 0) + e.bytes
        optim.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return {"times": times, "state": state, "peak": peak, "ledger": ledger}


def measure(config, plan: Plan, options: Options, steps: int = 3) -> dict:
    """Step time and memory of `plan` measured on spawned ranks (see the module doc)."""
    from ..launch import spawn
    per_rank = spawn(_rank, plan.world_size, args=(config, plan.to_dict(), options, steps))
    n = len(per_rank[0]["times"])
    per_step = [max(r["times"][i] for r in per_rank) for i in range(n)]
    step_s = statistics.median(per_step)
    state = max(per_rank, key=lambda r: r["state"]["total"])["state"]
    return {"step_s": step_s, "step_s_min": min(per_step), "state_bytes": state["total"], "state": state,
            "step_peak_bytes": max(r["peak"] for r in per_rank),
            "ledger_bytes": per_rank[0]["ledger"]}
