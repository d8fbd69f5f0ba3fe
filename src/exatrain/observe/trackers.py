"""Experiment trackers beside TensorBoard: Weights & Biases and MLflow (`[observe] trackers`).

From rank 0 only (of each trainer, in a population), at log steps only, from a thread of their
own (the loop hands a record over and goes on), and never fatal:

- start (at the beginning of fit): one tracked run with the resolved config as its parameters
  (flattened to `section.key`) and the Plan, world size, exatrain and torch versions, device and
  workload as tags; W&B in offline mode unless told otherwise, writing under RUN_DIR/wandb;
  MLflow into `observe.mlflow.tracking_uri`, else MLFLOW_TRACKING_URI, else a SQLite database
  beside the runs (OUT_DIR/mlflow.db, artifacts in OUT_DIR/mlartifacts);
- every record written to metrics.jsonl: its numbers at its step (a table `{axis: n}` as
  `key/axis`, `step_losses` as `step_loss` at each of its steps), as TensorBoard has them;
- at the end: the summary, and the run's pictures (RUN_DIR/*.png), mlperf.log, summary.json and
  config.toml as files/artifacts; `exatrain report RUN_DIR` adds its pictures and report.md to
  the same runs afterwards (`attach`: under `report/`).

Resume: RUN_DIR/trackers.json keeps each tracker's run id. A run resumed from a checkpoint in the
same directory (`--resume`, a restart, a Slurm requeue) continues the same W&B and MLflow runs. It
asks each what it holds, per metric, up to which step (MLflow: its store; W&B: the run's own
`.wandb` logs under RUN_DIR/wandb, which W&B writes every 15 s, so a killed process loses what it
had not written), sends the records of metrics.jsonl (kept up to the checkpoint) that it lacks,
and from then on skips the steps it holds: a tracked run has every step once, none missing, even
though the steps after the checkpoint are trained again.

A tracker that raises is reported once on stderr, switched off for the rest of the run (a tracking
server that is gone would otherwise cost a timeout at every log step), and named in the summary
(`trackers.<name>.failed`); training goes on. A tracker whose package is missing is refused when
the config is read (`check_trackers`), naming the extra to install.

This module is the common part (starting, feeding and ending the runs of a run directory); each
tracker has its own module (tracker_wandb, tracker_mlflow), and what every tracker is given is in
tracker_records.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import shutil
import sys
import threading
import time
from pathlib import Path

from .tracker_mlflow import MLflowRun, retry
from .tracker_records import Outcome, rows, run_tags
from .tracker_wandb import WandbRun, read_wandb_log, wandb_segment

TRACKERS = ("tensorboard", "wandb", "mlflow")
WANDB_MODES = ("", "offline", "online", "disabled")
STATE = "trackers.json"
WAIT_S = 120.0  # the end of a run waits this long at most for the trackers' thread
ARTIFACTS = ("mlperf.log", "summary.json", "config.toml")  # beside RUN_DIR/*.png


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def check_trackers(options) -> None:
    """Refuse, when the config is read, a tracker that is unknown or cannot be imported."""
    import difflib
    for name in options.trackers:
        if name not in TRACKERS:
            match = difflib.get_close_matches(name, TRACKERS, n=1)
            hint = f" Did you mean {match[0]!r}?" if match else ""
            raise ValueError(f"observe.trackers: {name!r} is not one of "
                             f"{', '.join(TRACKERS)}.{hint}")
    if "wandb" in options.trackers:
        if _missing("wandb"):
            raise ValueError("observe.trackers includes 'wandb' but the wandb package is not "
                             "installed: pip install 'exatrain[wandb]' (or take 'wandb' out of "
                             "observe.trackers).")
        if options.wandb.mode not in WANDB_MODES:
            raise ValueError(f"observe.wandb.mode={options.wandb.mode!r} is not one of offline, "
                             "online, disabled (or empty: WANDB_MODE, else offline).")
    if "mlflow" in options.trackers:
        if _missing("mlflow"):
            raise ValueError("observe.trackers includes 'mlflow' but the mlflow package is not "
                             "installed: pip install 'exatrain[mlflow]' (or take 'mlflow' out of "
                             "observe.trackers).")
        uri = options.mlflow.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        if (not uri or uri.startswith("sqlite:")) and _missing("sqlalchemy"):
            raise ValueError("observe.trackers includes 'mlflow' with a SQLite store, which needs "
                             "sqlalchemy and alembic: pip install 'exatrain[mlflow]'.")


class Trackers:
    """The W&B and MLflow runs of one run directory (rank 0), each switched off at its first
    failure."""

    def __init__(self, config, mesh, run_dir, report=None):
        options = config.observe
        self.run_dir = Path(run_dir)
        self.report = report or (lambda text: print(text, file=sys.stderr, flush=True))
        path = self.run_dir / STATE
        state = json.loads(path.read_text()) if path.is_file() else {}
        self.logged: dict[str, dict[str, int]] = {}  # tracker -> {metric: last step it holds}
        self.failed: dict[str, str] = {}
        self.runs: dict = {}
        # a population's trainers (RUN_DIR/trainer_KK) are grouped by their job's directory
        group = self.run_dir.parent.name if self.run_dir.name.startswith("trainer_") else ""
        tags, resolved = run_tags(config, mesh), config.to_dict()
        for name in ("wandb", "mlflow"):
            if name not in options.trackers:
                continue
            previous = state.get(name)
            try:
                if name == "wandb":
                    if previous:  # before this start writes a log of its own
                        self.logged[name] = WandbRun.held(self.run_dir, previous["id"])
                    run = WandbRun(options, resolved, self.run_dir, tags, group, previous)
                else:
                    run = retry(lambda: MLflowRun(options, resolved, self.run_dir, tags, group,
                                                   previous, Path(config.run.out_dir)))
                    if previous:
                        self.logged[name] = run.held()
                self.runs[name] = run
            except Exception as exc:
                self._fail(name, exc, "start")
        ids = {k: v for k, v in state.items() if k in ("wandb", "mlflow")}  # a failed one's too
        ids.update({name: run.state() for name, run in self.runs.items()})
        path.write_text(json.dumps(ids))
        # records go to the trackers from a thread of their own, in order; what a process that
        # dies leaves unsent is sent again from metrics.jsonl when the run resumes
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="exatrain-trackers", daemon=True)
        self.thread.start()
        metrics = self.run_dir / "metrics.jsonl"
        if self.logged and metrics.is_file():  # resumed: first what the trackers lack, up to here
            self.queue.put((metrics, metrics.stat().st_size))

    def _fail(self, name: str, exc: BaseException, when: str) -> None:
        self.runs.pop(name, None)
        self.failed[name] = f"{when}: {type(exc).__name__}: {exc}"
        self.report(f"exatrain: the {name} tracker failed at {when} ({type(exc).__name__}: {exc}); "
                    f"it is off for the rest of this run and training goes on (metrics.jsonl "
                    f"and the other trackers keep every record).")

    def log(self, record: dict) -> None:
        """Queue one metrics.jsonl record for the trackers' thread (the training loop does not
        wait for a tracker: a W&B record costs ~20 ms, an MLflow one ~12 ms)."""
        if self.runs:
            self.queue.put(record)

    def _work(self) -> None:
        while True:
            record = self.queue.get()
            try:
                if record is None:
                    return
                try:
                    if isinstance(record, tuple):  # (metrics.jsonl, its size when resumed)
                        self._send_file(*record)
                    else:
                        self._send(record)
                except Exception as exc:  # not a tracker's own call: stop them all, once
                    for name in list(self.runs):
                        self._fail(name, exc, "resume" if isinstance(record, tuple)
                                   else f"step {record.get('step')}")
            finally:
                self.queue.task_done()

    def _drained(self) -> bool:
        """Wait (at most WAIT_S) until the thread has sent what is queued; False if it has not."""
        deadline = time.monotonic() + WAIT_S
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.queue.unfinished_tasks

    def _send_file(self, path: Path, size: int) -> None:
        """The records of metrics.jsonl's first `size` bytes (the loop appends to it meanwhile)."""
        with open(path, "rb") as f:
            for line in f.read(size).decode().splitlines():
                self._send(json.loads(line))

    def _send(self, record: dict) -> None:
        """One record to every tracker, without the steps it already holds."""
        by_step = rows(record)
        for name, run in list(self.runs.items()):
            last = self.logged.setdefault(name, {})
            new = {}
            for step, values in by_step.items():
                named = {run.key(k): v for k, v in values.items()}
                keep = {k: v for k, v in named.items() if step > last.get(k, 0)}
                if keep:
                    new[step] = keep
            if not new:
                continue
            try:
                run.log(new)
            except Exception as exc:
                self._fail(name, exc, f"step {record['step']}")
                continue
            for step, values in new.items():
                last.update(dict.fromkeys(values, step))

    def info(self) -> dict:
        self._drained()  # what is queued is sent (or has failed) first
        out = {name: run.info() for name, run in self.runs.items()}
        out.update({name: {"failed": why} for name, why in self.failed.items()})
        return out

    def finish(self, summary: dict | None, end: Outcome) -> None:
        """Send what is queued, then end every run as `end` says (with the summary and the
        run's files when there is a summary)."""
        if not self._drained():  # a tracker stuck in a call: the run ends without it
            for name in list(self.runs):
                self._fail(name, TimeoutError(f"still sending after {WAIT_S:.0f} s"), "the end")
            return
        self.queue.put(None)
        self.thread.join()
        files = sorted(self.run_dir.glob("*.png")) + \
            [self.run_dir / f for f in ARTIFACTS if (self.run_dir / f).is_file()]
        for name, run in list(self.runs.items()):
            try:
                run.finish(summary, files, self.run_dir, end)
            except Exception as exc:
                self._fail(name, exc, "the end")
        self.runs = {}


