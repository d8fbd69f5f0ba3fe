"""`exatrain preflight`: measure the job's links and check its ranks before a long run.

Run on every rank of the job, under the same launcher and Plan as `exatrain run`:

1. checks (observe.preflight_checks): every rank sees the data path and the run directory, runs
   the same exatrain and torch, has the expected devices and enough free memory;
2. a sweep, like nccl-tests, for each mesh axis of size > 1 and for the world: all-reduce,
   all-gather and reduce-scatter over a list of message sizes S, and for `pipe` and `space_*`
   neighbours a ring exchange (send to the next member, receive from the previous one). Time t =
   the slowest rank's mean over `iters` calls after `warmup`; algbw = S / t, busbw = algbw *
   comm.busbw.bus_factor(op, n);
3. the links of each rank: n - 1 rounds (at most `rounds`) of a round-robin tournament (circle
   method), each round a perfect matching; in each, every rank exchanges `link_bytes` with its
   partner (batched isend/irecv, both ways at once: 2 * link_bytes on the wire per pair), the
   median of `iters` timed exchanges, the smaller of the two ends' (the pair swaps them: a
   rank's clock also counts the wait for a partner not yet scheduled, and a slow link or rank
   slows both ends alike). A rank's link bandwidth is the upper median over its
   rounds: a slow rank is slow in every round, its partners in only one, so the median names the
   slow rank and not its partners (from 3 ranks on; with 2, both ends of the one link look alike).
   A node's bandwidth is the median of its ranks'. Ranks and nodes below `threshold` times the
   median are named with their host names; their hosts form the exclude list (`srun --exclude`).

Bytes on the wire per rank: sweep sum over axes, ops and sizes of (warmup + iters) * S * factor;
links rounds * ((warmup + iters) * link_bytes + 8) each way.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from ..comm import all_gather_into, all_gather_object, all_reduce, broadcast_object, exchange, \
    reduce_scatter_into
from ..comm.busbw import bus_factor
from .preflight_checks import check_ranks, rank_facts

NEIGHBOUR_AXES = ("pipe", "space_d", "space_h", "space_w")
SLOW_EXIT_CODE = 3


@dataclass
class PreflightOptions:
    sizes: list[int] = field(default_factory=lambda: [2**10, 2**16, 2**20, 2**24])  # bytes
    iters: int = 10
    warmup: int = 3
    link_bytes: int = 2**22
    rounds: int = 8             # at most this many pairings per rank in the link test
    threshold: float = 0.5      # slow: below threshold * median
    min_free_gib: float = 1.0   # free memory a rank must have


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, mesh) -> float:
    """The largest of every rank's `seconds` (one float64 MAX all-reduce over the world)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=mesh.device)
    all_reduce(t, mesh.world, op=dist.ReduceOp.MAX, tag="control")
    return float(t.item())


def _time(call, iters: int, warmup: int, device) -> float:
    """Mean seconds per call on this rank, after `warmup` calls."""
    for _ in range(warmup):
        call()
    _synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    _synchronize(device)
    return (time.perf_counter() - t0) / iters


