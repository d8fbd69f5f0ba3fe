"""The measured matrix-multiply rate of a device: the denominator of MFU as "model FLOPs per second
over this device's measured matmul rate", where no datasheet peak applies (`observe.cpu_peak` is
the CPU's peak from its cores and vector units; `bench.device_peaks` the GPUs' datasheets).

Imports: torch only.
"""

from __future__ import annotations

import functools
import time

import torch


def measured_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32,
                          n: int | None = None, seconds: float = 0.1) -> float:
    """FLOP/s of an n×n by n×n matrix multiply in `dtype` on `device`, median of repeats.

    The denominator for MFU: what this device sustains on the op that dominates the model,
    measured rather than taken from a datasheet. n grows from 256 by doubling up to `n`
    (default 8192 on a GPU, 1024 on a CPU) while one multiply takes under a twentieth of
    `seconds`: a dtype the device has no fast kernel for (float16 on most CPUs: 1 GFLOP/s here,
    where a 1024² multiply took 2 s) is measured in about `seconds`, not in many.
    """
    device = torch.device(device)
    n_max = n or (8192 if device.type == "cuda" else 1024)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def operands(size):
        return (torch.randn(size, size, device=device).to(dtype),
                torch.randn(size, size, device=device).to(dtype))

    n = min(256, n_max)
    a, b = operands(n)
    a @ b  # warm-up
    while True:
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        if n >= n_max or time.perf_counter() - t0 >= seconds / 20:
            break
        n = min(2 * n, n_max)
        a, b = operands(n)
        a @ b  # warm-up at the new size
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < seconds and len(times) < 50):
        t0 = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * n ** 3 / times[len(times) // 2]


def measured_matmul_flops_cached(device: torch.device, dtype: torch.dtype) -> float:
    """`measured_matmul_flops` of this device and dtype, measured once per process, thread count
    and float32 matmul setting (TF32 on a GPU is another rate, up to 7x): a run's summary
    reports it beside its MFU, and a process that runs many fits (a notebook, a population, a
    test suite) would otherwise spend 0.1-0.2 s measuring the same device again at each."""
    matmul = torch.backends.cuda.matmul
    settings = (torch.get_num_threads(), torch.get_float32_matmul_precision(), matmul.allow_tf32,
                matmul.allow_fp16_reduced_precision_reduction,
                matmul.allow_bf16_reduced_precision_reduction)
    return _measured_once(str(torch.device(device)), dtype, settings)


@functools.lru_cache(maxsize=None)
def _measured_once(device: str, dtype: torch.dtype, settings: tuple) -> float:
    # `settings` only keys the cache: the measurement runs under them as they are now
    return measured_matmul_flops(torch.device(device), dtype)
