"""Replica groups (`[fault_tolerance]`) launched as a centre launches them: the batch script of
`--print-batch-script slurm` submitted to the real Slurm (tests/slurm/), and one `torchrun` per
group with the lighthouse started first (the long-run tutorial's lines). A rank is really killed
(SIGKILL, from the fault injector), the group's launcher starts it again, and it heals from the
live group. Nothing is mocked.

Each test states what the uninterrupted run reached (its final weights: plain data parallelism on
2 ranks, the same job without `[fault_tolerance]`) and what the fault cost: steps redone by the
surviving group (none), and the seconds it paused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import rel_err
from launched import final_weights, free_port_run, job_args, job_env, slurm  # noqa: F401

pytest.importorskip("torchft", reason="[fault_tolerance] needs torchft (pip install exatrain[ft])")

from exatrain.launch.local import free_port  # noqa: E402
from test_fault_tolerance import uninterrupted_weights  # noqa: E402

STEPS, TOGETHER = 500, 20
# two groups of one rank; min_replicas = 1: the first group ready starts alone (measured: 0 to
# 225 steps before the other on a loaded machine; the other heals from it as it starts), so the
# kill comes once both have trained TOGETHER steps side by side; when a group dies the survivor
# goes on alone, covering the dead group's samples (batch =
# "keep"), so the run is the uninterrupted one; wider convolutions (~0.05 s steps, twice that
# alone) keep it training while the killed group is started again (seconds: srun or torchrun,
# and the import of torch)
FT = ["fault_tolerance.enabled=true", "plan.data=2", "fault_tolerance.min_replicas=1",
      "fault_tolerance.timeout_s=5.0", "fault_tolerance.heartbeat_timeout_ms=2000",
      "train.checkpoint_every=0", "model.batchnorm=false", "model.base_channels=16"]


def _args(cosmo_data, out: Path, *extra: str) -> list[str]:
    return job_args(cosmo_data, out) + [a for s in (f"train.steps={STEPS}", "train.log_every=1",
                                                    *extra) for a in ("--set", s)]


def _ft_env(**extra) -> dict:
    env = job_env(**extra)
    for name in ("EXATRAIN_RUN_DIR", "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID",
                 "EXATRAIN_INJECT_FAULTS"):
        env.pop(name, None)
    env.update(extra)
    return env


def _uninterrupted(cosmo_data, out: Path, *extra: str) -> dict:
    """The same job without [fault_tolerance] (plain data parallelism on 2 ranks): its final
    weights, trained once for every test here that compares with the same job."""
    return uninterrupted_weights(_args(cosmo_data, out, *FT, *extra)[1::2], out)


def _trained_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text()
            .splitlines() if "loss" in json.loads(line)]


def _last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [l for l in path.read_text().splitlines() if l.endswith("}") and '"loss"' in l]
    return json.loads(lines[-1])["step"] if lines else 0


def _when_both_train(dirs, alive, timeout_s: float = 300) -> int:
    """Wait until the two groups' run directories (callables: the path, or None while not made)
    have trained TOGETHER steps side by side; the step group 1 logged last."""
    deadline = time.monotonic() + timeout_s
    first = None
    while True:
        paths = [d() for d in dirs]
        steps = [_last_step(p) if p is not None else 0 for p in paths]
        if min(steps) > 0 and first is None:
            first = max(steps)  # both are training from here on
        if first is not None and min(steps) >= first + TOGETHER:
            return steps[1]
        assert time.monotonic() < deadline, f"the groups did not train together: {steps}"
        assert alive(), "a launcher ended before the kill"
        time.sleep(0.05)


def _kill_rank(**env: str) -> int:
    """SIGKILL the training process whose environment holds every `env` pair (a group's rank,
    not its launcher: its command line runs exatrain.cli, not srun or torch.distributed.run);
    its pid."""
    wanted = [f"{k}={v}".encode() for k, v in env.items()]
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if all(w in environ for w in wanted) and b"exatrain.cli" in argv \
                and b"srun" not in argv[0] and b"torch.distributed.run" not in argv:
            os.kill(int(proc.name), signal.SIGKILL)
            return int(proc.name)
    pytest.fail(f"no process with {env}")


def _check_survivor_and_rejoined(survivor: Path, rejoined: Path, reference: dict,
                                 killed_after: int) -> dict:
    """The survivor trained every step once, alone from the kill until the killed group came
    back, pausing about the heartbeat timeout; the killed group healed from it after the step it
    died in; both end with the uninterrupted run's weights. Returns the survivor's summary.

    Once both train again they are peers: on a loaded machine the survivor's step can take longer
    than the quorum waits (min_replicas = 1), the other group commits that step alone, and the
    survivor, a step behind, heals from it (measured once: a 7.5 s step under a second test
    run). Such a heal is allowed after the killed group is back, never before."""
    s0 = json.loads((survivor / "summary.json").read_text())
    s1 = json.loads((rejoined / "summary.json").read_text())
    trained = _trained_steps(survivor)
    assert trained == sorted(set(trained)) and trained[-1] == STEPS, \
        "the survivor redid a step: it should have trained each step once"
    heals = [h["rejoined_at_step"] for h in s1["ft_heals"]]
    assert heals, f"the restarted group never healed from the live one: {s1}"
    back = heals[0]   # the restarted group healed from the live one, after the step it died in
    assert killed_after < back < STEPS and s1["steps"] == STEPS, (killed_after, s1["ft_heals"])
    assert set(range(killed_after, back)) <= set(trained), \
        "the survivor lost a step after the kill: it should have trained on alone"
    # every step after that was trained by one group or both
    assert set(range(back, STEPS + 1)) <= set(trained) | set(_trained_steps(rejoined))
    # (a group that starts a few steps after the other heals from it as it starts: its log
    # begins later, or skips the step it healed in, before the kill; the peers' heals come
    # after the killed group is back)
    late = [h["rejoined_at_step"] for h in s0["ft_heals"] if h["rejoined_at_step"] > killed_after]
    assert all(step > back for step in late), (back, s0["ft_heals"])
    assert s0["steps"] == STEPS
    assert s0["ft_steps_with_groups_missing"] >= 1  # it went on alone
    assert s0["ft_discarded_attempts"] <= 1 + len(late) and s0["ft_pause_s_max"] <= 5.0 + 2.0
    a, b = final_weights(survivor), final_weights(rejoined)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the groups agree to the last bit
    err = max(rel_err(a[k], reference[k]) for k in reference)
    assert err <= 1e-6, f"final weights {err:.1e} from the uninterrupted run's"  # measured: 0
    s0["rejoined_at_step"], s0["killed_after"] = back, killed_after
    return s0


def _report(launcher: str, s0: dict) -> None:
    print(f"{launcher}: group 0 redid 0 steps, paused {s0['ft_pause_s_max']:.1f} s, discarded "
          f"{s0['ft_discarded_attempts']} attempt(s), trained "
          f"{s0['ft_steps_with_groups_missing']} steps alone; group 1 killed after step "
          f"{s0['killed_after']}, "
          f"back at step {s0['rejoined_at_step']}; weights equal the uninterrupted run's")


def _sbatch_groups(tmp_path, args: list[str], script_flags: list[str], **env) -> tuple[str, Path]:
    """The replica groups' batch script (`exatrain run ARGS --print-batch-script slurm
    --tasks-per-node 2 SCRIPT_FLAGS`), submitted with ports of its own (other jobs of this
    machine's Slurm may use the defaults) and `env`: the job id and the job's run root."""
    made = subprocess.run([sys.executable, "-m", "exatrain.cli", "run", "--print-batch-script",
                           "slurm", "--tasks-per-node", "2", *script_flags, *args], cwd=tmp_path,
                          env=_ft_env(), capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    script = made.stdout
    assert script.count("\ngroup ") == 2 and "torchft_lighthouse --bind \"[::]:$lighthouse_port\" --min_replicas 1" in script
    (tmp_path / "job.sh").write_text(script)
    base = free_port_run(3)   # groups 0 and 1 at MASTER_PORT + g, then the lighthouse
    sub = subprocess.run(["sbatch", "--parsable", "job.sh"], cwd=tmp_path,
                         env=_ft_env(MASTER_PORT=str(base), LIGHTHOUSE_PORT=str(base + 2), **env),
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    return job, tmp_path / "runs" / f"cosmoflow-{job}"


def test_sbatch_replica_groups_restart_a_killed_group_which_heals(slurm, cosmo_data, tmp_path):
    """The script `--print-batch-script slurm` writes for 2 replica groups of 1 rank on one node:
    its lighthouse on the batch host, one srun step per group. Once both groups have trained 20 steps side by side, group 1's rank gets SIGKILL (from the
    test, mid-step); srun ends the step, the script's loop for group 1 starts it again, and the
    new step heals from group 0, which went on alone meanwhile.

    The uninterrupted run (`exatrain run --nproc 2` without fault tolerance) reached step 500
    with weights W; this run reaches step 500 with W on both groups (bar 1e-6; measured 0: with
    two groups the sums are exact). Lost: no step redone by group 0; its pause when group 1 died
    (`ft_pause_s_max`, measured 2.0 s: the heartbeat timeout); group 1's own work, replaced by
    the heal (measured: back 30-225 steps later, 2-10 s after the kill, on a loaded machine)."""
    job, root = _sbatch_groups(tmp_path, _args(cosmo_data, tmp_path / "runs", *FT),
                               ["--time", "10"])
    from test_slurm import wait_for_job
    try:
        killed_after = _when_both_train([lambda: root / "group_00", lambda: root / "group_01"],
                                        alive=lambda: True)
        _kill_rank(REPLICA_GROUP_ID="1", EXATRAIN_RUN_DIR=str(root / "group_01"))
    except BaseException:
        subprocess.run(["scancel", job])
        raise
    state = wait_for_job(job, timeout_s=400)
    output = (tmp_path / f"cosmoflow-{job}.out").read_text()
    assert state == "COMPLETED", output
    assert "replica group 1 failed (exit" in output and "starting it again (1/3)" in output, output
    assert "replica group 0 failed" not in output, output
    assert sorted(p.name for p in root.iterdir()) == ["group_00", "group_01", "lighthouse.log"]
    assert "Quorum" in (root / "lighthouse.log").read_text()  # the script's lighthouse ran
    reference = _uninterrupted(cosmo_data, tmp_path / "plain")
    s0 = _check_survivor_and_rejoined(root / "group_00", root / "group_01", reference,
                                      killed_after)
    _report("Slurm", s0)


def _lighthouse(port: int, log: Path) -> subprocess.Popen:
    """The long-run tutorial's lighthouse line (started first): torchft_lighthouse."""
    program = Path(sys.executable).parent / "torchft_lighthouse"
    program = str(program) if program.exists() else shutil.which("torchft_lighthouse")
    proc = subprocess.Popen([program, "--min_replicas", "1", "--bind", f"[::]:{port}",
                             "--join_timeout_ms", "2000", "--heartbeat_timeout_ms", "2000"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            import socket
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail(f"the lighthouse did not start; its log: {log.read_text()}")


def test_torchrun_per_group_rank_0_killed_mid_step_restarts_and_heals(cosmo_data, tmp_path):
    """The long-run tutorial's torchrun lines: the lighthouse first, then one `torchrun
    --standalone --nproc-per-node 1 --max-restarts 1` per group with REPLICA_GROUP_ID and
    TORCHFT_LIGHTHOUSE. Group 1's rank 0 -- the process that hosts torchft's ManagerServer, the
    lighthouse's client, which heartbeats to it for the group -- gets SIGKILL from the test once
    both groups have trained 20 steps side by side, mid-step (a step takes most of the time
    between steps). torchrun's agent starts the rank again (same run directory); the new rank
    heals from group 0, which went on alone meanwhile.

    The uninterrupted run reached step 500 with weights W; this run reaches step 500 with W on
    both groups (bar 1e-6; measured 0). Lost: no step redone by group 0; its pause when group 1
    died (`ft_pause_s_max`, measured 2.2 s: the lighthouse's heartbeat timeout; bar timeout_s +
    2 s), at most one discarded attempt; group 1's own work, replaced by the heal."""
    port = free_port()
    lighthouse = _lighthouse(port, tmp_path / "lighthouse.log")
    procs = []
    try:
        for k in (0, 1):
            env = _ft_env(REPLICA_GROUP_ID=str(k), TORCHFT_LIGHTHOUSE=f"http://localhost:{port}")
            line = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "1", "--max-restarts", "1", "--monitor-interval", "0.2",
                    "-m", "exatrain.cli", "run",
                    *_args(cosmo_data, tmp_path / f"group{k}", *FT)]
            procs.append(subprocess.Popen(line, env=env, cwd=tmp_path,
                                          stdout=(tmp_path / f"group{k}.log").open("w"),
                                          stderr=subprocess.STDOUT))

        def run_dir(k):
            found = list((tmp_path / f"group{k}").glob("*/metrics.jsonl"))
            return found[0].parent if found else None

        killed_after = _when_both_train([lambda: run_dir(0), lambda: run_dir(1)],
                                        alive=lambda: all(p.poll() is None for p in procs))
        # group 1's rank 0 (RANK=0 of its world; the torchrun agent has no RANK)
        _kill_rank(REPLICA_GROUP_ID="1", RANK="0", TORCHFT_LIGHTHOUSE=f"http://localhost:{port}")
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.terminate()
        lighthouse.wait(30)
    logs = {k: (tmp_path / f"group{k}.log").read_text()[-3000:] for k in (0, 1)}
    assert codes == [0, 0], logs
    (survivor,) = (tmp_path / "group0").iterdir()
    (rejoined,) = (tmp_path / "group1").iterdir()  # torchrun's run id: one directory, two starts
    assert "(exitcode: -9) local_rank: 0" in (tmp_path / "group1.log").read_text()  # SIGKILL
    assert "Quorum" in (tmp_path / "lighthouse.log").read_text()
    reference = _uninterrupted(cosmo_data, tmp_path / "plain")
    s0 = _check_survivor_and_rejoined(survivor, rejoined, reference, killed_after)
    assert s0["launcher"] == "torchrun"
    _report("torchrun", s0)


def test_replica_group_batch_scripts_place_the_groups_and_sbatch_reads_them(slurm, tmp_path,
                                                                            capsys):
    """Where `--print-batch-script slurm` puts 2 replica groups: on 2 nodes, one whole node each
    (every GPU of it, --gpu-bind=none); on 1 node, side by side, half the tasks each and one
    GPU per task (no GPU twice). sbatch --test-only accepts the one-node script (this machine's
    Slurm has one node). A site's lighthouse in the config: the script starts none. Node counts
    the groups cannot share evenly, and Flux, are refused by name."""
    from exatrain.cli import main

    ft = ["--set", "fault_tolerance.enabled=true", "--set", "plan.data=2"]
    common = ["run", "--print-batch-script", "slurm", "--gpus-per-node", "4", *ft]
    assert main([*common, "--nodes", "2"]) == 0
    script = capsys.readouterr().out
    assert "group 0 1 4 0 &" in script and "group 1 1 4 1 &" in script
    assert "--gpu-bind=none" in script and "--gpus-per-task" not in script
    assert main([*common, "--nodes", "1", "--partition", "debug"]) == 0
    script = capsys.readouterr().out
    assert "group 0 1 2 0 &" in script and "group 1 1 2 0 &" in script
    assert "--gpus-per-task=1" in script and "torchft_lighthouse --bind \"[::]:$lighthouse_port\" --min_replicas 1" in script
    (tmp_path / "job.sh").write_text(script)
    tried = subprocess.run(["sbatch", "--test-only", "job.sh"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert "to start at" in tried.stderr, tried.stderr
    assert main([*common, "--set", 'fault_tolerance.lighthouse="http://lh.site:29510"']) == 0
    script = capsys.readouterr().out
    assert "torchft_lighthouse" not in script and "# the lighthouse: http://lh.site:29510" in script
    assert main([*common, "--nodes", "3"]) == 2
    assert "--nodes 3 does not split into 2 replica groups" in capsys.readouterr().err
    assert main(["run", "--print-batch-script", "flux", *ft]) == 2
    assert "only the Slurm script starts replica groups" in capsys.readouterr().err


def test_sbatch_replica_groups_checkpoint_on_the_wall_time_warning_and_requeue(slurm, cosmo_data,
                                                                              tmp_path):
    """The replica groups' script with a one-minute wall time and the warning 40 s before it:
    Slurm sends USR1 to the batch shell 20-50 s in, while both groups wait at step 3 (each
    group's rank waits there for a signal); the script passes it to every group's step
    (`scancel --signal=USR1`), starts no group again, and requeues the job; each group
    checkpoints, and the requeued job resumes every group from its own checkpoint and finishes.

    The uninterrupted run reached step 6 with weights W; both groups end at step 6 with W (bar
    1e-6). Lost: the time of the requeue (Slurm holds a requeued job 6 s here); no step."""
    steps = 6
    args = _args(cosmo_data, tmp_path / "runs", *FT, "model.base_channels=4",
                 f"train.steps={steps}")
    job, root = _sbatch_groups(tmp_path, args, ["--time", "1", "--signal-before", "40"],
                               EXATRAIN_INJECT_FAULTS="wait_signal@0:3,wait_signal@1:3")
    from test_slurm import wait_for_job
    state = wait_for_job(job, timeout_s=400)
    output = (tmp_path / f"cosmoflow-{job}.out").read_text()
    assert state == "COMPLETED", output[-5000:]
    assert "wall time near" in output and "failed (exit" not in output, output[-5000:]
    weights = []
    for group in ("group_00", "group_01"):
        summary = json.loads((root / group / "summary.json").read_text())
        assert summary["steps"] == steps and summary["requeues"] >= 1, summary
        assert not summary["stopped_by_signal"]
        trained = _trained_steps(root / group)
        # no step twice; a group that started after the other healed from it (its first
        # steps received, not trained), so its log may begin later or skip the step it healed in
        assert trained == sorted(set(trained)) and trained[-1] == steps, trained
        weights.append(final_weights(root / group))
    reference = _uninterrupted(cosmo_data, tmp_path / "plain", "model.base_channels=4",
                               f"train.steps={steps}")
    between = max(rel_err(weights[0][k], weights[1][k]) for k in reference)
    errs = [max(rel_err(w[k], reference[k]) for k in reference) for w in weights]
    story = "\n".join(l for l in output.splitlines() if "quorum" in l or "heal" in l or "step " in l)
    assert between == 0 and max(errs) <= 1e-6, (
        f"groups {between:.1e} apart, {errs[0]:.1e} and {errs[1]:.1e} from the uninterrupted "
        f"run's weights; steps trained {[_trained_steps(root / g) for g in ('group_00', 'group_01')]}"
        f"\n{story[-6000:]}")


def test_sbatch_replica_groups_requeue_on_a_warning_that_comes_as_the_job_starts(slurm, cosmo_data,
                                                                                tmp_path):
    """Slurm may send the wall-time warning up to a minute early: here it reaches the batch shell
    (`scancel --batch --signal=USR1`, as `--signal=B:USR1` sends it) as soon as the script has
    made its run directory, while the lighthouse starts (the import of torch: seconds). The
    script says so, starts no group, and requeues the job (a shell that set its trap later died
    of the signal, the job FAILED with nothing in its output); the requeued job trains both
    groups to the end, equal to the uninterrupted run (1e-6)."""
    steps = 4
    args = _args(cosmo_data, tmp_path / "runs", *FT, "model.base_channels=4",
                 f"train.steps={steps}")
    job, root = _sbatch_groups(tmp_path, args, ["--time", "10"])
    deadline = time.monotonic() + 120
    while not root.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert root.exists(), f"job {job} made no run directory in 120 s"
    warned = subprocess.run(["scancel", "--batch", "--signal=USR1", job], capture_output=True,
                            text=True, timeout=60)
    assert warned.returncode == 0, warned.stderr
    from test_slurm import wait_for_job
    state = wait_for_job(job, timeout_s=300)
    output = (tmp_path / f"cosmoflow-{job}.out").read_text()
    assert state == "COMPLETED", output[-5000:]
    assert "wall time near" in output and "failed (exit" not in output, output[-5000:]
    assert output.count("not started: the wall-time warning came first") == 2, output[-5000:]
    reference = _uninterrupted(cosmo_data, tmp_path / "plain", "model.base_channels=4",
                               f"train.steps={steps}")
    for group in ("group_00", "group_01"):
        summary = json.loads((root / group / "summary.json").read_text())
        assert summary["steps"] == steps and summary["requeues"] == 1, summary
        trained = _trained_steps(root / group)
        assert trained == sorted(set(trained)) and trained[-1] == steps, trained
        weights = final_weights(root / group)
        assert max(rel_err(weights[k], reference[k]) for k in reference) <= 1e-6, group


def test_the_tutorials_replica_group_batch_line_makes_a_script_sbatch_accepts(slurm, tmp_path,
                                                                             capsys):
    """The long-run tutorial's `--print-batch-script slurm` line for replica groups (the one
    with --max-restarts), run through the real command line with the example config given
    2 replica groups, scaled to this machine's one node (the groups side by side, one stand-in
    GPU per task): a script of 2 group steps, restarted up to 3 times, that sbatch accepts."""
    from exatrain.cli import main
    from test_slurm import doc_batch_lines

    (words,) = [w for where, w in doc_batch_lines() if "--max-restarts" in w]
    local = {"--nodes": "1", "--account": "test", "--cpus-per-task": "1"}
    words = [str(Path(__file__).resolve().parents[1] / "examples" / "cosmoflow.toml")
             if w.endswith(".toml") else local.get(words[i - 1], w) for i, w in enumerate(words)]
    words += ["--partition", "debug", "--set", "fault_tolerance.enabled=true", "--set",
              "plan.data=2"]
    assert main(words) == 0
    script = capsys.readouterr().out
    assert "group 0 1 2 0 &" in script and "group 1 1 2 0 &" in script, script
    assert "(up to 3 times)" in script and "--gpus-per-task=1" in script
    (tmp_path / "job.sh").write_text(script)
    tried = subprocess.run(["sbatch", "--test-only", "job.sh"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert "to start at" in tried.stderr, tried.stderr


def _assert_both_equal_the_uninterrupted_run(first: Path, second: Path, cosmo_data,
                                             tmp_path: Path, steps: int) -> None:
    """Both groups' final weights agree to the last bit and equal those of the same job
    without [fault_tolerance] (base_channels 4, `steps` steps; bar 1e-6)."""
    a, b = final_weights(first), final_weights(second)
    assert all(torch.equal(a[k], b[k]) for k in a)
    reference = _uninterrupted(cosmo_data, tmp_path / "plain", "model.base_channels=4",
                               f"train.steps={steps}")
    err = max(rel_err(a[k], reference[k]) for k in reference)
    assert err <= 1e-6, f"final weights {err:.1e} from the uninterrupted run's"


def test_exatrain_run_heal_while_the_survivor_waits_equals_the_uninterrupted_run(cosmo_data,
                                                                                 tmp_path):
    """`exatrain run --nproc 2 --max-restarts 1`, 2 groups, min_replicas = 2 (the survivor
    waits for the restarted group instead of going on alone), group 1's rank SIGKILLs itself as
    step 4 starts: the uninterrupted run (the same job without fault tolerance) reached step 8
    with weights W; both groups should end at step 8 with W (bar 1e-6)."""
    steps = 8
    sets = [*[s for s in FT if "min_replicas" not in s], "fault_tolerance.min_replicas=2",
            "fault_tolerance.quorum_timeout_s=120.0", "model.base_channels=4",
            f"train.steps={steps}"]
    env = _ft_env(EXATRAIN_INJECT_FAULTS="kill@1:4")
    done = subprocess.run([sys.executable, "-m", "exatrain.cli", "run", "--nproc", "2",
                           "--max-restarts", "1", *_args(cosmo_data, tmp_path / "ft", *sets)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (root,) = (tmp_path / "ft").iterdir()
    (survivor,) = [p.parent for p in root.glob("group_00/*/summary.json")]
    (rejoined,) = [p.parent for p in root.glob("group_01/*/summary.json")]
    (heal,) = json.loads((rejoined / "summary.json").read_text())["ft_heals"]
    assert heal["rejoined_at_step"] == 4
    _assert_both_equal_the_uninterrupted_run(survivor, rejoined, cosmo_data, tmp_path, steps)


def test_exatrain_run_resume_continues_every_group_and_an_older_checkpoint_heals(cosmo_data,
                                                                                  tmp_path):
    """`exatrain run --nproc 2` with 2 groups (min_replicas = 2), checkpoints every 2 steps;
    both groups' ranks get SIGTERM as step 5 starts (a wall-time warning): each finishes step 5,
    checkpoints and stops. Group 1's step-5 checkpoint is then deleted (a node's disk lost), and
    `exatrain run --resume RUN_DIR` resumes group 0 from step 5 and group 1 from step 4: group 1
    is behind, so it heals from group 0 (the state after step 5) and takes part from step 6. The
    uninterrupted run reached step 8 with weights W; both groups end at step 8 with W (bar
    1e-6). Lost: group 1's step 5, recovered from group 0, not recomputed."""
    steps = 8
    sets = [*[s for s in FT if "min_replicas" not in s], "fault_tolerance.min_replicas=2",
            "fault_tolerance.quorum_timeout_s=120.0", "model.base_channels=4",
            "train.checkpoint_every=2", f"train.steps={steps}"]
    cmd = [sys.executable, "-m", "exatrain.cli", "run", "--nproc", "2"]
    done = subprocess.run([*cmd, *_args(cosmo_data, tmp_path / "ft", *sets)],
                          env=_ft_env(EXATRAIN_INJECT_FAULTS="term@0:5,term@1:5"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (root,) = (tmp_path / "ft").iterdir()
    (first,) = [p.parent for p in root.glob("group_00/*/config.toml")]
    (second,) = [p.parent for p in root.glob("group_01/*/config.toml")]
    assert _last_step(first) == _last_step(second) == 5
    shutil.rmtree(second / "checkpoints" / "step_00000005")
    (second / "checkpoints" / "latest").unlink(missing_ok=True)

    done = subprocess.run([*cmd, "--resume", str(root)], env=_ft_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _trained_steps(first) == list(range(1, steps + 1))  # each step once
    (heal,) = json.loads((second / "summary.json").read_text())["ft_heals"]
    assert heal["rejoined_at_step"] == 6, heal
    # its step 5 came from group 0 (the state after it); it took part in step 6's average
    assert _trained_steps(second) == [1, 2, 3, 4, 6, 7, 8]
    _assert_both_equal_the_uninterrupted_run(first, second, cosmo_data, tmp_path, steps)
