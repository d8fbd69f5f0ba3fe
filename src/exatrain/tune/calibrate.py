"""`exatrain plan --calibrate`: measure this machine into a system file (default cpu-local).

Measured, each the median of repeated timings after a warm-up:

  [flops] per dtype     FLOP/s of one thread: a 1024² matmul (fp32, bf16), a training step of a
                        3D convolution (CosmoFlow's second layer, forward + backward) for "conv";
                        stored per core, with `cores`: the cost model gives a rank
                        cores // ranks threads, as `exatrain run` does, and shares the cores when
                        there are more ranks than cores
  memory_bandwidth      bytes/s of an out-of-place add on 64 MiB tensors (3 streams)
  elementwise_bandwidth bytes/s of a chain of eager elementwise operators and a reduction on
                        1 MiB tensors, one core (what a model's memory-bound operators get)
  [intra]               all-reduce over the active backend on 2 spawned ranks at payloads from
                        4 KiB to 16 MiB, fitted to t = 2⌈log2 n⌉α + 2(n-1)/n · B/β
                        (`systems.collective_time`) at ≥ 1 MiB: α (latency) and β (bandwidth);
                        [inter] is the same link (one node); α below 1 MiB (small_latency, small_bytes): the small-message regime,
                        what the large messages' fit leaves of the small ones' times
  [measured.allreduce]  the raw (group size, payload, seconds) points
  [overheads]           the fixed costs per call (`tune.overheads`) and a compute factor per
                        kind ([efficiency] / factor), fitted on the calibration shapes
                        (`CALIBRATION_SHAPES`: two GPTs and CosmoFlow on 1 rank and the
                        strategies of 2, measured in one launch, `calibrate_shapes`);
                        step_error is their leave-one-out MAPE, the error `exatrain plan`
                        quotes when two Plans are closer than it

`efficiency` is 1 for matmul before the shapes' fit: the rates are what was reached, not a peak.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from .systems import user_systems_dir


def _median_time(fn, repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_rate(dtype: torch.dtype, n: int = 1024, repeat: int = 5) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n ** 3 / _median_time(lambda: a @ b, repeat)


def conv_rate(repeat: int = 3) -> float:
    conv = torch.nn.Conv3d(32, 64, 3, padding=1)
    x = torch.randn(1, 32, 32, 32, 32, requires_grad=True)
    fwd = 2 * 64 * 32 ** 3 * 32 * 27

    def step():
        conv(x).sum().backward()
    return 3 * fwd / _median_time(step, repeat)


def memory_bandwidth(repeat: int = 5) -> float:
    a = torch.ones(16 * 2 ** 20)
    b = torch.ones(16 * 2 ** 20)
    out = torch.empty_like(a)
    return 3 * a.numel() * 4 / _median_time(lambda: torch.add(a, b, out=out), repeat)


def _allreduce_rank(sizes: list[int], repeat: int) -> list[tuple[int, float]]:
    import torch.distributed as dist

    from ..comm import all_reduce
    from ..mesh import init
    from ..plan import Plan
    mesh = init(Plan(data=dist.get_world_size() if dist.is_initialized() else
                     int(os.environ.get("WORLD_SIZE", "2"))))
    try:
        axis = mesh.axis("data")
        out = []
        for size in sizes:
            t = torch.zeros(size // 4)

            def once():
                all_reduce(t, axis)
            mesh.barrier()
            out.append((size, _median_time(once, repeat)))
        return out
    finally:
        mesh.close()


SMALL_BYTES = 1 << 20   # below: the small-message regime


def fit_regimes(points: list[tuple[int, float]], n: int) -> dict:
    """α, β from the large messages (≥ SMALL_BYTES, all points when fewer than two are), and the
    small messages' α: the median of what their times leave after the wire term."""
    import math
    import statistics
    large = [p for p in points if p[0] >= SMALL_BYTES]
    alpha, beta = fit_ring(large if len(large) >= 2 else points, n)
    small = [(t - 2 * (n - 1) / n * b / beta) / (2 * math.ceil(math.log2(n)))
             for b, t in points if b < SMALL_BYTES]
    out = {"bandwidth": beta, "latency": alpha, "efficiency": 1.0}
    if small:
        out.update(small_latency=max(1e-7, statistics.median(small)), small_bytes=SMALL_BYTES)
    return out


def fit_ring(points: list[tuple[int, float]], n: int) -> tuple[float, float]:
    """Least-squares α, β of t = 2⌈log2 n⌉α + 2(n-1)/n · B/β over (B, t) points."""
    import math

    import numpy as np
    x = np.array([[2 * math.ceil(math.log2(n)), 2 * (n - 1) / n * b] for b, _ in points],
                 dtype=float)
    y = np.array([t for _, t in points])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    alpha = max(float(coef[0]), 1e-7)
    inv_beta = max(float(coef[1]), 1e-13)
    return alpha, 1.0 / inv_beta


