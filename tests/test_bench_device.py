"""`exatrain bench device` on CPU at --sizes small: the harness runs, its baseline and exatrain
paths train the same model on the same batches, its JSON has every figure issue 27 names, and
every lever is measured, a no-op with a note, or refused with a reason where the device cannot
pull it (CUDA graphs on a CPU, fp8 before Hopper).

Tolerance of the agreement: fp32 on one CPU process, the step losses of the two paths (three
steps: the first checks model and batch, the next two the optimizer) within relative 1e-5
(measured: 1e-7; fused against foreach AdamW and channels-last convolutions round differently).
"""

from __future__ import annotations

import statistics

import pytest
import torch

from exatrain.bench import device_baseline
from exatrain.bench.device import run
from exatrain.bench.device_peaks import datasheet_peak_flops, device_key
from exatrain.cli import build_parser

CASES = ("cosmoflow", "deepcam", "vit", "gpt_125m", "gpt_1b")
FIGURES = ("samples_per_s", "mfu_peak", "mfu_measured", "peak_memory_bytes", "step_s_median",
           "data_wait_fraction", "losses")


def bench(tmp_path, *extra) -> dict:
    args = build_parser().parse_args(["bench", "device", "--sizes", "small", "--no-compile",
                                      "--workers", "0", "--data-dir", str(tmp_path), *extra])
    return run(args)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return bench(tmp_path_factory.mktemp("data"), "--warmup", "1", "--steps", "2", "--rounds", "2")


def test_baseline_and_exatrain_agree_on_every_workload(small):
    assert small["device"] == "cpu" and small["precision"] == "fp32"
    for case in CASES:
        base, ours = small[f"{case}_baseline_losses"], small[f"{case}_exatrain_losses"]
        assert len(base) == len(ours) == 3, case
        assert small[f"{case}_loss_max_rel_diff"] <= 1e-5, (case, base, ours)
        assert ours[0] != ours[-1], case  # it trained: a loss that never moves proves nothing


def test_json_has_every_figure_the_issue_names(small):
    for case in CASES:
        for variant in ("baseline", "exatrain"):
            for figure in FIGURES:
                assert f"{case}_{variant}_{figure}" in small, (case, variant, figure)
            assert small[f"{case}_{variant}_samples_per_s"] > 0
            assert small[f"{case}_{variant}_mfu_peak"] is None  # no datasheet peak for a CPU
            assert 0 < small[f"{case}_{variant}_mfu_measured"]
            assert 0 <= small[f"{case}_{variant}_data_wait_fraction"] <= 1
        # two rounds, each path in turn first: the ratio is the median of the paired ratios
        rounds = small[f"{case}_vs_baseline_rounds"]
        assert len(rounds) == 2 and all(r > 0 for r in rounds)
        assert small[f"{case}_vs_baseline"] == pytest.approx(statistics.median(rounds))
        for key in ("published_value", "published_unit", "published_source", "vs_published"):
            assert f"{case}_{key}" in small
        assert small[f"{case}_vs_published"] is None  # only full sizes compare with a paper
    for case in ("gpt_125m", "gpt_1b"):
        assert small[f"{case}_exatrain_tokens_per_s"] == pytest.approx(
            small[f"{case}_exatrain_samples_per_s"] * 32)  # block_size of the small shape


def test_every_lever_runs_or_is_refused_on_cpu(tmp_path):
    result = bench(tmp_path, "--cases", "gpt_125m", "--levers", "all", "--compile-backend",
                   "eager", "--warmup", "0", "--steps", "1")
    assert "CUDA graphs need a CUDA device" in result["gpt_125m_cuda_graphs_refused"]
    assert "compute capability 8.9" in result["gpt_125m_fp8_refused"]
    for lever in ("plain", "bf16", "fp16", "compile", "foreach", "fused", "sdpa"):
        assert result[f"gpt_125m_{lever}_samples_per_s"] > 0, lever
        assert f"gpt_125m_{lever}_refused" not in result
    assert "no-op" in result["gpt_125m_bf16_note"]  # cudnn.benchmark on a CPU
    for lever in ("bf16", "fp16", "compile", "foreach", "fused", "sdpa"):
        assert f"gpt_125m_{lever}_speedup_vs_plain" in result
    # every lever trains the same model on the same first batch
    first = result["gpt_125m_plain_losses"][0]
    for lever in ("compile", "foreach", "fused", "sdpa"):
        assert result[f"gpt_125m_{lever}_losses"][0] == pytest.approx(first, rel=1e-5)
    for lever in ("bf16", "fp16"):  # autocast on a CPU: half-precision rounding
        assert result[f"gpt_125m_{lever}_losses"][0] == pytest.approx(first, rel=2e-2)


