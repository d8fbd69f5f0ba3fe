"""`exatrain bench faults --recovery` (bench/faults_recovery.py): one failure under a plain
restart, an elastic re-formation (two torchrun agents, one killed) and torchft's replica groups,
beside the uninterrupted run. Real launchers, real SIGKILLs; six launches of a 12-step job
(measured: 167 s and 178 s on this shared 2-core machine, most of it the processes' start-up)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exatrain.bench.faults_recovery import WAYS, kill_step, markdown_table
from exatrain.cli import main

pytest.importorskip("torchft", reason="the torchft row needs torchft (pip install exatrain[ft])")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "faults.md"
RESULTS = PAGE.parent / "results" / "faults-recovery.json"


def test_one_failure_three_ways_beside_the_uninterrupted_run(tmp_path, capsys):
    """The failure hits as step 7 starts; the last checkpoint is step 4, so a plain restart and
    an elastic re-formation redo steps 5 and 6; torchft's surviving group redoes none (it waits
    for the killed group, which heals from it). Every run ends at step 12; the ways without a
    failure lose no time by definition, the ways with one lose some (each against the
    fault-free run of its own launcher; the torchft survivor's wait shows in its pause)."""
    out = tmp_path / "recovery.json"
    # --timeout 5: the elastic survivor's wait in the collective with the dead rank (the
    # default, 10 s, is what a real job would rather wait; the assertions need > 5 s lost)
    assert main(["bench", "faults", "--recovery", "--steps", "12", "--every", "4",
                 "--kill-step", "7", "--timeout", "5", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    print(markdown_table(r))
    assert (r["kill_step"], r["checkpoint_every"], r["steps"], r["timeout_s"]) == (7, 4, 12, 5)
    for way in WAYS:
        assert r[f"{way}_steps"] == 12, way
        assert r[f"{way}_final_loss"] > 0 and r[f"{way}_val_mae"] > 0, way
    for way in ("uninterrupted", "elastic_no_failure", "torchft_no_failure"):
        assert r[f"{way}_recoveries"] == 0 and r[f"{way}_steps_redone"] == 0, way
    assert r["plain_recoveries"] == r["elastic_recoveries"] == r["torchft_recoveries"] == 1
    assert r["plain_steps_redone"] == r["elastic_steps_redone"] == 2   # steps 5 and 6
    assert r["torchft_steps_redone"] == 0
    # plain restart: the same ranks, the same batches, restarted from step 4: the same numbers
    assert r["plain_final_loss"] == r["uninterrupted_final_loss"]
    assert r["plain_val_mae"] == r["uninterrupted_val_mae"]
    # a restart starts the ranks again (seconds of imports): far above the launch-time noise;
    # the elastic survivor also waits out run.timeout_s (5 s) in the collective it was in
    assert r["plain_wall_lost_s"] > 0
    assert r["elastic_wall_lost_s"] > 5 and r["elastic_seconds_lost"] > 5
    assert r["torchft_pause_s"] > 1.0   # group 0 waited for the killed group (heartbeat: 2 s)
    assert r["torchft_wall_lost_s"] > 0  # that wait: a process start, seconds
    assert "torchft: a group lost" in capsys.readouterr().out


def test_the_page_holds_the_table_of_its_results_file():
    """docs/benchmarks/faults.md shows the table of the committed measurement, as the bench
    prints it: a new measurement cannot leave the page behind."""
    result = json.loads(RESULTS.read_text())
    assert markdown_table(result) in PAGE.read_text()
    assert kill_step(result["steps"], result["checkpoint_every"], 0) == result["kill_step"]


def test_a_kill_step_outside_the_run_is_refused_by_name():
    assert kill_step(40, 10, 0) == 26
    with pytest.raises(ValueError, match="--kill-step 41 is not within the run's steps 2..40"):
        kill_step(40, 10, 41)
