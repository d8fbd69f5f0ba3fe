"""Every figure a run writes has a row in exatrain.observe.fields, so the Run summary
reference page (generated from those rows by docs/hooks.py) cannot leave a new key out."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exatrain.observe.fields import METRICS, POPULATION, SUMMARY, format_value, lookup

DOCS = Path(__file__).parents[1] / "docs"


def _summary_page() -> str:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks.summary_reference()


def test_every_key_a_run_writes_is_in_the_reference_page(tiny_config):
    from exatrain.train.run import run_job

    # a target makes the target figures appear; the run stops at the first evaluation meeting it
    summary = run_job(tiny_config("train.steps=4", "train.log_every=2", "train.eval_every=2",
                                  'train.target="val_mae <= 100"'), None)
    run_dir = Path(summary["run_dir"])
    written = json.loads((run_dir / "summary.json").read_text())
    assert written.keys() == summary.keys()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = set().union(*lines)
    assert {"loss", "val_mae", "bytes_per_step", "target_reached"} <= set(logged) | set(written)

    page = _summary_page()
    undocumented = [k for k in written if lookup(k) is None]
    assert not undocumented, (f"summary.json keys with no row in exatrain.observe.fields "
                              f"(add one: name, unit, meaning, when): {undocumented}")
    undocumented = [k for k in logged if lookup(k, METRICS) is None]
    assert not undocumented, f"metrics.jsonl keys with no row in fields.METRICS: {undocumented}"
    for key in written:
        assert f"| `{lookup(key).name}` |" in page, key
    for key in ("final_loss", "stopped_by_signal", "nonfinite_skipped", "checkpoint_saves",
                "restart_history"):
        assert f"| `{key}` |" in page


def test_a_key_without_a_row_is_caught_and_families_match_their_pattern():
    assert lookup("a_figure_nobody_documented") is None
    assert lookup("val_mae_Omega_m").name == "val_<metric>"
    assert lookup("final_val_mae_by_trainer").name == "final_<metric>_by_trainer"
    names = [row.name for row in SUMMARY + POPULATION]
    assert len(names) == len(set(names)) and len({r.name for r in METRICS}) == len(METRICS)
    assert format_value("state_bytes", 3 * 2**20) == "3.0 MiB"
    assert format_value("data_wait_fraction", 0.25) == "25.0 %"
    assert format_value("val_mae_H0", 0.5) == "0.5"          # a metric named like a unit is not one


def _printed_rows(stderr: str) -> list[str]:
    """The first column of the `run summary` table `exatrain run` printed."""
    table = stderr[stderr.index("run summary"):]
    return [line.split("│")[1].strip() for line in table.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()]


@pytest.mark.parametrize("kind", ["plain", "restarted", "population"])
def test_the_console_prints_a_row_for_each_key_of_summary_json_and_no_other(kind, cosmo_data,
                                                                            tmp_path):
    """`exatrain run` as a user runs it (a subprocess): its printed rows are summary.json's keys,
    in order, for a one-rank run, a run restarted once after its rank was killed, and a
    population of two trainers."""
    from conftest import TINY
    extra = {"plain": ["--nproc", "1"],
             # no loader workers: those of a SIGKILLed rank outlive it (their parent check
             # sees the forkserver), holding the pipe this test reads to its end
             "restarted": ["--nproc", "1", "--max-restarts", "1", "--set",
                           "train.checkpoint_every=2", "--set", "train.num_workers=0"],
             "population": ["--nproc", "2", "--set", "plan.trainer=2", "--set",
                            "population.interval=2", "--set", "train.steps=2"]}[kind]
    sets = [*TINY, f"data.path={cosmo_data}", f"run.out_dir={tmp_path}", "train.steps=4",
            "train.eval_every=2", "train.log_every=2"]
    env = {**os.environ, "COLUMNS": "400"}  # one line per row, however long its value
    if kind == "restarted":
        env["EXATRAIN_INJECT_FAULTS"] = "kill@0:3"  # as step 3 starts, after the step-2 save
    run = subprocess.run([sys.executable, "-m", "exatrain.cli", "run",
                          *[a for s in sets for a in ("--set", s)], *extra],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    written = json.loads((run_dir / "summary.json").read_text())
    assert _printed_rows(run.stderr) == list(written)
    if kind == "restarted":
        assert written["restarts"] == 1 and written["lost_steps"] == 0
        assert written["restart_history"][0]["resumed_from_step"] == 2
    elif kind == "population":
        assert written["restarts"] == 0 and written["trainers"] == 2
