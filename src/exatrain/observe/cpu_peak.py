"""A processor's peak FLOP/s, the denominator of MFU on a CPU: cores × clock × FLOPs per cycle.

A GPU's peak is a datasheet figure; a CPU's is worked out from what the machine says about
itself, and each factor is stated with where it came from (`Peak.source`, in the run summary):

  cores    the threads this rank computes with (torch.get_num_threads()), at most the physical
           cores it may run on (os.sched_getaffinity, less hyper-threads: siblings share a
           core's vector units)
  clock    the highest clock the kernel reports: cpufreq's cpuinfo_max_freq, else `cpu MHz` of
           /proc/cpuinfo (a virtual machine's nominal clock; boost may run above it), else the
           `@ 2.20GHz` of the model name
  per cycle  from the instruction-set flags of /proc/cpuinfo, for the step's dtype, assuming the
           vector units named in `_fp32_per_cycle`; an FMA counts as two FLOPs

The measured rate of a matrix multiply (`observe.matmul_rate.measured_matmul_flops`) is reported
beside it: what this rank sustains, where the peak says what the silicon could do.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
CPUFREQ = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")


@dataclasses.dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s
    source: str   # how it was worked out, each factor with where it came from


def _fp32_per_cycle(flags: set[str], vendor: str, family: int) -> tuple[int, str] | None:
    """fp32 FLOPs per cycle per core of the widest instruction set in `flags`, and the vector
    units that figure assumes."""
    if "avx512f" in flags:
        if vendor == "AuthenticAMD" and family < 26:  # Zen 4 splits a 512-bit op in two
            return 32, "AVX-512 on two 256-bit FMA pipes (AMD Zen 4) × 8 lanes × 2"
        return 64, ("AVX-512: two 512-bit FMA units × 16 lanes × 2 (Xeon Gold/Platinum, AMD "
                    "Zen 5; parts with one unit reach half)")
    if "avx2" in flags and "fma" in flags:
        return 32, ("AVX2 + FMA: two 256-bit FMA units × 8 lanes × 2 (Intel Haswell and later, "
                    "AMD Zen 2 and later)")
    if "avx" in flags:
        return 16, "AVX: one 256-bit add and one multiply per cycle × 8 lanes"
    if "asimd" in flags:  # aarch64's `Features`
        return 16, "NEON: two 128-bit FMA pipes × 4 lanes × 2 (SVE width not counted)"
    if "sse2" in flags:
        return 8, "SSE2: one 128-bit add and one multiply per cycle × 4 lanes"
    return None


def _per_cycle(flags: set[str], vendor: str, family: int, dtype: torch.dtype):
    fp32 = _fp32_per_cycle(flags, vendor, family)
    if fp32 is None:
        return None
    if dtype == torch.bfloat16:
        if "amx_bf16" in flags:
            return 1024, "AMX-BF16 tiles (Intel's 1024 bf16 FLOPs per cycle per core)"
        if "avx512_bf16" in flags:
            return 2 * fp32[0], f"AVX512-BF16 dot products: twice fp32's ({fp32[1]})"
    if dtype == torch.float16:
        if "amx_fp16" in flags:
            return 1024, "AMX-FP16 tiles (Intel's 1024 fp16 FLOPs per cycle per core)"
        if "avx512fp16" in flags:
            return 2 * fp32[0], f"AVX512-FP16: twice fp32's ({fp32[1]})"
    if dtype in (torch.bfloat16, torch.float16):
        return fp32[0], f"no {dtype} instructions: fp32's rate at best ({fp32[1]})"
    return fp32


def _fields(text: str) -> dict[str, str]:
    """The first processor's `key : value` lines of /proc/cpuinfo."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, _, value = line.partition(":")
        out.setdefault(key.strip(), value.strip())
    return out


def _clock_hz(info: dict[str, str], cpufreq: Path) -> tuple[float, str] | None:
    try:
        return int(cpufreq.read_text()) * 1e3, f"cpufreq max ({cpufreq})"
    except (OSError, ValueError):
        pass
    if info.get("cpu MHz"):
        return float(info["cpu MHz"]) * 1e6, "`cpu MHz` of /proc/cpuinfo"
    match = re.search(r"@\s*([\d.]+)\s*GHz", info.get("model name", ""))
    if match:
        return float(match.group(1)) * 1e9, "the model name"
    return None


def cpu_peak(dtype: torch.dtype = torch.float32, threads: int | None = None,
             cpuinfo: Path = CPUINFO, cpufreq: Path = CPUFREQ) -> Peak | None:
    """This rank's peak FLOP/s on the CPU in `dtype`; None where the processor does not say
    enough (no /proc/cpuinfo, no clock, an instruction set not in the table)."""
    try:
        info = _fields(cpuinfo.read_text())
    except OSError:
        return None
    flags = set((info.get("flags") or info.get("Features") or "").split())
    family = int(info["cpu family"]) if info.get("cpu family", "").isdigit() else 0
    per_cycle = _per_cycle(flags, info.get("vendor_id", ""), family, dtype)
    clock = _clock_hz(info, cpufreq)
    if per_cycle is None or clock is None:
        return None
    usable = len(os.sched_getaffinity(0))
    siblings, cores = info.get("siblings", ""), info.get("cpu cores", "")
    if siblings.isdigit() and cores.isdigit() and int(siblings) > int(cores):
        usable = max(1, usable * int(cores) // int(siblings))  # hyper-threads share a core
    threads = threads or torch.get_num_threads()
    n = min(threads, usable)
    name = str(dtype).removeprefix("torch.")
    source = (f"{n} core(s) (this rank's {threads} torch thread(s), {usable} physical core(s) "
              f"usable) × {clock[0] / 1e9:.2f} GHz ({clock[1]}) × {per_cycle[0]} {name} "
              f"FLOP/cycle ({per_cycle[1]}; assumed from the cpuinfo flags)")
    return Peak(n * clock[0] * per_cycle[0], source)
