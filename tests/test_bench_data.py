"""`exatrain bench data` at tiny sizes: every figure is there (a smoke test of the benchmark's code
paths, not of its rates). It runs as a user runs it, in its own process: the benchmark forks loader
workers, which a test process with threads of earlier tests cannot do safely (a worker forked from
the test process died of a segfault)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def test_bench_data_smoke(tmp_path):
    """The CosmoFlow 128³ case (per-core rate, CPU decode and hyperslab variants, cores per GPU)
    shrunk to 16³ samples: warm, cold, staged and CPU-time figures for 0, 1 and 2 workers."""
    stage_to = tmp_path / "stage"
    stage_to.mkdir()
    small = ["model.size=16", "data.size=16", "data.samples=24", "model.base_channels=4",
             "model.conv_layers=4"]
    done = subprocess.run(
        [sys.executable, "-m", "exatrain.cli", "bench", "data", "--workloads", "cosmoflow128",
         "--data-dir", str(tmp_path / "data"), "--stage-to", str(stage_to), "--repeats", "1",
         "--samples", "8", "--real-steps", "0", "--json", str(tmp_path / "bench.json"),
         *(f"--set=cosmoflow128:{o}" for o in small)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "bench.json").read_text())
    for suffix in ("w0", "w1", "w2", "cold", "staged_cold", "cpu_decode_w1", "space2_w1"):
        for figure in ("loader_samples_per_s", "read_bytes_per_s", "loader_samples_per_cpu_s"):
            assert result[f"cosmoflow128_{figure}_{suffix}"] > 0, (figure, suffix)
    # the raw int16 counts of a 16³ × 4 sample and its 4 float32 targets, per sample delivered
    per_sample = result["cosmoflow128_read_bytes_per_s_w1"] / result[
        "cosmoflow128_loader_samples_per_s_w1"]
    assert per_sample == pytest.approx(16 ** 3 * 4 * 2 + 16)
    assert result["cosmoflow128_stage_s"] > 0 and result["cosmoflow128_model_samples_per_s"] > 0
    per_core = result["cosmoflow128_loader_samples_per_s_per_core"]
    assert per_core == result["cosmoflow128_loader_samples_per_cpu_s_w1"]
    assert result["cosmoflow128_cores_per_gpu"] == pytest.approx(200.0 / per_core)
    assert result["cosmoflow128_loader_over_model"] > 0
    assert result["loader_over_model_min"] == result["cosmoflow128_loader_over_model"]
    # the plain DataLoader beside it, with 1 and 2 workers on the same samples
    assert result["cosmoflow128_dataloader_samples_per_s_w1"] > 0
    # the paired ratios (each a median of passes in turn), and the lower of the two
    paired = [result[f"cosmoflow128_loader_vs_dataloader_w{w}"] for w in (1, 2)]
    assert all(r > 0 for r in paired)
    assert result["cosmoflow128_loader_vs_dataloader"] == min(paired)
    assert result["loader_vs_dataloader_min"] == result["cosmoflow128_loader_vs_dataloader"]

