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
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import queue
import random
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

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


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"train": {"steps": 2}} -> {"train.steps": 2} (lists and scalars kept as they are)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def rows(record: dict) -> dict[int, dict[str, float]]:
    """One metrics.jsonl record as {step: {key: number}}: the numbers TensorBoard gets."""
    step = record["step"]
    out: dict[int, dict[str, float]] = {step: {}}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)):
            out[step][key] = float(value)
        elif isinstance(value, dict):
            out[step].update({f"{key}/{sub}": float(v) for sub, v in value.items()
                              if isinstance(v, (int, float))})
        elif key == "step_losses":
            for i, loss in enumerate(value):
                out.setdefault(step - len(value) + 1 + i, {})["step_loss"] = float(loss)
    return dict(sorted(out.items()))


def scalar_summary(summary: dict) -> dict:
    """The summary's numbers and words (tables flattened to `key/sub`), for a run's summary."""
    out = {}
    for key, value in flatten(summary, "").items():
        key = key.replace(".", "/")
        if isinstance(value, (bool, int, float, str)) and value is not None:
            out[key] = value
    return out


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a tracked run ended, as each tracker records it: MLflow's run status (FINISHED,
    FAILED, KILLED), W&B's exit code (0 finished; 1 failed; 128 + the signal's number when
    stopped by a signal, the shell's convention W&B's documentation follows) and whether W&B is
    told the run is being preempted (a stop by a scheduler's signal, resumed later)."""
    status: str
    exit_code: int
    preempted: bool = False


def outcome(summary: dict | None, failure: BaseException | None,
            signum: int | None = None) -> Outcome:
    """The end of a run that returned `summary` or raised `failure`: a stop by SIGTERM/SIGUSR1
    (`stopped_by_signal`, checkpoint written) or an interrupt (Ctrl-C) is KILLED, any other
    exception FAILED. `signum`: the stop's signal where this rank received it (else SIGTERM,
    the scheduler's usual one, is assumed for the exit code)."""
    if failure is None and summary is not None and not summary.get("stopped_by_signal"):
        return Outcome("FINISHED", 0)
    if failure is None or isinstance(failure, KeyboardInterrupt):
        number = signal.SIGINT if isinstance(failure, KeyboardInterrupt) else \
            signum or signal.SIGTERM
        return Outcome("KILLED", 128 + int(number), preempted=failure is None)
    return Outcome("FAILED", 1)


def run_tags(config, trainer_mesh) -> dict[str, str]:
    """The tags of a run on `trainer_mesh` (a population member's: the job's mesh is its
    parent)."""
    import torch

    from ...version import __version__
    device = trainer_mesh.device
    name = device.type
    if device.type == "cuda":
        name = f"cuda:{torch.cuda.get_device_name(device)}"
    mesh = getattr(trainer_mesh, "parent", trainer_mesh)  # a population's: the whole job's
    tags = {"plan": str(mesh.plan), "world_size": str(mesh.world_size),
            "exatrain": __version__, "torch": torch.__version__, "device": name,
            "workload": config.run.workload}
    if mesh is not trainer_mesh:  # one trainer of a population
        tags.update(trainer=str(trainer_mesh.trainer), trainer_plan=str(trainer_mesh.plan))
    return tags


class WandbRun:
    name = "wandb"

    @staticmethod
    def key(name: str) -> str:
        return name

    def __init__(self, options, config: dict, run_dir: Path, tags: dict, group: str,
                 previous: dict | None):
        import wandb
        o = options.wandb
        previous = previous or {}
        self.mode = o.mode or os.environ.get("WANDB_MODE") or previous.get("mode") or "offline"
        self.id = previous.get("id") or _new_id()
        self.project = previous.get("project") or o.project or os.environ.get("WANDB_PROJECT") \
            or "exatrain"
        self.entity = previous.get("entity") or o.entity or None
        self.run = wandb.init(
            project=self.project, entity=self.entity,
            name=o.name or os.environ.get("WANDB_NAME") or run_dir.name,
            group=o.group or os.environ.get("WANDB_RUN_GROUP") or group or None,
            tags=[f"{k}:{v}"[:64] for k, v in tags.items()] + list(o.tags),
            config=config, dir=str(run_dir), id=self.id, resume="allow", mode=self.mode,
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True, save_code=False,
                                    disable_git=True))
        self.dir = Path(self.run.dir).parent  # RUN_DIR/wandb/offline-run-DATE-ID

    @staticmethod
    def held(run_dir: Path, run_id: str) -> dict[str, int]:
        """{metric: last step} of what the run's earlier `.wandb` logs in RUN_DIR/wandb hold."""
        out: dict[str, int] = {}
        for log in sorted(run_dir.glob(f"wandb/*-{run_id}/run-{run_id}.wandb")):
            for record in read_wandb_log(log):
                if record.WhichOneof("record_type") == "history":
                    step = record.history.step.num
                    for item in record.history.item:
                        key = item.key or "/".join(item.nested_key)
                        if not key.startswith("_"):
                            out[key] = max(out.get(key, 0), step)
        return out

    def log(self, by_step: dict) -> None:
        for step, values in by_step.items():
            self.run.log(values, step=step)

    def finish(self, summary: dict | None, files: list[Path], run_dir: Path,
               end: Outcome) -> None:
        if summary is not None:
            self.run.summary.update(scalar_summary(summary))
        for path in files:  # the run's files directory is uploaded by `wandb sync`
            shutil.copy2(path, Path(self.run.dir) / path.name)
        if end.preempted:  # W&B shows it preempted, to be resumed (the same run id)
            self.run.mark_preempting()
        self.run.finish(exit_code=end.exit_code)

    def state(self) -> dict:
        return {"id": self.id, "mode": self.mode, "project": self.project, "entity": self.entity}

    def info(self) -> dict:
        out = {"run_id": self.id, "mode": self.mode, "dir": str(self.dir)}
        if self.mode == "offline":
            out["sync"] = f"wandb sync {self.dir}"
        return out


