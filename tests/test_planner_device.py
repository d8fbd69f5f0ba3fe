"""The planner against a device: `exatrain plan --calibrate-from` on the H100 bench figures
recorded in docs/benchmarks/results/h100-step (`tune.devicefit`). Nothing here times anything."""

import argparse
import dataclasses
import json
import math
from pathlib import Path

import pytest

from exatrain.bench.device_cases import cases
from exatrain.cli import main
from exatrain.errors import ArgumentError
from exatrain.plan import Plan
from exatrain.tune.cost import Options, predict
from exatrain.tune.commands import calibrate_from_command
from exatrain.tune.devicefit import CASES, UNKNOWN, case_config, compare, read_bench
from exatrain.tune.spec import spec_from_config
from exatrain.tune.systems import SYSTEMS_DIR, load_system

RESULTS = Path(__file__).parents[1] / "docs" / "benchmarks" / "results" / "h100-step"
RECORDED = [RESULTS / "bench-cosmoflow.json", RESULTS / "bench-deepcam.json",
            RESULTS / "bench-gpt-transcribed.json"]
KNOWN = {"cosmoflow", "gpt_125m", "gpt_1b"}   # the recorded cases the planner has a model of


def test_the_mirrored_cases_are_the_bench_cases():
    """tune cannot import bench (a layer above): its copy of the full-size cases must agree."""
    bench = {c.name: c for c in cases("full")}
    assert set(CASES) | set(UNKNOWN) == set(bench)
    for name, (workload, sets) in CASES.items():
        case = bench[name]
        assert workload == case.workload, name
        assert sets == {**case.sets, **{k: v for k, v in case.data_sets.items()
                                        if k in sets}}, name


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("device") / "h100-measured.toml"
    report = out.with_suffix(".json")
    assert main(["plan", "--calibrate-from", *map(str, RECORDED), "--system", "h100-infiniband",
                 "--calibrate-out", str(out), "--json", str(report)]) == 0
    return out, json.loads(report.read_text())


def test_one_row_per_recorded_case_the_planner_knows(calibrated):
    _, result = calibrated
    rows = {r["case"]: r for r in result["rows"]}
    assert set(rows) == KNOWN and len(result["rows"]) == len(KNOWN)
    assert "deepcam" in result["skipped"]                     # recorded, but no model of it
    cosmo = rows["cosmoflow"]
    assert (cosmo["batch"], cosmo["precision"], cosmo["compile"]) == (16, "bf16", True)
    assert cosmo["step_measured_s"] == pytest.approx(0.03766020774841308)
    assert cosmo["memory_measured_bytes"] == 9337395712
    assert rows["gpt_1b"]["step_measured_s"] == pytest.approx(4 / 26.2162)   # batch / samples/s
    assert rows["gpt_1b"]["memory_measured_bytes"] is None   # not recorded
    for r in result["rows"]:
        assert r["step_error"] == pytest.approx(r["step_predicted_s"] / r["step_measured_s"] - 1)
    assert result["step_mape"] == pytest.approx(
        100 * sum(abs(r["step_error"]) for r in result["rows"]) / len(KNOWN))
    assert result["memory_cases"] == 1
    # CosmoFlow is the only conv case: fitted exactly, never held out; the GPTs hold each other out
    assert result["not_held_out"] == ["cosmoflow"] and result["held_out_cases"] == 2


def test_calibrated_file_loads_and_predicts_the_measured_steps_closer(calibrated):
    out, result = calibrated
    sheet, fitted = load_system("h100-infiniband"), load_system(str(out))
    assert fitted.name == "h100-infiniband-measured"
    assert fitted.efficiency != sheet.efficiency
    assert fitted.overheads["step_error"] == pytest.approx(result["step_mape_held_out"] / 100)
    recorded, _ = read_bench(list(map(str, RECORDED)))
    errors = {"sheet": [], "fitted": []}
    for rec in recorded:
        spec = spec_from_config(case_config(rec))
        options = Options(batch=rec.batch, precision=rec.precision)
        for key, system in (("sheet", sheet), ("fitted", fitted)):
            errors[key].append(abs(predict(spec, Plan(), system, options, 1).step_s
                                   / rec.step_s - 1))
    assert sum(errors["fitted"]) < sum(errors["sheet"]), errors
    assert 100 * sum(errors["fitted"]) / len(recorded) == \
        pytest.approx(result["step_mape_calibrated"])


def test_fit_recovers_the_efficiency_steps_were_made_with(tmp_path):
    """Steps predicted on a known system are fitted back to its efficiencies, exactly; a case
    run with other settings names them (`<case>_sets`: here GPT 350m under gpt_125m's name)."""
    sheet = load_system("h100-infiniband")
    truth = {"matmul": 0.3, "conv": 0.12}
    made = dataclasses.replace(sheet, efficiency=truth)
    bench = {"device": "test", "precision": "bf16", "compile": True}
    recorded, _ = read_bench([str(RECORDED[0])])
    for name, batch in (("cosmoflow", 16), ("gpt_125m", 8)):
        sets = (("model.preset", "350m"),) if name == "gpt_125m" else ()
        rec = dataclasses.replace(recorded[0], case=name, batch=batch, params=None, sets=sets)
        spec = spec_from_config(case_config(rec))
        bench[f"{name}_exatrain_step_s_median"] = predict(
            spec, Plan(), made, Options(batch=batch, precision="bf16"), 1).step_s
        bench[f"{name}_batch"] = batch
        bench[f"{name}_params"] = spec.params
        bench.update({f"{name}_sets": dict(sets)} if sets else {})
    path = tmp_path / "made.json"
    path.write_text(json.dumps(bench))
    result = compare(read_bench([str(path)])[0], sheet)
    assert [r["model"] for r in result["rows"]] == ["CosmoFlow 128^3", "350m"]
    for kind, eff in truth.items():
        assert math.isclose(result["efficiency_after"][kind], eff, rel_tol=1e-6), kind
    assert result["step_mape_calibrated"] < 1e-4
    assert result["held_out_cases"] == 0 and result["step_mape_held_out"] is None


