"""`exatrain bench faults --recovery`: what one failure costs under each way of recovering.

The default job (`exatrain run` without a config: CosmoFlow) at bench size (`JOB`: 16³ samples,
4 convolutions of 4 base channels, global batch 8), on 2 local gloo ranks, `--steps` steps with
a checkpoint every `--every`, trained six times, each as a user starts it (a process of its own,
timed from its start to its exit):

  uninterrupted   `exatrain run --nproc 2 --max-restarts 1`, no failure
  plain restart   the same, rank 1 SIGKILLed as step `--kill-step` starts: every rank starts
                  again from the last checkpoint (train.resilience.restart.supervise)
  elastic         two torchrun agents on this machine as two nodes (`--nnodes 1:2`, c10d
                  rendezvous on 127.0.0.1, one rank each; the first agent hosts the rendezvous);
                  no failure, then: rank 1 stops as step `--kill-step` starts and its node (its
                  agent's process group) is killed; the job re-forms on the node left, from the
                  last checkpoint, with data = 1 and 2 micro-batches of 4 a step
                  (train.resilience.elastic)
  torchft         `[fault_tolerance]` with 2 replica groups of 1 rank (`exatrain run --nproc 2
                  --max-restarts 1`: a lighthouse and a group per rank); no failure, then: group
                  1's rank SIGKILLed as step `--kill-step` starts; it is started again and heals
                  from group 0 (train.resilience.replica_launch, replicas). min_replicas = 2:
                  group 0 waits for it (with 2 groups, going on alone would halve the world)

Figures per way (prefixes `uninterrupted_`, `plain_`, `elastic_`, `torchft_`; the fault-free
runs of elastic and torchft: `elastic_no_failure_`, `torchft_no_failure_`):

  wall_s          the launch's wall time, process start to exit (imports and launchers included)
  tail_s          from the moment the last step before the failure (`--kill-step` - 1) was
                  first logged to the launch's exit: the failure, the recovery, the steps left
  wall_lost_s     tail_s minus the fault-free run's under the same launcher (plain restart: the
                  uninterrupted run's). Measured from that step, not from the start, so that
                  the start-up of the processes, which varies by seconds on a loaded machine,
                  is left out; the launchers' own cost is in the fault-free rows' wall_s
  steps_redone    steps trained twice: plain restart and elastic, the last step logged before
                  the failure minus the checkpoint step resumed (summary `lost_steps`,
                  formations.jsonl `steps_redone`); torchft, steps group 0 (the survivor) logged
                  more than once
  recoveries      restarts (plain, torchft: groups started again) or re-formations (elastic)
  steps           the last step of the run (every way ends at `--steps`)
  final_loss      the training loss of the last step (torchft: the mean of the groups', each
                  over its own half of the batch)
  val_mae         the validation MAE of the final weights (torchft: group 0's)

and the mechanisms' own accounts: `elastic_seconds_lost` (formations.jsonl: from the resumed
checkpoint's commit to the re-formed job's first step), `torchft_pause_s` (group 0's longest
wait between steps beyond a step's time), `torchft_attempts_discarded` (step attempts group 0
ran again because a group died inside them). run.timeout_s is `--timeout` (default 10 s): the
elastic job's surviving rank waits that long in the collective its lost peer never joins (at the
default 600 s, ten minutes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

JOB = ["model.size=16", "model.conv_layers=4", "model.base_channels=4", "data.size=16",
       "data.generate=false", "train.batch_size=8", "train.log_every=1", "optim.lr=0.003",
       "train.eval_every=0"]
FAULT_TOLERANCE = ["fault_tolerance.enabled=true", "plan.data=2", "fault_tolerance.min_replicas=2",
                   "fault_tolerance.timeout_s=5.0", "fault_tolerance.heartbeat_timeout_ms=2000"]
# the rendezvous waits of a test, not of a cluster: a dead node is noticed after 3 missed
# heartbeats 2 s apart (not 5 s), a round closes 2 s after its first node (not 30 s)
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=2,keep_alive_max_attempt=3"
WAYS = ("uninterrupted", "plain", "elastic_no_failure", "elastic", "torchft_no_failure", "torchft")
TITLES = {"uninterrupted": "uninterrupted", "plain": "plain restart",
          "elastic_no_failure": "elastic, no failure", "elastic": "elastic: a node lost",
          "torchft_no_failure": "torchft, no failure", "torchft": "torchft: a group lost"}
LIMIT_S = 600.0
POLL_S = 0.05


def kill_step(steps: int, every: int, chosen: int) -> int:
    """The step whose start the failure hits: `chosen`, else half a checkpoint interval past
    the middle checkpoint (so that a plain restart redoes some steps)."""
    step = chosen or (steps // 2 // every) * every + max(1, every // 2) + 1
    if not 1 < step <= steps:
        raise ValueError(f"--kill-step {step} is not within the run's steps 2..{steps}; "
                         f"choose a step in that range or raise --steps.")
    return step


def _env(faults: str = "", **extra: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    for name in ("EXATRAIN_INJECT_FAULTS", "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID",
                 "EXATRAIN_RUN_DIR"):
        env.pop(name, None)
    if faults:
        env["EXATRAIN_INJECT_FAULTS"] = faults
    return env


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    """A process in a session of its own (so that its whole group can be killed), logging to
    `log`."""
    with open(log, "w") as out:   # the process keeps its own copy of the file
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _follow(procs: dict, what: str, root: Path, metrics: str, mark: int,
            on_poll=None) -> tuple[float, float]:
    """Wait until every process of `procs` ({log path: process}) has exited with 0, polling
    every POLL_S: (the time the last one exited, the time step `mark` was first logged in a
    file matching the glob `metrics` under `root`). `on_poll()` runs at each poll and may take
    processes out of `procs` (a node killed on purpose)."""
    deadline, marked = time.monotonic() + LIMIT_S, None
    logged = f'"step": {mark}, "loss"'   # metrics.jsonl's line of a training step
    while procs:
        if marked is None and any(logged in p.read_text() for p in root.glob(metrics)):
            marked = time.monotonic()
        if on_poll is not None:
            on_poll()
        for log, proc in list(procs.items()):
            rc = proc.poll()
            if rc == 0:
                del procs[log]
            elif rc is not None or time.monotonic() > deadline:
                for other in procs.values():
                    _kill_group(other)
                raise RuntimeError(f"bench faults --recovery: the {what} run ended with "
                                   f"{rc if rc is not None else 'no exit in time'}; its log "
                                   f"{log}:\n{log.read_text()[-3000:]}")
        time.sleep(POLL_S)
    if marked is None:
        raise RuntimeError(f"bench faults --recovery: the {what} run never logged step {mark}; "
                           f"its files: {root}/{metrics}")
    return time.monotonic(), marked


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _run_cli(name: str, out: Path, overrides: list[str], mark: int, faults: str = "") -> tuple:
    """`exatrain run --nproc 2 --max-restarts 1` with `overrides`: (its start, its end, when
    step `mark` was first logged), in time.monotonic() seconds."""
    (out / name).mkdir(parents=True)
    log = out / f"{name}.log"
    cmd = [sys.executable, "-m", "exatrain.cli", "run", "--nproc", "2", "--max-restarts", "1",
           *_sets([*overrides, f"run.out_dir={out / name}"])]
    metrics = "*/group_00/*/metrics.jsonl" if "fault_tolerance.enabled=true" in overrides \
        else "*/metrics.jsonl"
    began = time.monotonic()
    return (began, *_follow({log: _start(cmd, _env(faults), log)}, TITLES[name],
                            out / name, metrics, mark))


def _run_elastic(name: str, out: Path, overrides: list[str], mark: int, fail_at: int = 0) -> tuple:
    """Two torchrun agents (`--nnodes 1:2`, one rank each) on 127.0.0.1; with `fail_at`, rank 1
    stops as step `fail_at` starts and its agent's whole process group is killed (the node is
    lost). (Its start, the surviving agents' exit, when step `mark` was first logged.)"""
    port = _free_port()
    run_dir = out / name / "cosmoflow-recovery"

    def agent(i: int) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
                "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d",
                "--rdzv-id", "recovery", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-conf", f"{RDZV_CONF},is_host={int(i == 0)}", "--monitor-interval", "0.2",
                "-m", "exatrain.cli", "run", *_sets([*overrides, f"run.out_dir={out / name}"])]

    # torch 2.13's agents share one TCPStore across rounds, which a re-formed job may wait on
    # for ever (see the long-run tutorial)
    env = _env(f"hang@1:{fail_at}" if fail_at else "", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    logs = [out / f"{name}_node{i}.log" for i in (0, 1)]
    (out / name).mkdir(parents=True)
    began = time.monotonic()
    # node 0 starts first: the lower process id, so rank 0 in the rendezvous's order
    nodes = {log: _start(agent(i), env, log) for i, log in enumerate(logs)}
    lost = logs[1]

    def lose_node_1() -> None:   # rank 1 has stopped at step fail_at: its node dies
        if fail_at and lost in nodes and (run_dir / "faults" / f"hang@1:{fail_at}").exists():
            _kill_group(nodes.pop(lost))

    return (began, *_follow(nodes, TITLES[name], run_dir, "metrics.jsonl", mark,
                        lose_node_1))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _logged_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, filter(None, lines)) if "loss" in r]