def _op_call(op: str, axis, nbytes: int, device):
    """A closure running `op` once on `axis` with a buffer of `nbytes` (S as nccl-tests counts)."""
    n = axis.size
    numel = max(n, nbytes // 4 // n * n)  # float32, divisible by the axis size
    full = torch.ones(numel, dtype=torch.float32, device=device)
    part = torch.ones(numel // n, dtype=torch.float32, device=device)
    if op == "all_reduce":
        return numel * 4, lambda: all_reduce(full, axis, tag="preflight")
    if op == "all_gather":
        return numel * 4, lambda: all_gather_into(full, part, axis, tag="preflight")
    if op == "reduce_scatter":
        return numel * 4, lambda: reduce_scatter_into(part, full, axis, tag="preflight")
    recv = torch.empty_like(full)  # p2p: a ring along the axis

    def ring():
        for work in exchange([(full, (axis.rank + 1) % n)], [(recv, (axis.rank - 1) % n)], axis,
                             tag="preflight"):
            work.wait()
    return numel * 4, ring


def sweep(mesh, options: PreflightOptions) -> list[dict]:
    """Collective: the nccl-tests table, one row per (axis, op, size)."""
    axes = [(name, mesh.axis(name)) for name, size in mesh.plan.degrees().items() if size > 1]
    if mesh.world_size > 1 and len(axes) != 1:  # one axis of size > 1 *is* the world
        axes.append(("world", mesh.world))
    rows = []
    for name, axis in axes:
        ops = ["all_reduce", "all_gather", "reduce_scatter"]
        if name in NEIGHBOUR_AXES:
            ops.append("p2p")
        for op in ops:
            for size in options.sizes:
                nbytes, call = _op_call(op, axis, size, mesh.device)
                t = _slowest(_time(call, options.iters, options.warmup, mesh.device), mesh)
                algbw = nbytes / t
                rows.append({"axis": name, "ranks": axis.size, "op": op, "bytes": nbytes,
                             "time_us": t * 1e6, "algbw_GBps": algbw / 1e9,
                             "busbw_GBps": algbw * bus_factor(op, axis.size) / 1e9})
    return rows


def pairings(n: int, rounds: int) -> list[list[int | None]]:
    """Round-robin rounds (circle method): partner[r] per round, None for a bye (odd n)."""
    m = n + (n % 2)  # a ghost player makes n even
    out = []
    for k in range(min(rounds, m - 1)):
        partner: list[int | None] = [None] * m
        pairs = [(m - 1, k)] + [((k + i) % (m - 1), (k - i) % (m - 1)) for i in range(1, m // 2)]
        for a, b in pairs:
            partner[a], partner[b] = b, a
        out.append([p if p is not None and p < n else None for p in partner[:n]])
    return out


def link_bandwidths(mesh, options: PreflightOptions) -> list[float]:
    """Collective: this rank's exchange bandwidth (bytes/s one way) in each round."""
    world, out = mesh.world, []
    send = torch.ones(max(1, options.link_bytes // 4), dtype=torch.float32, device=mesh.device)
    recv = torch.empty_like(send)
    for partner in pairings(mesh.world_size, options.rounds):
        peer = partner[mesh.rank]
        dist.barrier()
        if peer is None:
            continue
        position = world.global_ranks.index(peer)

        def swap(outgoing, incoming):
            for work in exchange([(outgoing, position)], [(incoming, position)], world,
                                 tag="preflight"):
                work.wait()
        for _ in range(options.warmup):
            swap(send, recv)
        times = []
        for _ in range(options.iters):  # the median call: a stray preemption of a busy host
            t0 = time.perf_counter()    # does not make a rank look slow
            swap(send, recv)
            _synchronize(mesh.device)
            times.append(time.perf_counter() - t0)
        # the link's time is the faster end's: a rank's clock also runs while it waits for a
        # partner that was not scheduled yet, which says nothing of the link (a slow link or
        # rank is slow at both ends)
        mine = torch.tensor([statistics.median(times)], dtype=torch.float64, device=mesh.device)
        theirs = torch.empty_like(mine)
        swap(mine, theirs)
        out.append(send.numel() * 4 / min(float(mine), float(theirs)))
    dist.barrier()
    return out


def judge(facts: list[dict], threshold: float) -> dict:
    """Rank 0: per-rank and per-node link bandwidth against the median; who is slow."""
    ranks = [{"rank": f["rank"], "host": f["host"], "link_GBps": f["link_GBps"]} for f in facts]
    median = statistics.median(r["link_GBps"] for r in ranks)
    for r in ranks:
        r["ratio"] = r["link_GBps"] / median if median else float("nan")
    hosts: dict[str, list[float]] = {}
    for r in ranks:
        hosts.setdefault(r["host"], []).append(r["link_GBps"])
    nodes = [{"host": h, "ranks": len(v), "link_GBps": statistics.median(v)} for h, v in hosts.items()]
    node_median = statistics.median(n["link_GBps"] for n in nodes)
    for n in nodes:
        n["ratio"] = n["link_GBps"] / node_median if node_median else float("nan")
    slow_ranks = [r for r in ranks if r["ratio"] < threshold]
    slow_nodes = [n for n in nodes if n["ratio"] < threshold]
    exclude = sorted({r["host"] for r in slow_ranks} | {n["host"] for n in slow_nodes})
    return {"median_link_GBps": median, "links": ranks, "nodes": nodes, "slow_ranks": slow_ranks,
            "slow_nodes": slow_nodes, "exclude_hosts": exclude}


def preflight_rank(mesh, config, options: PreflightOptions) -> dict:
    """What every rank runs, on the job's mesh (`train.job.join(config)`: the job's own launcher
    detection, Plan and process group; the caller closes it); returns the whole report on every
    rank (the same verdict everywhere)."""
    facts = rank_facts(mesh, config, options.min_free_gib)
    # median_high: with an even number of rounds, a rank is slow only when most rounds were
    facts["link_GBps"] = statistics.median_high(link_bandwidths(mesh, options) or [0.0]) / 1e9
    rows = sweep(mesh, options)
    every = all_gather_object(facts, mesh.world)
    report = None
    if mesh.rank == 0:
        problems = check_ranks(every, config)
        report = {"world_size": mesh.world_size, "plan": str(mesh.plan),
                  "backend": mesh.backend, "options": asdict(options),
                  "ranks": every, "collectives": rows,
                  **(judge(every, options.threshold) if mesh.world_size > 1 else
                     {"links": [], "nodes": [], "slow_ranks": [], "slow_nodes": [],
                      "exclude_hosts": [], "median_link_GBps": None}),
                  "problems": problems}
        report["ok"] = not (problems or report["slow_ranks"] or report["slow_nodes"])
    return broadcast_object(report, mesh.world)


def exclude_line(report: dict) -> str:
    """The hosts to leave out, as `srun --exclude` takes them (comma-separated; empty: none)."""
    return ",".join(report["exclude_hosts"])


def format_report(report: dict) -> str:
    """The table (nccl-tests columns) and the verdict, as text."""
    lines = [f"exatrain preflight: {report['world_size']} ranks, {report['plan']}, "
             f"backend {report['backend']}",
             f"{'axis':<10}{'ranks':>6} {'op':<15}{'size (B)':>12}{'time (us)':>12}"
             f"{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}"]
    for r in report["collectives"]:
        lines.append(f"{r['axis']:<10}{r['ranks']:>6} {r['op']:<15}{r['bytes']:>12}"
                     f"{r['time_us']:>12.1f}{r['algbw_GBps']:>14.3f}{r['busbw_GBps']:>14.3f}")
    if report["links"]:
        lines.append(f"links (pairwise exchange, median over rounds; median of ranks "
                     f"{report['median_link_GBps']:.3f} GB/s):")
        for r in report["links"]:
            mark = "  SLOW" if r in report["slow_ranks"] else ""
            lines.append(f"  rank {r['rank']:>5} {r['host']:<24}{r['link_GBps']:>10.3f} GB/s"
                         f"{r['ratio']:>8.2f} x median{mark}")
        for n in report["nodes"]:
            if len(report["nodes"]) > 1 or n in report["slow_nodes"]:
                mark = "  SLOW" if n in report["slow_nodes"] else ""
                lines.append(f"  node {n['host']:<30}{n['link_GBps']:>10.3f} GB/s"
                             f"{n['ratio']:>8.2f} x median{mark}")
    threshold = report["options"]["threshold"]
    for r in report["slow_ranks"]:
        lines.append(f"SLOW rank {r['rank']} on {r['host']}: {r['link_GBps']:.3f} GB/s, "
                     f"{r['ratio']:.2f} x the median (threshold {threshold})")
    for n in report["slow_nodes"]:
        lines.append(f"SLOW node {n['host']}: {n['link_GBps']:.3f} GB/s, {n['ratio']:.2f} x the "
                     f"median of nodes")
    lines.extend(f"PROBLEM {p}" for p in report["problems"])
    if report["exclude_hosts"]:
        lines.append(f"exclude: srun --exclude={exclude_line(report)} ...")
    lines.append("preflight: OK" if report["ok"] else "preflight: FAILED (exit code 3)")
    return "\n".join(lines)

