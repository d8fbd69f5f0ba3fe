"""The command line as a user runs it: a real subprocess of the installed `exatrain` entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py


def exatrain(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exatrain.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_data_then_run_then_resume(tmp_path):
    made = exatrain("data", "cosmoflow", "--out", "d16", "--samples", "24", "--size", "16",
                    cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    with h5py.File(tmp_path / "d16" / "train.h5") as f:
        assert f["x"].shape == (21, 16, 16, 16, 4) and f["y"].shape == (21, 4)

    args = ["--set", "data.path=d16", "--set", "data.generate=false", "--set", "data.size=16",
            "--set", "model.size=16", "--set", "model.conv_layers=4", "--set", "model.base_channels=4",
            "--set", "train.steps=4", "--set", "train.log_every=2", "--set", "train.eval_every=2"]
    run = exatrain("run", "--nproc", "2", *args, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    run_dir = next((tmp_path / "runs").iterdir())
    assert str(run_dir.relative_to(tmp_path)) in run.stderr  # it says where the results went
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("val_mae", "baseline_mae", "steps", "samples_per_s", "world_size"):
        assert key in summary
    assert summary["steps"] == 4 and summary["world_size"] == 2
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [l for l in lines if "loss" in l]
    assert [l["step"] for l in logged] == [2, 4]
    for key in ("loss", "samples_per_s", "step_s", "peak_mem_bytes", "bytes_per_step"):
        assert key in logged[0]
    assert logged[0]["bytes_per_step"]["data"] > 0
    assert (run_dir / "config.toml").is_file() and (run_dir / "checkpoints" / "latest").is_file()

    # a finished run resumed with more steps continues from its last checkpoint
    more = exatrain("run", "--resume", str(run_dir), "--set", "train.steps=6", cwd=tmp_path)
    assert more.returncode == 0, more.stderr
    assert "resumed from" in more.stderr
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6


def test_config_typo_exits_with_a_suggestion(tmp_path):
    bad = exatrain("run", "--set", "train.batchsize=4", cwd=tmp_path)
    assert bad.returncode == 2
    assert "unknown key train.batchsize. Did you mean 'batch_size'?" in bad.stderr


def _sub(parser, name):
    """The sub-parser `name` of `parser`."""
    return next(a for a in parser._actions if a.dest in ("command", "name")).choices[name]


def test_the_parser_builds_only_the_subcommand_it_runs():
    """`exatrain run` builds only run's arguments (so imports neither the planner nor the
    benchmarks, tests/test_startup.py), and says the same as the full parser (docs/hooks.py)."""
    from exatrain.cli import COMMANDS, build_parser

    full = build_parser()
    for argv in ([], ["--help"], ["run"], ["bench", "dp"]):   # the same list and summaries
        assert build_parser(argv).format_help() == full.format_help(), argv
    for name in COMMANDS:
        assert _sub(build_parser([name, "--help"]), name).format_help() == \
            _sub(full, name).format_help(), name
    run = build_parser(["run"])
    assert _sub(run, "bench").format_help() != _sub(full, "bench").format_help()  # not built
    assert run.parse_args(["run", "--nproc", "2"]).nproc == 2
    dp = build_parser(["bench", "dp"])
    assert _sub(_sub(dp, "bench"), "dp").format_help() == _sub(_sub(full, "bench"), "dp").format_help()
    assert dp.parse_args(["bench", "dp", "--steps", "3"]).steps == 3
    assert "--steps" not in _sub(_sub(dp, "bench"), "zero").format_help()   # not imported


SCRIPT = '''
import argparse
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
import exatrain as et

if __name__ == "__main__":   # loader workers import this file again
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    et.fit(lambda: nn.Linear(4, 1), data, data, loss=F.mse_loss, optim={"lr": args.lr},
           train={"steps": args.steps, "batch_size": 8, "eval_every": args.steps},
           run={"out_dir": "runs", "name": "lr" + str(args.lr).replace(".", "p")})
'''


def test_a_script_gets_the_arguments_after_the_dashes_and_prints_its_summary(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    run = exatrain("run", "train.py", "--nproc", "1", "--", "--lr", "0.05", "--steps", "3",
                   cwd=tmp_path, timeout=60)
    assert run.returncode == 0, run.stderr
    run_dir = next((tmp_path / "runs").iterdir())
    assert run_dir.name.startswith("lr0p05")                  # the script saw --lr 0.05
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    assert "run summary" in run.stderr and "final_loss" in run.stderr
    assert f"results: {run_dir.relative_to(tmp_path)}" in " ".join(run.stderr.split())
    refused = exatrain("run", "--", "--lr", "0.05", cwd=tmp_path)
    assert refused.returncode == 2 and "go to a Python script" in refused.stderr