# ------------------------------------------------------------------ the calibration shapes' fit
_GPT_1M = ["run.workload=gpt", "model.preset=1m"]
_COSMO_32 = ["run.workload=cosmoflow", "model.size=32", "model.base_channels=32",
             "model.batchnorm=false"]
# a tiny GPT too: its step is almost all fixed costs, which a single shape per compute kind
# cannot tell apart from a slower compute rate
_GPT_TINY = ["run.workload=gpt", "model.preset=1m", "model.n_layer=3", "model.n_embd=32",
             "model.n_head=2", "model.block_size=32"]
CALIBRATION_SHAPES = {"gpt-1m": (_GPT_1M, 8), "gpt-tiny": (_GPT_TINY, 4),
                      "cosmoflow-32c": (_COSMO_32, 4)}   # (overrides, batch)


def calibration_cases() -> list[tuple[str, object, object]]:
    """(shape, Plan, Options): the calibration shapes on 1 rank and the strategies of 2."""
    from ..plan import Plan
    from .layout import Options

    def o(shape, **kw):
        return Options(batch=CALIBRATION_SHAPES[shape][1], **kw)
    g, t, c = "gpt-1m", "gpt-tiny", "cosmoflow-32c"
    return [(g, Plan(), o(g)), (g, Plan(data=2), o(g)),
            (g, Plan(data=2), o(g, checkpointing="full")),
            (g, Plan(shard=2), o(g, zero_stage=1)), (g, Plan(shard=2), o(g, zero_stage=2)),
            (g, Plan(shard=2), o(g, zero_stage=3)), (g, Plan(tensor=2), o(g)),
            (g, Plan(pipe=2), o(g)),
            (t, Plan(), o(t)), (t, Plan(data=2), o(t)), (t, Plan(shard=2), o(t, zero_stage=3)),
            (t, Plan(tensor=2), o(t)),
            (c, Plan(), o(c)), (c, Plan(data=2), o(c)), (c, Plan(shard=2), o(c, zero_stage=2)),
            (c, Plan(shard=2), o(c, zero_stage=3)), (c, Plan(space=(2, 1, 1)), o(c))]


def fit_rows(measured_s: list[float], kinds: list[str], preds: list) -> list[dict]:
    """`overheads.fit`'s rows from measured steps and predictions made without fixed costs."""
    from .overheads import TERMS
    # the bubble is a share of compute: it scales with the compute factor too
    return [{"measured": m, "compute": p.parts_s["compute"] + p.parts_s["bubble"], "kind": k,
             "counts": p.calls,
             "fixed": p.step_s - p.parts_s["compute"] - p.parts_s["bubble"]
             - sum(p.parts_s.get(t, 0.0) for t in TERMS)}
            for m, k, p in zip(measured_s, kinds, preds)]


def fit_terms(rows: list[dict], drop: tuple = ()) -> dict:
    """`overheads.fit` with the terms in `drop` left out (their cost 0)."""
    from .overheads import COST_KEYS, fit
    masked = [{**r, "counts": {t: (0.0 if t in drop else v) for t, v in r["counts"].items()}}
              for r in rows]
    out = fit(masked)
    for t in drop:
        out["overheads"][COST_KEYS[t]] = 0.0
    return out


def fit_cases(predict_all, measured_s: list[float], kinds: list[str], base, drop: tuple = (),
              rounds: int = 3) -> dict:
    """`fit_terms` iterated to its fixed point: `predict_all(system)` predicts every case; a
    slower compute hides more communication (the overlap), so the exposure the linear fit holds
    fixed is re-predicted with each round's compute factors. Factors relative to `base`."""
    import dataclasses
    system = dataclasses.replace(base, overheads={})
    total = {}
    for _ in range(rounds):
        fit = fit_terms(fit_rows(measured_s, kinds, predict_all(system)), drop)
        total = {k: total.get(k, 1.0) * f for k, f in fit["compute_factor"].items()}
        system = dataclasses.replace(fitted_system(system, fit), overheads={})
    return {"compute_factor": total, "overheads": fit["overheads"]}


def fitted_system(base, fit: dict):
    """`base` with a fit's compute factors (efficiency / factor) and fixed costs per call."""
    import dataclasses
    eff = dict(base.efficiency)
    for kind, factor in fit["compute_factor"].items():
        if factor > 0:
            eff[kind] = base.efficiency.get(kind, base.efficiency.get("matmul", 1.0)) / factor
    return dataclasses.replace(base, efficiency=eff,
                               overheads={**base.overheads, **fit["overheads"]})