def test_refusals_name_the_device_and_the_fix():
    cpu = torch.device("cpu")
    assert device_baseline.refusal(device_baseline.LEVERS["cuda_graphs"], cpu) is not None
    assert "device is 'cpu'" in device_baseline.refusal(device_baseline.LEVERS["fp8"], cpu)
    for name in ("bf16", "fp16", "compile", "foreach", "fused", "sdpa"):
        assert device_baseline.refusal(device_baseline.LEVERS[name], cpu) is None, name
    with pytest.raises(ValueError, match="unknown warp"):
        bench("/nonexistent", "--levers", "warp")


def test_datasheet_table_knows_the_devices_by_name():
    assert device_key("NVIDIA H100 80GB HBM3") == "h100"
    assert device_key("NVIDIA H100 PCIe") == "h100 pcie"
    assert device_key("NVIDIA H100 NVL") == "h100 nvl"
    assert device_key("NVIDIA H200") == "h200"
    assert device_key("NVIDIA A100-SXM4-80GB") == "a100"
    assert device_key("NVIDIA GeForce RTX 3090") is None
    assert datasheet_peak_flops(torch.device("cpu"), "bf16") is None


def test_sharing_a_gpu_without_one_is_refused(monkeypatch):
    from exatrain.mesh import SHARE_GPU_ENV, init
    from exatrain.plan import Plan
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU machine
    monkeypatch.setenv(SHARE_GPU_ENV, "1")
    with pytest.raises(RuntimeError, match="no CUDA device; unset EXATRAIN_SHARE_GPU"):
        init(Plan())


def test_profile_reports_host_syncs_compiled_graphs_and_a_table(tmp_path):
    """--profile on a CPU: exatrain's steps between read points read nothing (0 host syncs per
    step), compile captured the model whole (graphs, no break), and each path's top-operators
    table is written beside the JSON. The eager backend: Dynamo's capture is what is checked."""
    out = tmp_path / "profile.json"
    torch._dynamo.reset()  # graphs an earlier test compiled for the same model would be reused
    args = build_parser().parse_args([
        "bench", "device", "--sizes", "small", "--workers", "0", "--data-dir", str(tmp_path),
        "--cases", "gpt_125m", "--warmup", "1", "--steps", "2", "--compile-backend", "eager",
        "--profile", "--profile-steps", "2", "--json", str(out)])
    r = run(args)
    assert r["gpt_125m_exatrain_host_syncs_per_step"] == 0
    assert r["gpt_125m_exatrain_compiled_graphs"] >= 1 and r["gpt_125m_exatrain_graph_breaks"] == 0
    for variant in ("exatrain", "baseline"):
        table = r[f"gpt_125m_{variant}_profile_table"]
        assert table.startswith(str(tmp_path / "profile-profile-gpt_125m-"))
        assert "Self CPU" in open(table).read()
        assert 0 <= r[f"gpt_125m_{variant}_compiled_share"] <= 1