class MLflowRun:
    name = "mlflow"
    BATCH = 1000  # MLflow's limit of metrics per log_batch call (params: 100)

    @staticmethod
    def key(name: str) -> str:
        """A metric name MLflow takes: letters, digits and `_-. :/`; others become `_`
        (`bytes_per_step/trainer+pipe+data` -> `bytes_per_step/trainer_pipe_data`)."""
        return re.sub(r"[^\w\-. :/]", "_", name)

    def __init__(self, options, config: dict, run_dir: Path, tags: dict, group: str,
                 previous: dict | None, out_dir: Path):
        from mlflow.tracking import MlflowClient
        o = options.mlflow
        if previous:
            self.uri = previous["tracking_uri"]
        else:
            self.uri = o.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
                f"sqlite:///{out_dir.resolve() / 'mlflow.db'}"
        with _one_at_a_time(self.uri):
            self.client = MlflowClient(tracking_uri=self.uri)
            self._open(o, config, run_dir, tags, group, previous)

    def _open(self, o, config: dict, run_dir: Path, tags: dict, group: str,
              previous: dict | None) -> None:
        from mlflow.entities import Param
        if previous:
            self.id = previous["run_id"]
            self.client.update_run(self.id, status="RUNNING")
            return
        name = o.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "exatrain"
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            location = None
            if self.uri.startswith("sqlite:///"):  # artifacts beside the database, not in cwd
                database = Path(self.uri.removeprefix("sqlite:///"))
                location = (database.parent / "mlartifacts").as_uri()
            experiment_id = self.client.create_experiment(name, artifact_location=location)
        else:
            experiment_id = experiment.experiment_id
        user = dict(t.split("=", 1) if "=" in t else (t, "") for t in o.tags)
        all_tags = {f"exatrain.{k}": v for k, v in tags.items()}
        all_tags.update({"exatrain.run_dir": str(run_dir), **user})
        if group:
            all_tags["exatrain.group"] = group
        run = self.client.create_run(experiment_id, run_name=o.run_name or run_dir.name,
                                     tags=all_tags)
        self.id = run.info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.id, params=params[i:i + 100])

    def log(self, by_step: dict) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for step, values in by_step.items()
                   for key, value in values.items()]
        for i in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.id, metrics=metrics[i:i + self.BATCH])

    def finish(self, summary: dict | None, files: list[Path], run_dir: Path,
               end: Outcome) -> None:
        from mlflow.entities import Metric
        if summary is not None:
            now, step = int(time.time() * 1000), int(summary.get("steps") or 0)
            numbers = [Metric(self.key(f"summary/{k}"), float(v), now, step)
                       for k, v in scalar_summary(summary).items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)]
            for i in range(0, len(numbers), self.BATCH):
                self.client.log_batch(self.id, metrics=numbers[i:i + self.BATCH])
        for path in files:
            self.client.log_artifact(self.id, str(path))
        self.client.set_terminated(self.id, end.status)

    def state(self) -> dict:
        return {"run_id": self.id, "tracking_uri": self.uri}

    def held(self) -> dict[str, int]:
        """{metric: last step} of what the run holds in the store."""
        keys = self.client.get_run(self.id).data.metrics
        return {key: max((m.step for m in self.client.get_metric_history(self.id, key)), default=0)
                for key in keys}

    def info(self) -> dict:
        return {"run_id": self.id, "tracking_uri": self.uri}


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
                    run = _retry(lambda: MLflowRun(options, resolved, self.run_dir, tags, group,
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
                run = _wandb_segment(run_dir, state[name])
                (Path(run.dir) / folder).mkdir(exist_ok=True)
                for f in files:
                    shutil.copy2(f, Path(run.dir) / folder / Path(f).name)
                run.finish()
            done.append(name)
        except Exception as exc:
            report(f"exatrain: could not add the report to the {name} run ({type(exc).__name__}: "
                   f"{exc}); the report is in {Path(files[0]).parent if files else run_dir}.")
    return done


def _wandb_segment(run_dir: Path, state: dict):
    """A short resumed segment of the W&B run `state` (trackers.json) names, in `run_dir`."""
    import wandb
    return wandb.init(project=state.get("project"), entity=state.get("entity"), id=state["id"],
                      resume="allow", mode=state.get("mode", "offline"), dir=str(run_dir),
                      reinit="create_new", settings=wandb.Settings(
                          console="off", silent=True, save_code=False, disable_git=True))


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
                    _wandb_segment(here, state[name]).finish(exit_code=end.exit_code)
                done.append(f"{name}:{run_id}")
            except Exception as exc:
                report(f"exatrain: could not mark the {name} run of {here} {end.status} "
                       f"({type(exc).__name__}: {exc}); it may still show as running.")
    return done


def read_wandb_log(path: Path) -> list:
    """The records of a W&B run's `.wandb` log: W&B's 7-byte header, then LevelDB-log blocks of
    32 KiB whose chunks (4-byte CRC, 2-byte length, 1-byte kind: full, first, middle, last) hold
    W&B's `Record` protobuf messages. A record cut short (a killed writer) ends the list."""
    import struct

    from wandb.proto import wandb_internal_pb2
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run log")
    pos, block, parts, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:          # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0 or pos + 7 + length > len(data):
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                   # full, last: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def _new_id() -> str:
    """A W&B run id of the shape W&B makes: 8 lower-case letters and digits."""
    import secrets
    import string
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


@contextlib.contextmanager
def _one_at_a_time(uri: str):
    """A population's trainers open one store at once. For SQLite, one process at a time (a file
    lock beside the database): MLflow creates its tables on first use, and two processes doing
    so together leave one of them with a broken migration."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl
    database = Path(uri.removeprefix("sqlite:///"))
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(database.with_name(database.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _retry(make, tries: int = 3):
    """A population's trainers create one experiment at once on a server: a lost race (the name
    taken meanwhile) is tried again."""
    for attempt in range(tries):
        try:
            return make()
        except Exception:
            if attempt == tries - 1:
                raise
            time.sleep(0.2 + random.random())
