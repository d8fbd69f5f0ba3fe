"""`exatrain plan --calibrate`: measure this machine into a system file (default cpu-local).

Measured, each the median of repeated timings after a warm-up:

  [flops] per dtype     FLOP/s of one thread: a 1024² matmul (fp32, bf16), a training step of a
                        3D convolution (CosmoFlow's second layer, forward + backward) for "conv";
                        stored per core, with `cores`: the cost model gives a rank
                        cores // ranks threads, as `exatrain run` does, and shares the cores when
                        there are more ranks than cores
  memory_bandwidth      bytes/s of an out-of-place add on 64 MiB tensors (3 streams)
  [intra]               all-reduce over the active backend on 2 spawned ranks at payloads from
                        4 KiB to 16 MiB, fitted to t = 2⌈log2 n⌉α + 2(n-1)/n · B/β (`systems.collective_time`):
                        α (latency) and β (bandwidth); [inter] is the same link (one node)
  [measured.allreduce]  the raw (group size, payload, seconds) points

`efficiency` is 1: the rates are what was reached, not a peak.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from .systems import SYSTEMS_DIR


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


def calibrate(out: str = "", quick: bool = False) -> Path:
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
    finally:
        torch.set_num_threads(threads)
    sizes = [65536, 4 << 20] if quick else [4096, 65536, 1 << 20, 4 << 20, 16 << 20]
    points = spawn(_allreduce_rank, 2, args=(sizes, repeat))[0]
    alpha, beta = fit_ring(points, 2)
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
        "intra": {"bandwidth": beta, "latency": alpha, "efficiency": 1.0},
        "inter": {"bandwidth": beta, "latency": alpha, "efficiency": 1.0},
        "measured": {"cores": cores, "memory_bandwidth": bandwidth, "conv_fp32": conv,
                     "allreduce": [[2, b, t] for b, t in points]},
    }
    path = Path(out) if out else SYSTEMS_DIR / "cpu-local.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"# Written by `exatrain plan --calibrate`; edit or re-measure freely.\n" +
                     tomli_w.dumps(system).encode())
    return path
