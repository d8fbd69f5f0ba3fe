"""Replica groups over `data` with torchft (train/resilience/replicas.py): real processes, a real
lighthouse, a real SIGKILL. Each group is `exatrain run --nproc 1` with REPLICA_GROUP_ID and
TORCHFT_LIGHTHOUSE in its environment, as the long-run tutorial starts them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from exatrain.train.config import ConfigError, load_config
from exatrain.train.run import run_job
from harness import logged_losses, rel_err, run_ranks

pytest.importorskip("torchft", reason="[fault_tolerance] needs torchft (pip install exatrain[ft])")

from exatrain.train.resilience.replicas import start_lighthouse  # noqa: E402

TINY = ["model.size=16", "model.conv_layers=4", "model.base_channels=4", "data.size=16",
        "data.generate=false", "train.batch_size=8", "train.log_every=1", "optim.lr=0.003",
        "train.eval_every=0", "model.batchnorm=false"]
FT = ["fault_tolerance.enabled=true", "plan.data=2", "fault_tolerance.timeout_s=5.0",
      "fault_tolerance.heartbeat_timeout_ms=2000", "train.checkpoint_every=0"]
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _group(k: int, out: Path, lighthouse: str, overrides: list[str], faults: str = ""):
    """Replica group `k` as its own `exatrain run --nproc 1` process (its log in out/)."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "REPLICA_GROUP_ID": str(k), "TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1"}
    env.pop("EXATRAIN_INJECT_FAULTS", None)
    if faults:
        env["EXATRAIN_INJECT_FAULTS"] = faults
    out.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "exatrain.cli", "run", "--nproc", "1"]
    for item in [*overrides, f"run.out_dir={out}"]:
        args += ["--set", item]
    log = open(out / "group.log", "a")
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)


def _run_dir(out: Path) -> Path:
    (summary,) = out.glob("*/summary.json")
    return summary.parent


def _wait(proc, out: Path, limit_s: float = 240) -> None:
    try:
        rc = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    assert rc == 0, f"group in {out} ended with {rc}:\n" + (out / "group.log").read_text()[-3000:]


def _final_weights(run_dir: Path) -> dict:
    from exatrain.train.checkpoints import checkpoint
    return checkpoint.full_model_state(checkpoint.latest(run_dir))


_UNINTERRUPTED: dict = {}  # one run per distinct job, for every module that imports this one


def uninterrupted_weights(overrides: list[str], out: Path) -> dict:
    """The final weights of the job `overrides` without [fault_tolerance]: plain data
    parallelism on 2 ranks of the test pool (what a healed run must equal). Several tests
    compare with the same job, here and in the launched and hosts modules: it is trained once
    per session, keyed by its resolved config (`run.out_dir` aside)."""
    plain = [o for o in overrides if not o.startswith("fault_tolerance")]
    resolved = load_config(None, plain).to_dict()
    resolved["run"].pop("out_dir", None)
    key = json.dumps(resolved, sort_keys=True, default=str)
    if key not in _UNINTERRUPTED:
        summary = run_ranks(2, run_job, load_config(None, [*plain, f"run.out_dir={out}"]))[0]
        _UNINTERRUPTED[key] = _final_weights(Path(summary["run_dir"]))
    return _UNINTERRUPTED[key]


def test_fault_tolerance_config_is_refused_by_name(cosmo_data):
    def config(*extra):
        return load_config(None, [*TINY, f"data.path={cosmo_data}", "fault_tolerance.enabled=true",
                                  *extra])
    with pytest.raises(ConfigError, match="plan.data = 6 does not split into fault_tolerance."
                                          "groups = 4; use groups = 2 or 3 or 6"):
        config("plan.data=6", "fault_tolerance.groups=4")
    with pytest.raises(ConfigError, match="one group has no peer"):
        config("plan.data=1")
    with pytest.raises(ConfigError, match="fault_tolerance.batch='half' must be 'keep' or"):
        config("plan.data=2", 'fault_tolerance.batch="half"')
    with pytest.raises(ConfigError, match="heartbeat_timeout_ms=20000 is longer"):
        config("plan.data=2", "fault_tolerance.heartbeat_timeout_ms=20000")
    assert config("plan.data=2").fault_tolerance.groups == 0  # 0: one group per replica