def attach(run_dir: Path, files: list[Path], folder: str = "report",
           report=lambda text: print(text, file=sys.stderr, flush=True)) -> list[str]:
    """Add `files` (a report's pictures) under `folder` to the tracked runs of a finished run
    directory (RUN_DIR/trackers.json): MLflow's run gets them as artifacts; W&B's, in a short
    resumed segment of the same run id (synced with the others). Returns the trackers that took
    them; one that cannot is reported and skipped."""
    path = Path(run_dir) / STATE
    state = json.loads(path.read_text()) if path.is_file() else {}
    done = []
    for name in ("mlflow", "wandb"):
        if name not in state:
            continue
        try:
            if name == "mlflow":
                from mlflow.tracking import MlflowClient
                client = MlflowClient(tracking_uri=state[name]["tracking_uri"])
                for f in files:
                    client.log_artifact(state[name]["run_id"], str(f), folder)
            else:
                run = wandb_segment(run_dir, state[name])
                (Path(run.dir) / folder).mkdir(exist_ok=True)
                for f in files:
                    shutil.copy2(f, Path(run.dir) / folder / Path(f).name)
                run.finish()
            done.append(name)
        except Exception as exc:
            report(f"exatrain: could not add the report to the {name} run ({type(exc).__name__}: "
                   f"{exc}); the report is in {Path(files[0]).parent if files else run_dir}.")
    return done