def _one_run(out: Path) -> Path:
    (summary,) = out.glob("*/summary.json")
    return summary.parent


def _figures(name: str, out: Path) -> dict:
    """steps_redone, recoveries, steps, final_loss, val_mae of run `name` from its files."""
    if name.startswith("torchft"):
        (root,) = (out / name).glob("cosmoflow-*")
        survivor = json.loads(next(root.glob("group_00/*/summary.json")).read_text())
        groups = [json.loads(p.read_text()) for p in sorted(root.glob("group_*/*/summary.json"))]
        steps = _logged_steps(Path(survivor["run_dir"]))
        starts = [p for p in root.glob("group_*/*") if p.is_dir()]  # a run directory per start
        return {"steps_redone": len(steps) - len(set(steps)),
                "recoveries": len(starts) - len(groups),
                "steps": max(s["steps"] for s in groups),
                "final_loss": sum(s["final_loss"] for s in groups) / len(groups),
                "val_mae": survivor["val_mae"],
                "attempts_discarded": survivor["ft_discarded_attempts"],
                "pause_s": survivor["ft_pause_s_max"]}
    summary = json.loads((_one_run(out / name) / "summary.json").read_text())
    figures = {"steps": summary["steps"], "final_loss": summary["final_loss"],
               "val_mae": summary["val_mae"]}
    if not name.startswith("elastic"):
        return {"steps_redone": summary["lost_steps"], "recoveries": summary["restarts"],
                **figures}
    shrinks = summary.get("reformations", [])
    own = {"seconds_lost": sum(r["seconds_lost"] for r in shrinks)} if shrinks else {}
    return {"steps_redone": sum(r["steps_redone"] for r in shrinks), "recoveries": len(shrinks),
            **figures, **own}


