"""The H200 figures in the README and the GPU how-to are the recorded JSONs' (not retyped)."""

import json
from pathlib import Path

ROOT = Path(__file__).parents[1]
H200 = ROOT / "docs" / "benchmarks" / "results" / "h200-2026-11-27"


def _bench(case: str) -> dict:
    return json.loads((H200 / f"bench-{case}.json").read_text())


def _rate(d: dict, case: str, path: str) -> str:
    tokens = d.get(f"{case}_{path}_tokens_per_s")
    if tokens:
        return f"{tokens / 1e3:.0f}k tokens/s"
    return f"{d[f'{case}_{path}_samples_per_s']:.1f} samples/s"


def test_the_h200_rows_are_the_recorded_figures():
    readme = (ROOT / "README.md").read_text()
    howto = (ROOT / "docs" / "how-to" / "gpu-bench.md").read_text()
    howto = howto[howto.index("## Measured on one H200"):]
    for case in ("gpt_125m", "vit", "deepcam"):
        d = _bench(case)
        ours, base = _rate(d, case, "exatrain"), _rate(d, case, "baseline")
        mfu = f"{100 * d[f'{case}_exatrain_mfu_peak']:.1f} % of peak"
        row = f"| {ours}, {mfu} | {base} | "
        assert row in readme, (case, row)
        assert row + f"**{d[f'{case}_vs_baseline']:.2f}** |" in howto, (case, row)
        assert f"{row}{d[f'{case}_vs_baseline']:.2f} |" in readme, case
        peak = f"{d[f'{case}_exatrain_peak_memory_bytes'] / 2**30:.1f} GiB"
        assert f"| {peak} |" in howto, (case, peak)
    graphs = _bench("gpt_125m")
    assert f"| {graphs['gpt_125m_alt_tokens_per_s'] / 1e3:.0f}k tokens/s | (same call) | " \
           f"{graphs['gpt_125m_alt_vs_exatrain']:.2f} of the step without graphs" in howto