def test_two_groups_without_a_fault_equal_data_parallelism(cosmo_data, tmp_path):
    """2 groups of 1 rank under torchft against plain data parallelism on 2 ranks: the
    average of the groups' losses per step equals the data-parallel loss, and both groups end
    with the data-parallel weights (measured: equal to the last bit; bar 1e-6)."""
    common = [*TINY, f"data.path={cosmo_data}", "train.steps=5", "optim.name='sgd'",
              "optim.lr=0.05"]
    plain = run_ranks(2, run_job, load_config(None, [*common, f"run.out_dir={tmp_path}/dp"]))[0]
    address, stop = start_lighthouse(load_config(None, [*common, *FT]), min_replicas=2)
    try:
        # (batch = "shrink": the mean over the groups present; "keep" is in the tests below)
        overrides = [*common, *FT, "fault_tolerance.min_replicas=2",
                     'fault_tolerance.batch="shrink"']
        procs = [_group(k, tmp_path / f"g{k}", address, overrides) for k in (0, 1)]
        for k, proc in enumerate(procs):
            _wait(proc, tmp_path / f"g{k}")
    finally:
        stop()
    runs = [_run_dir(tmp_path / f"g{k}") for k in (0, 1)]
    dp, groups = logged_losses(plain["run_dir"]), [logged_losses(r) for r in runs]
    assert sorted(dp) == sorted(groups[0]) == sorted(groups[1]) == [1, 2, 3, 4, 5]
    averaged = torch.tensor([(groups[0][s] + groups[1][s]) / 2 for s in sorted(dp)])
    assert rel_err(averaged, torch.tensor([dp[s] for s in sorted(dp)])) <= 1e-6
    reference = _final_weights(Path(plain["run_dir"]))
    for run in runs:
        weights = _final_weights(run)
        assert max(rel_err(weights[k], reference[k]) for k in reference) <= 1e-6
        summary = json.loads((run / "summary.json").read_text())
        assert summary["ft_discarded_attempts"] == 0 and summary["ft_heals"] == []


def _last_logged_step(out: Path) -> int:
    steps = [json.loads(line).get("step", 0) for path in out.glob("*/metrics.jsonl")
             for line in path.read_text().splitlines() if line.endswith("}")]
    return max(steps, default=0)


def test_a_killed_group_rejoins_from_its_peer_and_the_survivor_never_redoes_a_step(
        cosmo_data, tmp_path):
    """Once both groups have trained past step 10 together, group 1's rank gets SIGKILL and
    is started again; group 0 goes on alone (covering group 1's samples: batch = "keep") and
    the new group 1 heals from it (no checkpoint exists anywhere to read). Measured here: a
    2.0 s pause (heartbeat_timeout_ms 2000), 0 or 1 attempt discarded, the restarted group
    back 4-7 s after the kill, final weights equal to the uninterrupted run's to the last bit."""
    # wider convolutions: ~0.05 s steps, so that the survivor is still training when the
    # restarted group has imported torch and joined (seconds on a loaded machine)
    steps, kill_after = 200, 10
    overrides = [*TINY, f"data.path={cosmo_data}", *FT, f"train.steps={steps}",
                 "model.base_channels=16"]
    address, stop = start_lighthouse(load_config(None, overrides), min_replicas=1)
    try:
        survivor = _group(0, tmp_path / "g0", address, overrides)
        doomed = _group(1, tmp_path / "g1", address, overrides)
        deadline = time.time() + 240
        while min(_last_logged_step(tmp_path / "g0"), _last_logged_step(tmp_path / "g1")) \
                < kill_after and time.time() < deadline:
            time.sleep(0.05)
        killed_at_step = _last_logged_step(tmp_path / "g1")
        doomed.send_signal(signal.SIGKILL)
        killed_at = time.time()
        assert doomed.wait(timeout=60) == -9
        (killed_dir,) = [p for p in (tmp_path / "g1").iterdir() if p.is_dir()]
        assert not (killed_dir / "checkpoints").exists()  # nothing a restart could read
        restarted = _group(1, tmp_path / "g1b", address, overrides)
        _wait(survivor, tmp_path / "g0")
        _wait(restarted, tmp_path / "g1b")
    finally:
        stop()
    kill_at = killed_at_step
    first, second = _run_dir(tmp_path / "g0"), _run_dir(tmp_path / "g1b")
    logged = [json.loads(line)["step"] for line in (first / "metrics.jsonl").read_text()
              .splitlines() if "loss" in json.loads(line)]
    assert logged == sorted(set(logged)) and logged[-1] == steps  # no step twice, none back
    s0 = json.loads((first / "summary.json").read_text())
    s1 = json.loads((second / "summary.json").read_text())
    print(f"survivor: pause {s0['ft_pause_s_max']:.2f} s, discarded {s0['ft_discarded_attempts']}"
          f", steps alone {s0['ft_steps_with_groups_missing']}; restarted group healed at "
          f"{s1['ft_heals']} ({s1['ft_heals'][0]['at'] - killed_at:.1f} s after the kill)")
    assert s0["ft_discarded_attempts"] <= 1
    assert s0["ft_pause_s_max"] <= 5.0 + 2.0  # timeout_s + 2 s
    assert s0["ft_steps_with_groups_missing"] >= 1  # it did train alone
    (heal,) = s1["ft_heals"]
    assert kill_at < heal["rejoined_at_step"] < steps
    rejoined = sorted(logged_losses(second))  # its first step is the heal's
    assert rejoined[0] == heal["rejoined_at_step"] and rejoined[-1] == steps
    # the rate each logged step trained at: the rejoined group's, from its healed first step
    # on, is the survivor's (the heal sets it; the log once showed the schedule's step 0)
    rates = [{r["step"]: r["lr"] for r in map(json.loads, (d / "metrics.jsonl").read_text()
                                              .splitlines()) if "lr" in r} for d in (first, second)]
    assert rates[1] and all(rates[1][k] == rates[0][k] for k in rates[1]), rates
    a, b = _final_weights(first), _final_weights(second)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the groups agree to the last bit
    # batch = "keep": group 0 trained on group 1's samples while it was out, so the run is the
    # uninterrupted one (plain data parallelism on 2 ranks) up to the order of the sums
    reference = uninterrupted_weights(overrides, tmp_path / "dp")
    err = max(rel_err(a[k], reference[k]) for k in reference)
    print(f"final weights against the uninterrupted run: {err:.2e} relative")
    assert err <= 1e-6  # measured: 0 (two groups: a halving and a sum of two terms are exact)


