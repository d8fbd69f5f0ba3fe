"""Numbers in the units a person reads: MiB/GiB, GB/s, samples/s, seconds or minutes."""

from __future__ import annotations

import math


def human_bytes(n: float) -> str:
    """Binary units, as memory is counted: 19115152 -> '18.2 MiB'."""
    if n is None or not math.isfinite(n):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_rate(n: float, unit: str) -> str:
    """Decimal prefixes, as rates are: 4.6e10, 'FLOP/s' -> '46.3 GFLOP/s'."""
    if n is None or not math.isfinite(n):
        return "-"
    n = float(f"{n:.3g}")   # rounded first, so that 999,960 is 1 M, not 1e+03 k
    for prefix in ("", "k", "M", "G", "T", "P", "E"):
        if abs(n) < 1000 or prefix == "E":
            return f"{n:.3g} {prefix}{unit}"
        n /= 1000
    return f"{n:.3g} E{unit}"


def human_count(n: float, unit: str) -> str:
    """Counts as model sizes are written: 1.42e9, 'params' -> '1.42 B params', 41712 -> '41.7 k
    params', 999999 -> '1 M params'."""
    if n is None or not math.isfinite(n):
        return "-"
    n = float(f"{n:.3g}")   # rounded first, so that 999,999 is 1 M, not 1e+03 k
    for prefix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix} {unit}"
    return f"{n:.0f} {unit}"


def human_seconds(s: float) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


def human_value(key: str, value) -> str:
    """A metrics/summary value formatted by what its key says it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("bytes_per_s"):
        return human_rate(value, "B/s")
    if "bytes" in key and "ratio" not in key and "formula" not in key:
        return human_bytes(value)
    if key.endswith("flops_per_s") or key.endswith("flops_per_s_measured"):
        return human_rate(value, "FLOP/s")
    if key.endswith("samples_per_s"):
        return f"{value:.4g} samples/s"
    if key.endswith("tokens_per_s"):
        return human_rate(value, "tokens/s")
    # validation metrics are named after their targets (CosmoFlow's n_s), not units
    metric = key.startswith(("val_", "baseline_"))
    if (key.endswith("_s") or key.endswith("_s_median")) and not metric:
        return human_seconds(value)
    if key == "mfu" or "_fraction" in key:
        return f"{100 * value:.1f} %"
    if isinstance(value, float):
        return f"{value:.5g}"
    return str(value)
