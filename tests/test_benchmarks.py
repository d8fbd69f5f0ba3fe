"""The spatial, ZeRO and tensor benchmarks write the figures their issues name, on small settings.

Only counted bytes, memory and errors are asserted (they are exact on any machine); step times
are the benchmarks' business, never a test's.
"""

import json

import pytest

from exatrain.cli import main


def bench(tmp_path, *args) -> dict:
    out = tmp_path / "bench.json"
    assert main(["bench", *args, "--json", str(out), "--steps", "1", "--warmup", "1"]) == 0
    return json.loads(out.read_text())


def test_bench_spatial(tmp_path):
    r = bench(tmp_path, "spatial", "--size", "32")
    for key in ("max_rel_err_vs_serial", "halo_bytes_per_step", "halo_bytes_min",
                "activation_bytes_per_rank", "activation_bytes_serial", "step_s_serial",
                "step_s_spatial", "ranks", "exposed_comm_fraction_spatial",
                "exposed_comm_fraction_spatial_overlap"):
        assert key in r, key
    assert r["exposed_comm_fraction_serial"] == 0  # the serial step communicates nothing
    assert 0 < r["exposed_comm_fraction_spatial"] < 1
    for ranks in (2, 4):
        assert r[f"halo_bytes_per_step_{ranks}ranks"] <= 1.05 * r[f"halo_bytes_min_{ranks}ranks"]
        assert r[f"halo_bytes_per_step_{ranks}ranks"] >= r[f"halo_bytes_min_{ranks}ranks"] > 0
        assert r[f"activation_bytes_per_rank_{ranks}ranks"] <= \
            1.15 * r[f"activation_bytes_serial_{ranks}ranks"] / ranks
        assert r[f"max_rel_err_vs_serial_fp64_{ranks}ranks"] <= 1e-10


def test_bench_zero(tmp_path):
    r = bench(tmp_path, "zero", "--size", "64", "--worlds", "2")
    for stage in range(4):
        for key in ("state_bytes_per_rank", "state_bytes_formula", "state_ratio", "step_s",
                    "step_s_fsdp2_baseline"):
            assert f"w2_stage{stage}_{key}" in r, (stage, key)
        assert 1.0 <= r[f"w2_stage{stage}_state_ratio"] <= 1.10


def test_bench_tensor(tmp_path):
    r = bench(tmp_path, "tensor", "--worlds", "4", "--models", "gpt")
    assert r["bytes_ratio"] == pytest.approx(1.0, abs=0.05)
    assert r["bytes_ratio_min"] == pytest.approx(1.0, abs=0.05)
    assert r["max_rel_err_vs_serial"] <= 1e-5
    assert {"gpt w4 serial", "gpt w4 tensor=4", "gpt w4 tensor=(2,1,2)"} <= set(r["step_s"])
    assert set(r["bytes_by_axis"]) == set(r["bytes_formula_by_axis"])


def test_bench_chanfilt(tmp_path):
    r = bench(tmp_path, "chanfilt", "--models", "cosmoflow", "--channels", "4", "--size", "32")
    assert r["tensor_bytes_ratio_max"] == pytest.approx(1.0, abs=0.05)
    assert r["tensor_bytes_ratio_min"] == pytest.approx(1.0, abs=0.05)
    assert r["max_rel_err_vs_serial_all"] <= 1e-5
    assert set(r["step_s"]) == {"cosmoflow serial", "cosmoflow data=2", "cosmoflow space=(1,1,2)",
                                "cosmoflow tensor=2", "cosmoflow data=2 tensor=2",
                                "cosmoflow space=(1,1,2) tensor=2"}
    # the split layers' gradients (ledger bytes less the whole parameters'): half the bytes per
    # rank; the whole model's all-reduce falls by less (the Linear head's first layer and the
    # channel conv's bias stay whole)
    assert r["cosmoflow_split_grad_allreduce_fall"] == pytest.approx(2.0, rel=1e-9)
    assert r["cosmoflow_split_grad_allreduce_bytes_per_rank"]["data=2 tensor=2"] > 0
    assert 1.5 < r["cosmoflow_grad_allreduce_fall_data_vs_data_tensor"] <= 2.0
    assert r["state_ratio_vs_serial"]["cosmoflow tensor=2"] < 0.6
