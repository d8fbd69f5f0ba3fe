"""A CPU's peak FLOP/s from what /proc/cpuinfo and cpufreq say (files written here, shaped as
the kernel writes them), and the default job's summary stating it beside the measured rate."""

from __future__ import annotations

import os

import pytest
import torch

from exatrain.observe.cpu_peak import cpu_peak

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model name\t: AMD EPYC
cpu MHz\t\t: 2596.136
siblings\t: 2
cpu cores\t: 2
flags\t\t: fpu sse2 avx fma avx2 avx512f avx512_bf16

processor\t: 1
vendor_id\t: AuthenticAMD
"""
XEON = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model name\t: Intel(R) Xeon(R) Platinum 8480+ @ 2.00GHz
siblings\t: 4
cpu cores\t: 2
flags\t\t: sse2 avx fma avx2 avx512f amx_bf16
"""


def test_the_peak_is_cores_times_clock_times_flops_per_cycle_with_its_sources(tmp_path):
    info, freq = tmp_path / "cpuinfo", tmp_path / "cpuinfo_max_freq"
    info.write_text(EPYC)
    peak = cpu_peak(torch.float32, threads=1, cpuinfo=info, cpufreq=freq)
    assert peak.flops == pytest.approx(1 * 2.596136e9 * 32)   # Zen 4: 256-bit pipes
    assert "2.60 GHz (`cpu MHz` of /proc/cpuinfo)" in peak.source and "Zen 4" in peak.source
    assert cpu_peak(torch.bfloat16, threads=1, cpuinfo=info, cpufreq=freq).flops == \
        pytest.approx(2.596136e9 * 64)
    freq.write_text("3700000\n")  # kHz: cpufreq's maximum comes first
    assert cpu_peak(torch.float32, threads=1, cpuinfo=info, cpufreq=freq).flops == \
        pytest.approx(3.7e9 * 32)

    info.write_text(XEON)  # two hyper-threads a core: half the usable CPUs are cores
    usable = max(1, len(os.sched_getaffinity(0)) // 2)
    peak = cpu_peak(torch.float32, threads=64, cpuinfo=info, cpufreq=tmp_path / "none")
    assert peak.flops == pytest.approx(usable * 2.0e9 * 64)
    assert "the model name" in peak.source
    assert cpu_peak(torch.bfloat16, threads=1, cpuinfo=info,
                    cpufreq=tmp_path / "none").flops == pytest.approx(2.0e9 * 1024)

    info.write_text(EPYC.replace("cpu MHz\t\t: 2596.136\n", ""))  # no clock: no peak
    assert cpu_peak(torch.float32, cpuinfo=info, cpufreq=tmp_path / "none") is None


def test_the_summary_states_the_cpu_peak_and_mfu_against_it(tiny_config):
    from exatrain.train.run import run_job
    summary = run_job(tiny_config("train.steps=3", "train.eval_every=0"))
    assert " core(s) " in summary["peak_flops_source"] and " GHz " in summary["peak_flops_source"]
    assert summary["mfu"] == pytest.approx(
        summary["model_flops_per_s"] / summary["peak_flops_per_s"])
    assert summary["matmul_flops_per_s_measured"] > 0


def test_the_matmul_rate_is_measured_once_per_process_and_thread_count():
    """A process that runs many fits measures the device once; another thread count or float32
    matmul setting is another measurement (the rate scales with the cores a rank uses; TF32 is
    another rate on a GPU)."""
    from exatrain.observe.matmul_rate import _measured_once, measured_matmul_flops_cached as rate

    matmul = torch.backends.cuda.matmul
    before, reduced = torch.get_num_threads(), matmul.allow_bf16_reduced_precision_reduction
    _measured_once.cache_clear()
    try:
        first = rate(torch.device("cpu"), torch.float32)
        assert first > 0 and rate("cpu", torch.float32) == first
        assert _measured_once.cache_info().misses == 1
        torch.set_num_threads(1 if before > 1 else 2)
        rate("cpu", torch.float32)
        assert _measured_once.cache_info().misses == 2
        # a matmul setting (a plain flag: set_float32_matmul_precision would leave oneDNN's
        # precision changed for the tests after this one, even when set back)
        matmul.allow_bf16_reduced_precision_reduction = not reduced
        rate("cpu", torch.float32)
        assert _measured_once.cache_info().misses == 3
    finally:
        torch.set_num_threads(before)
        matmul.allow_bf16_reduced_precision_reduction = reduced
