"""MLflow: one tracked run per run directory (`MLflowRun`) in `observe.mlflow.tracking_uri`,
else MLFLOW_TRACKING_URI, else a SQLite database beside the runs; the config as parameters,
metrics in batches, the summary and the run's files at the end; a population's trainers open the
store one at a time (`one_at_a_time`, `retry`)."""

from __future__ import annotations

import contextlib
import os
import random
import re
import time
from pathlib import Path

from .tracker_records import Outcome, flatten, scalar_summary


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
        with one_at_a_time(self.uri):
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


@contextlib.contextmanager
def one_at_a_time(uri: str):
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


def retry(make, tries: int = 3):
    """A population's trainers create one experiment at once on a server: a lost race (the name
    taken meanwhile) is tried again."""
    for attempt in range(tries):
        try:
            return make()
        except Exception:
            if attempt == tries - 1:
                raise
            time.sleep(0.2 + random.random())
