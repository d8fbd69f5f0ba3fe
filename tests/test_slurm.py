"""Launched the way a supercomputer launches: a real Slurm on this machine (munge, slurmctld,
slurmd, installed and started by tests/slurm/start-slurm.sh from the `slurm` fixture), `srun` for
the ranks, `sbatch` for the script `--print-batch-script slurm` writes, and the wall-time warning
sent by the scheduler itself, not by the test."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launched import (REPO, STEPS, assert_same_weights, doc_launch_line, final_weights, job_args,
                      job_env, local_run, slurm)  # noqa: F401 (local_run, slurm: fixtures)

def test_srun_two_ranks_equal_exatrain_run_nproc_2(slurm, cosmo_data, tmp_path, local_run):
    """The install page's srun line, on one node of two CPU ranks (no GPUs here: its
    --gpus-per-node is left out), with the example config made tiny."""
    options, command = doc_launch_line("srun")
    assert list(options) == ["-N", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task"]
    assert command == ["exatrain", "run", "examples/cosmoflow.toml"]
    done = subprocess.run(["srun", "-N", "1", "--ntasks-per-node=2", "--cpus-per-task=1",
                           sys.executable, "-m", "exatrain.cli", "run",
                           str(REPO / command[-1]), *job_args(cosmo_data, tmp_path / "runs")],
                          cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()  # one job of two ranks, not two jobs of their own
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["launcher"] == "Slurm" and summary["world_size"] == 2
    assert summary["steps"] == STEPS and summary["requeues"] == 0
    assert summary["final_loss"] == local_run[0]["final_loss"]
    assert_same_weights(final_weights(run_dir), local_run[1])


def wait_for_job(job: str, timeout_s: float) -> str:
    """Poll until the job has left the queue; its final state (sacct-free: scontrol)."""
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True)
        fields = dict(w.split("=", 1) for w in shown.stdout.split() if "=" in w)
        state = fields.get("JobState", "")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") \
                or shown.returncode != 0:
            return state
        time.sleep(0.25)  # one scontrol call is ~50 ms; a job's end is seen within 0.3 s
    subprocess.run(["scancel", job])
    pytest.fail(f"job {job} still {state} after {timeout_s:.0f} s")


def test_sbatch_wall_time_warning_checkpoints_requeues_and_resumes(slurm, cosmo_data, tmp_path,
                                                                   local_run):
    """The script `--print-batch-script slurm` writes, submitted with a one-minute wall time and
    the warning 40 s before it: Slurm sends USR1 20-50 s into the job (its time-limit check runs
    every 30 s), while step 3 is still running (the ranks wait there for a signal, at most 10
    minutes); the ranks checkpoint after step 3, the script requeues the job, Slurm starts it
    again (6 s later: AuthInfo=cred_expire=5), it resumes and finishes -- or, on a loaded
    machine, is warned again and requeues again. Unattended."""
    made = subprocess.run([sys.executable, "-m", "exatrain.cli", "run", "--print-batch-script",
                           "slurm", "--time", "1", "--signal-before", "40", "--tasks-per-node", "2",
                           *job_args(cosmo_data, tmp_path / "runs")],
                          cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    (tmp_path / "job.sh").write_text(made.stdout)
    env = job_env(EXATRAIN_INJECT_FAULTS="wait_signal@0:3,wait_signal@1:3")
    env.pop("EXATRAIN_RUN_DIR", None)
    sub = subprocess.run(["sbatch", "--parsable", "job.sh"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    state = wait_for_job(job, timeout_s=400)
    output = (tmp_path / f"cosmoflow-{job}.out").read_text()
    assert state == "COMPLETED", output
    # after step 3, unless the warning came earlier (then the next incarnation waits at step 3)
    assert "wall time near" in output and "stopped by SIGUSR1 after step" in output, output
    run_dir = tmp_path / "runs" / f"cosmoflow-{job}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["launcher"] == "Slurm" and summary["requeues"] >= 1
    assert summary["steps"] == STEPS and not summary["stopped_by_signal"]
    steps = [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(l)]
    assert steps == list(range(1, STEPS + 1))  # resumed after step 3: no step twice, none lost
    assert_same_weights(final_weights(run_dir), local_run[1])


def sbatch_lines(script: str) -> list[tuple[str, str]]:
    """(comment line above, option) for every `#SBATCH` line of a script."""
    lines = script.splitlines()
    return [(lines[i - 1], line.removeprefix("#SBATCH ")) for i, line in enumerate(lines)
            if line.startswith("#SBATCH ")]


def print_batch_script(capsys, *args: str) -> tuple[int, str, str]:
    """`exatrain run --print-batch-script slurm ARGS`: exit code, script, messages."""
    from exatrain.cli import main

    code = main(["run", "--print-batch-script", "slurm", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_batch_script_for_a_gpu_cluster(capsys):
    """The resources a GPU centre asks for, each `#SBATCH` line with its comment above it, one
    GPU per local rank, OMP_NUM_THREADS from the CPUs per task; read back by parsing, by bash,
    and (where this machine's Slurm runs) by sbatch itself."""
    code, script, err = print_batch_script(
        capsys, "--nodes", "4", "--gpus-per-node", "4", "--cpus-per-task", "32", "--account",
        "m1234", "--partition", "regular", "--qos", "premium", "--constraint", "gpu&hbm80g",
        "--sbatch-arg", "mail-type=END", "--sbatch-arg=--exclusive", "--set", "train.steps=10")
    assert code == 0, err
    pairs = sbatch_lines(script)
    options = dict(o.removeprefix("--").split("=", 1) if "=" in o else (o.removeprefix("--"), "")
                   for _, o in pairs)
    assert {k: options[k] for k in ("nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task",
                                    "account", "partition", "qos", "constraint", "mail-type",
                                    "exclusive", "requeue")} == {
        "nodes": "4", "ntasks-per-node": "4", "gpus-per-node": "4", "cpus-per-task": "32",
        "account": "m1234", "partition": "regular", "qos": "premium", "constraint": "gpu&hbm80g",
        "mail-type": "END", "exclusive": "", "requeue": ""}
    assert options["signal"] == "B:USR1@180"
    assert all(comment.startswith("# ") and len(comment) > 4 for comment, _ in pairs)
    assert "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}" in script
    srun = next(l.strip() for l in script.splitlines() if l.strip().startswith("srun "))
    assert "--gpu-bind=none" in srun and srun.endswith("run --set train.steps=10 &")
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0

    # more ranks than GPUs on a node is refused; so is an --sbatch-arg that is not one option
    for bad in (["--gpus-per-node", "2", "--tasks-per-node", "4"], ["--sbatch-arg", "a b\nc"]):
        code, _, err = print_batch_script(capsys, *bad)
        assert code == 2 and "exatrain run:" in err, err


def test_sbatch_reads_the_resource_lines(slurm, tmp_path, capsys):
    """sbatch --test-only: the lines are Slurm's own syntax; a constraint no node has is refused
    (so the line was read), the same script without it would start."""
    args = ["--tasks-per-node", "2", "--cpus-per-task", "2", "--partition", "debug",
            "--sbatch-arg", "mail-type=END", "--sbatch-arg=--exclusive"]
    for extra, verdict in (([], "to start at"), (["--constraint", "nvme"], "Invalid feature")):
        (tmp_path / "job.sh").write_text(print_batch_script(capsys, *args, *extra)[1])
        tried = subprocess.run(["sbatch", "--test-only", "job.sh"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
        assert verdict in tried.stderr, tried.stderr


def doc_batch_lines() -> list[tuple[str, list[str]]]:
    """Every `exatrain run ... --print-batch-script slurm` command the docs and README print:
    (where, its arguments after `exatrain`)."""
    import shlex

    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = page.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("exatrain run") and "--print-batch-script slurm" in line:
                words = shlex.split(line.split(">")[0])
                found.append((f"{page.relative_to(REPO)}: {line}", words[1:]))
    return found


def test_the_docs_batch_script_lines_make_scripts_sbatch_accepts(slurm, tmp_path, capsys):
    """Each documented `--print-batch-script slurm` line runs through the real command line
    (its config made the example's), and its script, scaled to this machine's one node of 8 CPUs
    and 8 stand-in GPUs, is accepted by sbatch --test-only."""
    from exatrain.cli import main

    lines = doc_batch_lines()
    assert len(lines) >= 2, lines  # the scale-out and long-run tutorials
    local = {"--nodes": "1", "--cpus-per-task": "1", "--account": "test",
             "--partition": "debug"}
    for where, words in lines:
        assert words[1].endswith(".toml"), where
        words = [str(REPO / "examples" / "cosmoflow.toml") if w == words[1] else
                 local.get(words[i - 1], w) for i, w in enumerate(words)]
        assert main(words) == 0, where
        script = capsys.readouterr().out
        assert "#SBATCH --gpus-per-node=" in script and "OMP_NUM_THREADS" in script, where
        (tmp_path / "job.sh").write_text(script)
        tried = subprocess.run(["sbatch", "--test-only", "job.sh"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
        assert "to start at" in tried.stderr, f"{where}\n{tried.stderr}"


def wait_for(path: Path, timeout_s: float, job: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(f"{path} not there after {timeout_s:.0f} s")
        time.sleep(0.1)


def test_scancel_signal_usr1_requeues_and_plain_scancel_keeps_the_checkpoint(slurm, cosmo_data,
                                                                              tmp_path):
    """`scancel --signal=USR1 JOB` (to the ranks, not the batch shell) while step 3 runs: the
    ranks checkpoint, the script requeues, the job resumes from step 3. Then a plain `scancel`
    while step 5 runs: SIGTERM, the ranks checkpoint step 5 and the job ends CANCELLED, not
    requeued, its last checkpoint complete. Each signal is sent once both ranks wait in their
    step (the fault markers say so), so the steps are known."""
    from exatrain.train.checkpoints import checkpoint

    made = subprocess.run([sys.executable, "-m", "exatrain.cli", "run", "--print-batch-script",
                           "slurm", "--time", "10", "--tasks-per-node", "2",
                           *job_args(cosmo_data, tmp_path / "runs")],
                          cwd=tmp_path, env=job_env(), capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    (tmp_path / "job.sh").write_text(made.stdout)
    waits = ",".join(f"wait_signal@{r}:{s}" for r in (0, 1) for s in (3, 5))
    env = job_env(EXATRAIN_INJECT_FAULTS=waits)
    env.pop("EXATRAIN_RUN_DIR", None)
    sub = subprocess.run(["sbatch", "--parsable", "job.sh"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    faults = tmp_path / "runs" / f"cosmoflow-{job}" / "faults"
    for rank in (0, 1):
        wait_for(faults / f"wait_signal@{rank}:3", 120, job)
    assert subprocess.run(["scancel", "--signal=USR1", job]).returncode == 0
    for rank in (0, 1):
        wait_for(faults / f"wait_signal@{rank}:5", 120, job)
    assert subprocess.run(["scancel", job]).returncode == 0
    state = wait_for_job(job, timeout_s=120)
    output = (tmp_path / f"cosmoflow-{job}.out").read_text()
    assert state == "CANCELLED", output
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert "Restarts=1 " in shown, shown  # requeued once (the USR1), not after the cancel
    assert "stopped by SIGUSR1 after step 3 of 6" in output, output
    assert "checkpoints/step_00000003 at step 3" in output.replace("\n", ""), output
    assert "stopped by SIGTERM after step 5 of 6" in output, output
    run_dir = faults.parent
    assert checkpoint.verify(checkpoint.latest(run_dir))["step"] == 5
