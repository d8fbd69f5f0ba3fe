"""Measure Plans on this machine: a few training steps on spawned ranks, synthetic batches.

`measure(config, plan, options, steps)` spawns plan.world_size ranks (gloo on CPU), builds the
config's model with `parallelize`, and times `steps` optimizer steps (forward, loss, backward,
AdamW) after two untimed ones, on random inputs of the right shapes (token ids for a GPT, cubes
or this rank's spatial blocks for CosmoFlow).

`measure_many(cases, world, steps)` measures several (config, Plan, options) of one world size in
ONE launch, interleaved step by step (round r runs one step of every case, in an order that
rotates from round to round), so that the load of a shared machine hits all of them alike and
their times can be compared. A case whose Plan has one rank (serial) runs on rank 0 with every
core's threads while the other ranks wait.

Per case, as the Trainer measures them:

  step_s            median of the per-step maximum over ranks (a step ends with its slowest rank)
  step_s_min        the fastest of those steps: on a shared machine, the one least disturbed
  step_times        every timed step's time (the slowest rank's), in order
  state_bytes       `observe.memory_meters.state_bytes` at the optimizer step (largest rank)
  step_peak_bytes   the most memory held during the second step: the state held when it begins
                    (parameters, optimizer state, gradient buffers that persist) plus
                    `observe.memory_meters.StepPeak` of its forward + backward (largest rank)
  ledger_bytes      bytes per mesh axis of one step (rank 0; tags other than metric/state)
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from ..plan import Plan
from .layout import Options


class _Case:
    """One (model, Plan, options) built on this rank, stepping on demand."""

    def __init__(self, mesh, config, options: Options, serial: bool = False):
        from ..parallel import parallelize
        from ..parallel.options import ParallelOptions
        from ..optim.factory import build_optimizer_for
        from .dryrun import _build, _inputs

        self.mesh, self.config, self.serial = mesh, config, serial
        torch.manual_seed(0)
        model, shape, self.loss_fn = _build(config, on_meta=False)
        if serial:
            self.net = model
            self.optim = torch.optim.AdamW(model.parameters(), lr=1e-5)
            plan = Plan()
        else:
            popts = ParallelOptions(zero_stage=options.zero_stage, precision=options.precision,
                                    activation_checkpointing=options.checkpointing,
                                    bucket_cap_mb=options.bucket_cap_mb,
                                    batchnorm=options.batchnorm)
            plan = mesh.plan
        per_rank = options.batch // (plan.data * plan.shard)
        x, y = _inputs(config, shape, None if serial else mesh, per_rank)
        if not serial:
            popts.pipe_schedule, popts.microbatches = options.schedule, options.microbatches
            popts.pipe_virtual_stages = options.virtual_stages
            self.net = parallelize(model, mesh, popts, example=x)
            self.optim = build_optimizer_for(self.net, lambda ps: torch.optim.AdamW(ps, lr=1e-5))
        gen = torch.Generator().manual_seed(0 if serial else mesh.rank)
        if config.run.workload == "gpt":
            self.x = torch.randint(0, shape.vocab_size, x.shape, generator=gen)
            self.y = torch.randint(0, shape.vocab_size, x.shape, generator=gen)
        else:
            self.x, self.y = torch.randn(x.shape, generator=gen), torch.randn(y.shape, generator=gen)
        self.times: list[float] = []
        self.state, self.peak, self.ledger = {}, None, {}
        self.done = 0

    def _forward_backward(self) -> None:
        if hasattr(self.net, "train_step"):   # a pipelined model runs by its schedule
            self.net.train_step(self.x, self.y, self.loss_fn)
        else:
            self.loss_fn(self.net(self.x), self.y).backward()

    def step(self, timed: bool) -> None:
        from ..observe.memory_meters import StepPeak, state_bytes
        measure_memory = self.done == 1   # the first step also creates persistent buffers
        mark = None if self.serial else self.mesh.ledger.snapshot()
        t0 = time.perf_counter()
        if measure_memory:
            start = state_bytes(self.net, self.optim)["total"]
            tracker = StepPeak(torch.device("cpu") if self.serial else self.mesh.device)
            with tracker.track():
                self._forward_backward()
        else:
            self._forward_backward()
        self.optim.step()
        if measure_memory:
            self.state = state_bytes(self.net, self.optim)
            self.peak = start + tracker.bytes
            if mark is not None:
                for (axis, _op, tag), e in self.mesh.ledger.since(mark).entries.items():
                    if tag not in ("metric", "state"):
                        self.ledger[axis] = self.ledger.get(axis, 0) + e.bytes
        self.optim.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        if timed and not measure_memory:
            self.times.append(elapsed)
        self.done += 1

    def result(self) -> dict:
        return {"times": self.times, "state": self.state, "peak": self.peak,
                "ledger": self.ledger}


def measure_on(mesh, config, options: Options, steps: int) -> dict:
    """This rank's figures for `mesh`'s Plan: 2 untimed steps (the second measures memory),
    then `steps` timed."""
    case = _Case(mesh, config, options)
    for i in range(steps + 2):
        mesh.barrier()
        case.step(timed=i >= 2)
    return case.result()


def _rank(config, plan_dict: dict, options: Options, steps: int) -> dict:
    from ..mesh import init
    mesh = init(Plan(**plan_dict))
    try:
        return measure_on(mesh, config, options, steps)
    finally:
        mesh.close()


def _probe_work(n: int = 384, reps: int = 12) -> float:
    """Seconds of a fixed single-thread matmul workload (the probe of `cores_available`)."""
    a = torch.ones(n, n)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, a)
    return time.perf_counter() - t0


def _probe_round() -> tuple[float, float]:
    """(rank 0 alone, this rank with every rank at once): the same work, one thread each."""
    import torch.distributed as dist
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.barrier()
    alone = _probe_work() if dist.get_rank() == 0 else 0.0
    dist.barrier()
    together = _probe_work()
    dist.barrier()
    torch.set_num_threads(threads)
    return alone, together


def cores_available(probes: list) -> dict:
    """How many cores the ranks of one launch really had, from `_probe_round`s interleaved with
    the measured steps: world × t(alone) / t(all at once) per round, median over rounds, within
    [1, world]. On an idle machine with a core per rank it is the world size; when other jobs
    hold the cores it drops towards 1 (splitting the work over ranks then buys nothing)."""
    world = len(probes)
    ratios = [world * probes[0][r][0] / max(p[r][1] for p in probes)
              for r in range(len(probes[0]))]
    return {"cores_available": min(world, max(1.0, statistics.median(ratios))),
            "cores_available_rounds": ratios}


def _rank_many(cases: list, steps: int, warmup: int = 2, serial_threads: int = 0,
               probe: bool = False) -> list[dict]:
    import torch.distributed as dist

    from ..mesh import init
    world = int(os.environ.get("WORLD_SIZE", "1"))
    built, mesh = [], None
    for config, plan_dict, options in cases:
        plan = Plan(**plan_dict)
        if plan.world_size == 1 and world > 1:
            mesh = mesh or init(Plan(data=world))
            built.append(_Case(mesh, config, options, serial=True) if mesh.rank == 0 else None)
        else:
            mesh = init(plan)
            built.append(_Case(mesh, config, options))
    threads = torch.get_num_threads()
    order = list(range(len(built)))
    probes: list = []
    warmup = max(2, warmup)   # the second step measures memory, untimed
    for r in range(steps + warmup):
        for k in order[r % len(order):] + order[:r % len(order)]:
            dist.barrier() if dist.is_initialized() else None
            case = built[k]
            if case is None:
                continue
            if case.serial:
                torch.set_num_threads(serial_threads or os.cpu_count() or 1)
            case.step(timed=r >= warmup)
            torch.set_num_threads(threads)
        if probe and r >= warmup and dist.is_initialized():
            probes.append(_probe_round())
    out = [c.result() if c is not None else None for c in built]
    if probe:
        out.append(probes)
    if mesh is not None:
        mesh.close()
    return out


def _summary(per_rank: list) -> dict:
    per_rank = [r for r in per_rank if r is not None]
    n = len(per_rank[0]["times"])
    per_step = [max(r["times"][i] for r in per_rank) for i in range(n)]
    state = max(per_rank, key=lambda r: r["state"]["total"])["state"]
    return {"step_s": statistics.median(per_step), "step_s_min": min(per_step),
            "step_times": per_step,
            "state_bytes": state["total"], "state": state,
            "step_peak_bytes": max(r["peak"] for r in per_rank),
            "ledger_bytes": per_rank[0]["ledger"]}


def measure(config, plan: Plan, options: Options, steps: int = 3) -> dict:
    """Step time and memory of `plan` measured on spawned ranks (see the module doc)."""
    from ..launch import spawn
    return _summary(spawn(_rank, plan.world_size, args=(config, plan.to_dict(), options, steps)))


def measure_many(cases: list, world: int, steps: int = 3, warmup: int = 2,
                 serial_threads: int = 0, probe: dict | None = None) -> list[dict]:
    """[(config, Plan, options)] of `world` ranks (or 1), interleaved in one launch; `warmup`
    untimed rounds first (at least 2); serial cases run with `serial_threads` threads (0: every
    core). With a `probe` dict, every timed round also runs `_probe_round` and the dict gets
    `cores_available` (see there)."""
    from ..launch import spawn
    per_rank = spawn(_rank_many, world, args=([(c, p.to_dict(), o) for c, p, o in cases], steps,
                                               warmup, serial_threads, probe is not None))
    if probe is not None:
        probe.update(cores_available([r[-1] for r in per_rank]))
    return [_summary([r[k] for r in per_rank]) for k in range(len(cases))]