def test_refusals(tmp_path):
    args = argparse.Namespace(system="cpu-local", calibrate_from=[str(RECORDED[0])])
    with pytest.raises(ArgumentError, match="h100-infiniband"):      # cpu-local is --calibrate's
        calibrate_from_command(args)
    wrong = json.loads(RECORDED[0].read_text())
    wrong["cosmoflow_params"] += 1                                   # another model than ours
    path = tmp_path / "wrong.json"
    path.write_text(json.dumps(wrong))
    with pytest.raises(ArgumentError, match="parameters"):
        compare(read_bench([str(path)])[0], load_system("h100-infiniband"))
    (tmp_path / "other.json").write_text(json.dumps({"dp_step_s": 1.0}))
    with pytest.raises(ArgumentError, match="bench device"):
        read_bench([str(tmp_path / "other.json")])


def test_each_batch_size_of_a_case_is_its_own_record():
    """The planner check measures a case at two batch sizes (on the H200: GPT 1.3b at 4 and 8);
    both are compared, where the two once collapsed into the later file's."""
    h200 = Path(__file__).parents[1] / "docs" / "benchmarks" / "results" / "h200-2026-11-27"
    records, _ = read_bench([str(h200 / "plan-gpt_1b-b4.json"), str(h200 / "plan-gpt_1b-b8.json"),
                             str(h200 / "plan-gpt_125m-b8.json")])
    assert sorted((r.case, r.batch) for r in records) == [("gpt_125m", 8), ("gpt_1b", 4),
                                                           ("gpt_1b", 8)]
    again, _ = read_bench([str(h200 / "plan-gpt_1b-b8.json")] * 2)
    assert len(again) == 1  # the same run in two files counts once


def test_the_h200_table_of_the_planner_page_is_what_the_comparison_gives():
    """docs/benchmarks/planner.md's H200 rows and MAPEs, from the recorded JSONs (not copied)."""
    root = Path(__file__).parents[1]
    h200 = root / "docs" / "benchmarks" / "results" / "h200-2026-11-27"
    result = compare(read_bench([str(p) for p in sorted(h200.glob("plan-*.json"))])[0],
                     load_system("h200-infiniband"))
    page = (root / "docs" / "benchmarks" / "planner.md").read_text()
    section = page[page.index("### Beside an H200"):]
    names = {"gpt_125m": "GPT 125m", "gpt_1b": "GPT 1.3b"}
    for row in result["rows"]:
        cells = (f"| {names[row['case']]} | {row['batch']} | "
                 f"{row['step_predicted_s'] * 1e3:.0f} ms | {row['step_measured_s'] * 1e3:.1f} ms | "
                 f"{row['step_error'] * 100:+.1f} % | "
                 f"{row['memory_predicted_bytes'] / 2**30:.1f} GiB | "
                 f"{row['memory_measured_bytes'] / 2**30:.1f} GiB | "
                 f"{row['memory_error'] * 100:+.1f} % |").replace("-", "−")
        assert cells in section, cells
    assert f"Step MAPE **{result['step_mape']:.1f} %**, memory MAPE " \
           f"**{result['memory_mape']:.1f} %**" in section
    assert f"in-sample, {result['step_mape_held_out']:.1f} % leave-one-out" in section


def test_calibrate_from_writes_into_the_users_systems_folder_never_into_the_package(
        tmp_path, monkeypatch, capsys):
    """A site install keeps the package read-only: without --calibrate-out the fitted system goes
    to the user's systems folder, where --system finds it by name before the shipped files."""
    mine = tmp_path / "systems"
    monkeypatch.setenv("EXATRAIN_SYSTEMS_DIR", str(mine))
    shipped = {p.name: p.read_bytes() for p in SYSTEMS_DIR.glob("*.toml")}
    assert main(["plan", "--calibrate-from", *map(str, RECORDED), "--system",
                 "h100-infiniband"]) == 0
    written = mine / "h100-infiniband-measured.toml"
    assert written.is_file()
    # (words, as the console wraps them at its width)
    words = " ".join(capsys.readouterr().out.split())
    assert "plan with --system h100-infiniband-measured" in words
    assert {p.name: p.read_bytes() for p in SYSTEMS_DIR.glob("*.toml")} == shipped
    # a user's file of a shipped name is the one a name loads
    written.write_text(written.read_text().replace('description = "', 'description = "mine: ', 1))
    assert load_system("h100-infiniband-measured").description.startswith("mine: ")
    assert not load_system(str(SYSTEMS_DIR / "h100-infiniband-measured.toml")).description \
        .startswith("mine: ")