def calibrate_shapes(system, steps: int = 8, warmup: int = 3,
                     leave_one_out: bool = True) -> tuple[dict, float]:
    """Measure the calibration shapes in one launch and fit (`fit_cases`) on them: (the fit,
    its leave-one-out MAPE in %; in-sample without `leave_one_out`)."""
    import dataclasses

    from ..train.config import load_config
    from .cost import predict
    from .measure import measure_many
    from .spec import spec_from_config
    cases = calibration_cases()
    configs = {s: load_config(None, [*ov, f"train.batch_size={b}"])
               for s, (ov, b) in CALIBRATION_SHAPES.items()}
    specs = {s: spec_from_config(c) for s, c in configs.items()}
    got = measure_many([(configs[s], p, o) for s, p, o in cases], 2, steps, warmup,
                       serial_threads=1)
    bare = dataclasses.replace(system, overheads={})
    measured = [g["step_s"] for g in got]
    kinds = [specs[s].compute_kind for s, _p, _o in cases]

    def predict_all(picked):
        def run(sys):
            return [predict(specs[cases[i][0]], cases[i][1], rank_system(sys, cases[i][1]
                                                                          .world_size),
                            cases[i][2]) for i in picked]
        return run
    every = list(range(len(cases)))
    fit = fit_cases(predict_all(every), measured, kinds, bare)
    if not leave_one_out:
        preds = predict_all(every)(fitted_system(bare, fit))
        return fit, 100 * statistics.mean(abs(p.step_s / m - 1) for p, m in zip(preds, measured))
    errors = []
    for i in every:
        rest = every[:i] + every[i + 1:]
        loo = fit_cases(predict_all(rest), [measured[j] for j in rest],
                        [kinds[j] for j in rest], bare)
        errors.append(abs(predict_all([i])(fitted_system(bare, loo))[0].step_s
                          / measured[i] - 1))
    return fit, 100 * sum(errors) / len(errors)


def rank_system(system, world: int):
    """A serial case runs on one thread (`measure_many(serial_threads=1)`)."""
    import dataclasses
    if world > 1:
        return system
    return dataclasses.replace(system, measured={**system.measured, "cores": 1})


def elementwise_bandwidth(repeat: int = 5, n: int = 1 << 18) -> float:
    """Bytes/s one core's eager memory-bound operators move: a chain of the kinds a model's step
    runs between its matrix products (a broadcast product, a sum, SiLU, a sine, a mask, a
    division, a reduction over the last dim) on tensors of `n` fp32 elements (1 MiB: a
    mid-sized activation), its bytes counted as the planner counts a model's
    (`step_counts.StepCounter`), so that bytes / this rate is the time the planner charges."""
    from .step_counts import StepCounter

    a, b, c = torch.randn(n), torch.randn(1, n // 64).expand(64, -1).reshape(n), torch.randn(n)
    mask = torch.rand(n) > 0.1

    def chain():
        t = torch.nn.functional.silu(a * b + c)
        t = torch.sin(t) * mask
        return (t / (c.abs() + 1.0)).view(-1, 64).sum(dim=-1)
    with StepCounter() as counter:
        chain()
    return counter.traffic / _median_time(chain, repeat)


def calibrate(out: str = "", quick: bool = False, shapes: bool = True) -> Path:
    import tomli_w

    from ..launch import spawn

    repeat = 2 if quick else 7
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flops = {"fp32": matmul_rate(torch.float32, repeat=repeat),
                 "bf16": matmul_rate(torch.bfloat16, repeat=repeat)}
        conv = conv_rate(repeat=max(2, repeat // 2))
        bandwidth = memory_bandwidth(repeat)
        elementwise = elementwise_bandwidth(repeat)
    finally:
        torch.set_num_threads(threads)
    sizes = [65536, 4 << 20] if quick else [4096, 65536, 1 << 20, 4 << 20, 16 << 20]
    points = spawn(_allreduce_rank, 2, args=(sizes, repeat))[0]
    link = fit_regimes(points, 2)
    cores = os.cpu_count() or 1
    system = {
        "name": "cpu-local",
        "description": f"this machine: {cores} cores, gloo (measured by exatrain plan --calibrate "
                       f"on {time.strftime('%Y-%m-%d')})",
        "ranks_per_node": cores * 64,     # every local rank shares one node's memory and loopback
        "memory_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        "memory_reserved_bytes": 2.0 * 2 ** 30,
        "flops": flops,
        "efficiency": {"matmul": 1.0, "conv": conv / flops["fp32"]},
        "intra": link,
        "inter": dict(link),
        "measured": {"cores": cores, "memory_bandwidth": bandwidth,
                     "elementwise_bandwidth": elementwise, "conv_fp32": conv,
                     "allreduce": [[2, b, t] for b, t in points]},
    }
    if shapes:
        from .systems import from_dict
        fit, error = calibrate_shapes(from_dict(system), steps=1 if quick else 8,
                                      warmup=2 if quick else 3, leave_one_out=not quick)
        fitted = fitted_system(from_dict(system), fit)
        system["efficiency"] = dict(fitted.efficiency)
        system["overheads"] = {**fit["overheads"], "step_error": error / 100}
    path = Path(out) if out else user_systems_dir() / "cpu-local.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"# Written by `exatrain plan --calibrate`; edit or re-measure freely.\n" +
                     tomli_w.dumps(system).encode())
    return path