@pytest.mark.parametrize("steps,kill_step", [(30, 6), (8, 8)], ids=["mid-run", "last-step"])
def test_exatrain_run_starts_the_lighthouse_and_restarts_a_killed_group(cosmo_data, tmp_path,
                                                                        steps, kill_step):
    """`exatrain run --nproc 2 --max-restarts 1` with 2 groups: its own lighthouse, group 1
    SIGKILLed at step `kill_step` and started again by the supervisor, healed from group 0. With
    min_replicas = 2 the groups start together and group 0 waits for the restart (no step
    alone), so the run is the uninterrupted one: both groups end with the same weights, each in
    a checkpoint of the last step. Killed as the last step starts, the restarted group heals
    into that step: it is still the last, and still checkpointed."""
    args = [*TINY, f"data.path={cosmo_data}", *FT, f"train.steps={steps}",
            "fault_tolerance.min_replicas=2", f"run.out_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "EXATRAIN_INJECT_FAULTS": f"kill@1:{kill_step}"}
    env.pop("TORCHFT_LIGHTHOUSE", None)
    env.pop("REPLICA_GROUP_ID", None)
    cmd = [sys.executable, "-m", "exatrain.cli", "run", "--nproc", "2", "--max-restarts", "1"]
    for item in args:
        cmd += ["--set", item]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (root,) = tmp_path.glob("cosmoflow-*")
    assert sorted(p.name for p in root.iterdir()) == ["config.toml", "group_00", "group_01",
                                                     "lighthouse.log"]
    assert "Quorum" in (root / "lighthouse.log").read_text()  # it ran, and kept its log there
    (survivor,) = [p.parent for p in root.glob("group_00/*/summary.json")]
    (rejoined,) = [p.parent for p in root.glob("group_01/*/summary.json")]
    assert len([p for p in (root / "group_01").iterdir() if p.is_dir()]) == 2  # killed, restarted
    s1 = json.loads((rejoined / "summary.json").read_text())
    (heal,) = s1["ft_heals"]
    assert heal["rejoined_at_step"] == kill_step and s1["steps"] == steps  # the step it died in
    from exatrain.observe.fields import lookup
    undocumented = [k for k in s1 if lookup(k) is None]
    assert not undocumented, f"summary keys with no row in exatrain.observe.fields: {undocumented}"
    logged = [json.loads(line)["step"] for line in (survivor / "metrics.jsonl").read_text()
              .splitlines() if "loss" in json.loads(line)]
    assert logged == list(range(1, steps + 1))  # every step once, none redone
    from exatrain.train.checkpoints import checkpoint
    assert checkpoint.latest(survivor).name == checkpoint.latest(rejoined).name \
        == f"step_{steps:08d}"
    a, b = _final_weights(survivor), _final_weights(rejoined)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fault_tolerance_off_does_not_import_torchft():
    code = ("import sys, exatrain, exatrain.cli, exatrain.train.run, exatrain.train.trainer; "
            "sys.exit('torchft' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": SRC}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_a_group_without_a_lighthouse_is_told_how_to_start_one(cosmo_data, tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC, "REPLICA_GROUP_ID": "0", "OMP_NUM_THREADS": "1"}
    env.pop("TORCHFT_LIGHTHOUSE", None)
    cmd = [sys.executable, "-m", "exatrain.cli", "run", "--nproc", "1"]
    for item in [*TINY, f"data.path={cosmo_data}", *FT, "train.steps=2",
                 f"run.out_dir={tmp_path}"]:
        cmd += ["--set", item]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "TORCHFT_LIGHTHOUSE is not set: start a lighthouse (`torchft_lighthouse" \
        in done.stderr, done.stderr[-2000:]
