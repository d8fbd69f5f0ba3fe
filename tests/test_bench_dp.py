"""`exatrain bench dp` writes the figures it promises, and counts exactly the gradient bytes.

(Speed is the benchmark's business, not a test's: this only checks the figures are there and
consistent, on a short run.)
"""

import json

from exatrain.cli import main


def test_bench_dp_writes_its_figures(tmp_path):
    out = tmp_path / "dp.json"
    assert main(["bench", "dp", "--json", str(out), "--steps", "2", "--warmup", "1"]) == 0
    result = json.loads(out.read_text())
    for key in ("ddp_step_s", "exatrain_step_s", "ratio_vs_ddp", "local_step_s",
                "allreduce_bytes_per_step", "allreduce_bytes_min", "exatrain_exposed_comm_fraction",
                "ddp_exposed_comm_fraction", "local_exposed_comm_fraction"):
        assert key in result
    assert 0 < result["exatrain_exposed_comm_fraction"] < 1  # gloo all-reduce: some is exposed
    assert result["allreduce_bytes_per_step"] == result["allreduce_bytes_min"]
    assert result["allreduce_bytes_min"] == 4 * 4_778_788  # CosmoFlow 32³ parameters, fp32
    assert result["ratio_vs_ddp"] > 0