def measure(data: Path, out: Path, steps: int, every: int, fail_at: int, timeout_s: float) -> dict:
    """The six runs (see the module doc) on the CosmoFlow data at `data`, under `out`, with
    run.timeout_s = `timeout_s` (how long the elastic job's survivor waits in a collective with
    the lost node before it gives up): the flat figures, `<way>_<figure>`."""
    job = [*JOB, f"data.path={data}", f"train.steps={steps}", f"train.checkpoint_every={every}",
           "train.checkpoint_keep=2", f"run.timeout_s={timeout_s}"]
    mark = fail_at - 1   # the last step before the failure
    times = {"uninterrupted": _run_cli("uninterrupted", out, job, mark),
             "plain": _run_cli("plain", out, job, mark, f"kill@1:{fail_at}"),
             "elastic_no_failure": _run_elastic("elastic_no_failure", out, job, mark),
             "elastic": _run_elastic("elastic", out, job, mark, fail_at),
             "torchft_no_failure": _run_cli("torchft_no_failure", out, [*job, *FAULT_TOLERANCE],
                                            mark),
             "torchft": _run_cli("torchft", out, [*job, *FAULT_TOLERANCE], mark,
                                 f"kill@1:{fail_at}")}
    baseline = {"uninterrupted": "uninterrupted", "plain": "uninterrupted",
                "elastic_no_failure": "elastic_no_failure", "elastic": "elastic_no_failure",
                "torchft_no_failure": "torchft_no_failure", "torchft": "torchft_no_failure"}
    result = {"steps": steps, "checkpoint_every": every, "kill_step": fail_at, "nproc": 2,
              "timeout_s": timeout_s, "job": " ".join(JOB)}
    for name in WAYS:
        began, ended, marked = times[name]
        _, twin_ended, twin_marked = times[baseline[name]]
        figures = {"wall_s": ended - began, "tail_s": ended - marked,
                   "wall_lost_s": (ended - marked) - (twin_ended - twin_marked),
                   **_figures(name, out)}
        result.update({f"{name}_{key}": value for key, value in figures.items()})
    return result


def table_rows(result: dict) -> list[list[str]]:
    """The comparison as rows of text, one per way, in the order of `header`."""
    rows = []
    for name in WAYS:
        r = {figure: result[f"{name}_{figure}"] for figure in
             ("recoveries", "steps_redone", "wall_s", "tail_s", "wall_lost_s", "steps",
              "final_loss", "val_mae")}
        faulty = name in ("plain", "elastic", "torchft")
        rows.append([TITLES[name], str(r["recoveries"]) if faulty else "–",
                     str(r["steps_redone"]) if faulty else "–", f"{r['wall_s']:.1f} s",
                     f"{r['tail_s']:.1f} s", f"{r['wall_lost_s']:+.1f} s" if faulty else "–",
                     str(r["steps"]), f"{r['final_loss']:.4f}", f"{r['val_mae']:.4f}"])
    return rows


def header(result: dict) -> list[str]:
    return ["run", "recoveries", "steps redone", "launch wall",
            f"step {result['kill_step'] - 1} → end", "wall lost", "last step", "final loss",
            "val_mae"]


def markdown_table(result: dict) -> str:
    columns = header(result)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
    return "\n".join(lines)


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"one failure at step {result['kill_step']} of {result['steps']} "
                        f"(checkpoint every {result['checkpoint_every']}), 2 ranks")
    for i, column in enumerate(header(result)):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in table_rows(result):
        table.add_row(*row)
    Console().print(table)