def end_open_runs(run_dir: Path, end: Outcome,
                  report=lambda text: print(text, file=sys.stderr, flush=True)) -> list[str]:
    """After a job failed: end the tracked runs of `run_dir` and of its trainers (a
    population's RUN_DIR/trainer_KK) that no rank ended as `end` says. A rank that fails ends
    its own; these are the runs of ranks killed on the way (SIGKILL, out of memory) or stopped
    by the launcher while they waited for a rank that had failed, which is how a population's
    healthy trainers end when another fails. MLflow: a run still RUNNING gets `end.status`;
    W&B: a run whose last segment holds no exit record gets a short resumed segment that
    ends with `end.exit_code`. Returns "tracker:run id" of each run it ended."""
    done = []
    for path in [Path(run_dir) / STATE, *sorted(Path(run_dir).glob(f"trainer_*/{STATE}"))]:
        if not path.is_file():
            continue
        state, here = json.loads(path.read_text()), path.parent
        for name in ("mlflow", "wandb"):
            if name not in state:
                continue
            try:
                if name == "mlflow":
                    from mlflow.tracking import MlflowClient
                    client = MlflowClient(tracking_uri=state[name]["tracking_uri"])
                    run_id = state[name]["run_id"]
                    if client.get_run(run_id).info.status != "RUNNING":
                        continue
                    client.set_terminated(run_id, end.status)
                else:
                    run_id = state[name]["id"]
                    logs = sorted(here.glob(f"wandb/*-{run_id}/run-{run_id}.wandb"))
                    if logs and any(r.WhichOneof("record_type") == "exit"
                                    for r in read_wandb_log(logs[-1])):
                        continue
                    wandb_segment(here, state[name]).finish(exit_code=end.exit_code)
                done.append(f"{name}:{run_id}")
            except Exception as exc:
                report(f"exatrain: could not mark the {name} run of {here} {end.status} "
                       f"({type(exc).__name__}: {exc}); it may still show as running.")
    return done