def test_an_alt_variant_trains_the_same_batches_with_its_own_settings(tmp_path):
    result = bench(tmp_path, "--cases", "gpt_125m", "--warmup", "1", "--steps", "2", "--rounds",
                   "1", "--alt-set", "train.clip_grad_norm=1e-3")
    ours, alt = result["gpt_125m_exatrain_losses"], result["gpt_125m_alt_losses"]
    assert alt[0] == pytest.approx(ours[0], rel=1e-6)  # same weights, same first batch
    assert alt[-1] != pytest.approx(ours[-1], rel=1e-6)  # its own setting took effect: clipped
    assert result["gpt_125m_alt_settings"] == ["train.clip_grad_norm=1e-3"]
    assert result["gpt_125m_alt_vs_exatrain"] == pytest.approx(
        result["gpt_125m_exatrain_step_s_median"] / result["gpt_125m_alt_step_s_median"])
    k = max(1, min(20, len(ours) // 2))   # the means of the last steps, against exatrain's
    mean = lambda xs: sum(xs[-k:]) / k    # noqa: E731
    assert result["gpt_125m_alt_loss_rel_diff"] == pytest.approx(
        abs(mean(alt) - mean(ours)) / mean(ours))


def test_a_refused_alt_variant_keeps_the_cases_figures(tmp_path):
    result = bench(tmp_path, "--cases", "gpt_125m", "--warmup", "1", "--steps", "1", "--rounds",
                   "1", "--alt-set", "parallel.cuda_graphs=true")
    assert "needs a GPU" in result["gpt_125m_alt_refused"]
    assert result["gpt_125m_vs_baseline"] > 0 and "gpt_125m_alt_vs_exatrain" not in result


def test_the_json_records_what_set_changed(tmp_path):
    result = bench(tmp_path, "--cases", "gpt_125m", "--warmup", "1", "--steps", "1", "--rounds",
                   "1", "--set", "train.clip_grad_norm=0.5", "--set", 'model.n_embd=32')
    assert result["gpt_125m_sets"] == {"train.clip_grad_norm": 0.5, "model.n_embd": 32}
    assert result["gpt_125m_params"] > 0


def test_without_the_baseline_only_exatrains_figures_are_written(tmp_path):
    result = bench(tmp_path, "--cases", "cosmoflow", "--warmup", "1", "--steps", "1", "--rounds",
                   "1", "--no-baseline")
    assert result["cosmoflow_exatrain_step_s_median"] > 0
    assert result["cosmoflow_exatrain_peak_memory_bytes"] > 0
    assert not any(k.startswith("cosmoflow_baseline_") for k in result)
    assert result["cosmoflow_vs_baseline"] is None and result["cosmoflow_loss_max_rel_diff"] is None


def test_deepcam_reference_network_trains_the_same_loss_in_both_paths(tmp_path):
    """The full-size case runs MLPerf's network, whose loss weighs classes by f^(-1/8) over the
    pixel count; the plain loop must train that loss too (it once kept the small net's)."""
    result = bench(tmp_path, "--cases", "deepcam", "--warmup", "1", "--steps", "2", "--rounds",
                   "1", "--set", 'model.variant="reference"', "--set", "model.width_multiplier=0.25")
    base, ours = result["deepcam_baseline_losses"], result["deepcam_exatrain_losses"]
    assert result["deepcam_loss_max_rel_diff"] <= 1e-5, (base, ours)
    assert ours[0] != ours[-1]


def test_an_alt_variant_in_another_precision_is_measured_against_that_precision(tmp_path):
    """An fp8 (here bf16) variant beside an fp32 case: its MFU divides by its own rates."""
    import torch

    from exatrain.observe.matmul_rate import measured_matmul_flops_cached
    result = bench(tmp_path, "--cases", "gpt_125m", "--warmup", "1", "--steps", "2", "--rounds",
                   "1", "--precision", "fp32", "--alt-set", "parallel.precision=bf16")
    assert result["gpt_125m_exatrain_precision"] == "fp32"
    assert result["gpt_125m_alt_precision"] == "bf16"
    rates = {name: measured_matmul_flops_cached(torch.device("cpu"), dtype)
             for name, dtype in (("exatrain", torch.float32), ("alt", torch.bfloat16))}
    assert rates["exatrain"] != rates["alt"]
    # the model's FLOP/s over each variant's MFU gives back the rate it was taken against
    model_flops = {v: result[f"gpt_125m_{v}_mfu_measured"] * rates[v] for v in rates}
    per_sample = {v: model_flops[v] / result[f"gpt_125m_{v}_samples_per_s"] for v in rates}
    assert per_sample["alt"] == pytest.approx(per_sample["exatrain"], rel=1e-9)
