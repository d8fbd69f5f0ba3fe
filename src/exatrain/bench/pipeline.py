"""`exatrain bench pipeline`: pipeline schedules against one process, and against their formulas.

The model: an nn.Sequential of equal MLP blocks (width E = 512, hidden 4E; 256 rows per
micro-batch by default) on inputs that require gradients, so every stage does the same work
forward and backward; a regression loss. For each number of stages p (ranks on `pipe`, one thread each), each
schedule (gpipe, 1f1b, interleaved, zero_bubble; the looped ones with 2 stages per rank) and each
micro-batch count m, with micro-batches of a fixed size (the batch grows with m):

  step_s               median over timed steps of the slowest rank's step
  step_s_no_pipeline   the same model and batch on one process (measured in this launch, first)
  bubble_measured      idle share of each rank's step (1 - busy/step, the timeline's spans),
                       mean over ranks, median over steps
  bubble_formula       the schedule's own: (p-1)/(m+p-1), (p-1)/(v*m+p-1), (p-1)/(3*v*m+p-1)
  p2p_bytes_per_step   sends counted by the ledger on `pipe`, summed over ranks
  p2p_bytes_formula    2 * m * (S-1) * A: activations forward and gradients back across each of
                       the S-1 stage boundaries, A = micro-batch x E x 4 bytes
  max_rel_err_vs_serial  weights after one SGD step against the same step on one process
CPU ranks over gloo, one thread each (several ranks could not share one GPU under NCCL).

  cores                CPU cores of this machine: cases with p > cores are oversubscribed, their
                       times say little (the done-when targets apply to p <= cores)

Figures are flat keys `<figure>_p<p>_<schedule>_m<m>`. With `--memory-cap-mib C`, also the memory
case of `bench/pipe_memory.py` (GPT under Plan(pipe=2, tensor=2, shard=2) on 8 ranks): `memory_*`,
`state_bytes_per_rank` against `state_bytes_formula`.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch import nn

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zero_bubble")


def add_arguments(parser) -> None:
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4],
                        help="pipe ranks to run (default 2 4)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULE_NAMES))
    parser.add_argument("--micro-rows", type=int, default=256, help="rows per micro-batch")
    parser.add_argument("--memory-cap-mib", type=float, default=0.0,
                        help="also run the memory case (bench/pipe_memory.py) with this cap per "
                             "rank: 8 ranks, pipe x tensor x shard")


def _model(width: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                         nn.Linear(4 * width, width)) for _ in range(blocks)])


def _batch(m: int, rows: int, width: int):
    """Inputs that require gradients: the first stage then computes its input's gradient as every
    other stage does, so the stages are equal in backward too. Without it the first stage's
    backward was 12 % shorter (37.6 against 43 ms here), and its rank's wait for the next
    gradient counted as bubble: interleaved p=2 m=16 measured 0.082 idle on rank 0 and 0.024 on
    rank 1 (mean 0.053 against the formula's 0.030); with it 0.034 and 0.026 (mean 0.030)."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m * rows, width, generator=g).requires_grad_()
    return x, torch.randn(m * rows, width, generator=g)


def _loss(output, target):
    return nn.functional.mse_loss(output, target)


def _serial(width, blocks, m, rows, steps, warmup) -> tuple[float, dict]:
    """Median step of the un-pipelined model, and its weights after one SGD step."""
    model = _model(width, blocks)
    x, y = _batch(m, rows, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    after_one = {k: v.clone() for k, v in model.state_dict().items()}
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), after_one


def _rank_main(p, width, blocks, rows, schedules, microbatches, steps, warmup, serial_states):
    import exatrain as et
    from ..comm import all_gather_object, all_reduce
    from ..parallel.options import ParallelOptions

    torch.set_num_threads(1)
    mesh = et.init(et.Plan(pipe=p), backend="gloo")  # CPU ranks: several per machine, any machine
    out = {}
    try:
        for schedule in schedules:
            for m in microbatches:
                x, y = _batch(m, rows, width)
                options = ParallelOptions(pipe_schedule=schedule, microbatches=m)
                model = et.parallelize(_model(width, blocks), mesh, options, example=x)
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
                mark = mesh.ledger.snapshot()
                model.train_step(x, y, _loss)
                opt.step()
                opt.zero_grad()
                delta = mesh.ledger.since(mark)  # the sends only (the loss is shared on pipe too)
                sent = sum(delta.bytes_by_axis(tag=t).get("pipe", 0) for t in ("act", "grad"))
                mine = {k: v.clone() for k, v in model.state_dict().items()}
                times, bubbles = [], []
                for i in range(warmup + steps):
                    t0 = time.perf_counter()
                    model.train_step(x, y, _loss)
                    opt.step()
                    opt.zero_grad()
                    dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
                    all_reduce(dt, mesh.world, op=torch.distributed.ReduceOp.MAX, tag="metric")
                    idle = torch.tensor(model.timeline.idle_fraction(), dtype=torch.float64)
                    all_reduce(idle, mesh.world, tag="metric")
                    if i >= warmup:
                        times.append(float(dt))
                        bubbles.append(float(idle) / p)
                totals = all_gather_object((sent, mine), mesh.world)
                if mesh.rank == 0:
                    state = {k: v for _, s in totals for k, v in s.items()}
                    ref = serial_states[m]
                    err = max(float((state[k] - v).abs().max() / v.abs().max().clamp_min(1e-30))
                              for k, v in ref.items())
                    per_rank = model.per_rank
                    a = rows * width * 4
                    key = f"p{p}_{schedule}_m{m}"
                    out.update({f"step_s_{key}": statistics.median(times),
                                f"bubble_measured_{key}": statistics.median(bubbles),
                                f"bubble_formula_{key}": model.bubble_formula(),
                                f"p2p_bytes_per_step_{key}": sum(s for s, _ in totals),
                                f"p2p_bytes_formula_{key}": 2 * m * (p * per_rank - 1) * a,
                                f"max_rel_err_vs_serial_{key}": err})
    finally:
        mesh.close()
    return out


def run(args) -> dict:
    from ..launch import spawn

    # 30-70 ms of work per schedule action on a CPU core, so that an action's fixed cost (~1 ms
    # of Python and a gloo send/receive) does not pass for bubble (at width 256 and 32 rows,
    # 2-6 ms of work, it did: measured bubbles 0.03-0.18 above the formulas)
    width = args.size or 512
    blocks = 8
    steps, warmup = args.steps or 5, args.warmup
    cores = len(os.sched_getaffinity(0))
    result: dict = {"cores": cores, "width": width, "blocks": blocks, "micro_rows": args.micro_rows}
    torch.set_num_threads(1)
    serial_states = {}
    for m in args.microbatches:
        step_s, serial_states[m] = _serial(width, blocks, m, args.micro_rows, steps, warmup)
        result[f"step_s_no_pipeline_m{m}"] = step_s
    for p in args.stages:
        result.update(spawn(_rank_main, p, args=(p, width, blocks, args.micro_rows, args.schedules,
                                                   args.microbatches, steps, warmup, serial_states))[0])
    worst_bubble = max((result[k] - result[k.replace("measured", "formula")]
                        for k in result if k.startswith("bubble_measured_p")
                        and int(k.split("_p")[1].split("_")[0]) <= cores), default=float("nan"))
    worst_bytes = max((result[k] / result[k.replace("per_step", "formula")]
                       for k in result if k.startswith("p2p_bytes_per_step_")), default=float("nan"))
    result.update(bubble_excess_max=worst_bubble, p2p_bytes_ratio_max=worst_bytes,
                  max_rel_err_vs_serial=max(v for k, v in result.items()
                                            if k.startswith("max_rel_err_vs_serial_")))
    if args.memory_cap_mib:
        from .pipe_memory import run_memory_case
        result.update(run_memory_case(args.memory_cap_mib))
    return result
