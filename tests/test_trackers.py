"""Weights & Biases (offline) and MLflow (SQLite store) beside TensorBoard, with the real libraries.

One tiny CosmoFlow run on one process serves the read-back tests: it is killed (SIGKILL) as step 5
starts, after its checkpoint of step 3 and its records of steps 1-4 went to both trackers
(MLflow's store has them; W&B's writer, which flushes every 15 s, had not written them when the
process died), and resumed to step 6. Both halves run as ranks forked from the local launcher's
server (a process that only imported torch and exatrain), so that step 4, trained by each, is
the same arithmetic whatever earlier tests left in pytest's process (thread count, oneDNN's
matmul precision). Its W&B run is read back from
W&B's own offline files (the runs' `.wandb` logs of W&B's `Record` protobuf messages) and its
MLflow run with `MlflowClient`; both must hold every number of metrics.jsonl at its step, once,
in one run id across the kill.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

from exatrain.launch.local import RankFailed, spawn  # noqa: E402
from exatrain.train.config import ConfigError, load_config  # noqa: E402
from exatrain.train.run import run_job  # noqa: E402

TRACKED = 'observe.trackers=["tensorboard", "wandb", "mlflow"]'
KILL_AT = 5


def _overrides(cosmo_data, out: Path, *extra) -> list[str]:
    from conftest import TINY
    return [*TINY, f"data.path={cosmo_data}", f"run.out_dir={out}", "train.steps=6",
            "train.eval_every=3", "train.checkpoint_every=3", "train.checkpoint_keep=3",
            "mlperf.enabled=true", *extra]


# ------------------------------------------------------------------ W&B's offline run files
def wandb_run(segment: Path) -> dict:
    """One offline run directory read back: its run record, history rows, final summary, files."""
    from exatrain.observe.tracker_wandb import read_wandb_log
    (log,) = segment.glob("run-*.wandb")
    run, history, summary = None, {}, {}
    for r in read_wandb_log(log):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in r.history.item}
            assert r.history.step.num not in history, f"step {r.history.step.num} twice"
            history[r.history.step.num] = row
        elif kind == "summary":
            for item in r.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return {"run": run, "history": history, "summary": summary,
            "files": {p.name for p in (segment / "files").iterdir()}}


def expected(run_dir: Path) -> dict[int, dict[str, float]]:
    """{step: {key: number}} of metrics.jsonl, spelt as the trackers log it."""
    out: dict[int, dict[str, float]] = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        step = record["step"]
        for key, value in record.items():
            if key == "step" or isinstance(value, str):
                continue
            if isinstance(value, dict):
                out.setdefault(step, {}).update({f"{key}/{k}": v for k, v in value.items()})
            elif isinstance(value, list):
                for i, loss in enumerate(value):
                    out.setdefault(step - len(value) + 1 + i, {})["step_loss"] = loss
            else:
                out.setdefault(step, {})[key] = float(value)
    return out


# steps 4 (logged before the kill, trained again after it): the trackers keep the first values;
# the curve's numbers are the same both times (a resumed run replays them), timings are not
REPLAYED = ("loss", "step_loss", "lr", "param_bytes", "grad_bytes", "optimizer_bytes")


def _same_numbers(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want)
    for step, values in want.items():
        assert set(values) <= set(got[step]), (step, set(values) - set(got[step]))
        for key, value in values.items():
            if step == KILL_AT - 1 and key not in REPLAYED:
                continue
            assert got[step][key] == pytest.approx(value, rel=1e-9), (step, key)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, cosmo_data):
    """A tracked run killed as step 5 starts and resumed to its end: (run_dir, summary, ids)."""
    out = tmp_path_factory.mktemp("trackers")
    overrides = _overrides(cosmo_data, out / "runs", TRACKED)
    config = load_config(None, overrides)
    with pytest.MonkeyPatch.context() as env:
        for key in ("WANDB_MODE", "MLFLOW_TRACKING_URI", "WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME",
                    "EXATRAIN_INJECT_FAULTS"):
            env.delenv(key, raising=False)
        env.setenv("WANDB_SILENT", "true")
        with pytest.raises(RankFailed, match="killed by SIGKILL"):
            spawn(run_job, 1, (config,), env={"EXATRAIN_INJECT_FAULTS": f"kill@0:{KILL_AT}"})
        (run_dir,) = (out / "runs").glob("cosmoflow-*")
        before = json.loads((run_dir / "trackers.json").read_text())
        (summary,) = spawn(run_job, 1, (config, str(run_dir)))
    return run_dir, summary, before


def test_wandb_offline_run_holds_metrics_config_summary_tags_and_files(tracked):
    run_dir, summary, before = tracked
    segments = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(segments) == 2                       # the killed start and the resumed one
    first, resumed = (wandb_run(s) for s in segments)
    run_id = before["wandb"]["id"]
    assert all(s.name.endswith(f"-{run_id}") for s in segments)
    assert resumed["run"].run_id == run_id == summary["trackers"]["wandb"]["run_id"]
    assert not set(first["history"]) & set(resumed["history"])   # no step twice
    _same_numbers({**first["history"], **resumed["history"]}, expected(run_dir))
    config = {item.key: json.loads(item.value_json) for item in resumed["run"].config.update}
    resolved = load_config(run_dir / "config.toml").to_dict()
    for section in ("run", "train", "observe", "model", "data"):
        assert config[section] == resolved[section], section
    tags = set(resumed["run"].tags)
    import torch

    from exatrain import __version__
    assert {"plan:" + summary["plan"], "world_size:1", f"exatrain:{__version__}",
            f"torch:{torch.__version__}", "device:cpu", "workload:cosmoflow"} <= tags
    assert resumed["summary"]["val_mae"] == pytest.approx(summary["val_mae"])
    assert resumed["summary"]["steps"] == 6
    assert {"mlperf.log", "summary.json", "config.toml"} <= resumed["files"]
    assert summary["trackers"]["wandb"]["sync"] == f"wandb sync {segments[1]}"


def test_mlflow_run_holds_params_metric_histories_artifacts_and_tags(tracked):
    from mlflow.tracking import MlflowClient
    run_dir, summary, before = tracked
    info = summary["trackers"]["mlflow"]
    assert info == {"run_id": before["mlflow"]["run_id"],
                    "tracking_uri": f"sqlite:///{run_dir.parent / 'mlflow.db'}"}
    client = MlflowClient(tracking_uri=info["tracking_uri"])
    run = client.get_run(info["run_id"])
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1   # resumed, not a second run
    resolved = load_config(run_dir / "config.toml").to_dict()
    assert run.data.params["train.steps"] == "6"
    assert run.data.params["observe.trackers"] == str(resolved["observe"]["trackers"])
    assert run.data.params["model.size"] == str(resolved["model"]["size"])
    assert len(run.data.params) > 100
    from exatrain.observe.tracker_mlflow import MLflowRun
    want = {step: {MLflowRun.key(k): v for k, v in values.items()}
            for step, values in expected(run_dir).items()}
    got: dict[int, dict] = {}
    for key in {k for values in want.values() for k in values}:
        history = client.get_metric_history(info["run_id"], key)
        steps = [m.step for m in history]
        assert len(steps) == len(set(steps)), f"{key}: a step twice {steps}"
        for m in history:
            got.setdefault(m.step, {})[key] = m.value
    _same_numbers(got, want)
    assert run.data.metrics["summary/val_mae"] == pytest.approx(summary["val_mae"])
    artifacts = {a.path for a in client.list_artifacts(info["run_id"])}
    assert {"mlperf.log", "summary.json", "config.toml"} <= artifacts
    tags = run.data.tags
    assert tags["exatrain.plan"] == summary["plan"] and tags["exatrain.world_size"] == "1"
    assert tags["exatrain.device"] == "cpu" and tags["exatrain.torch"]
    assert tags["exatrain.run_dir"] == str(run_dir)


def test_metric_names_mlflow_refuses_are_spelt_as_it_takes_them(tmp_path):
    """A world-size figure's axis is named like `trainer+pipe+data`: MLflow refuses `+`."""
    from mlflow.tracking import MlflowClient

    from exatrain.observe.options import ObserveOptions
    from exatrain.observe.tracker_mlflow import MLflowRun
    run = MLflowRun(ObserveOptions(), {"a": {"b": 1}}, tmp_path / "run", {}, "", None, tmp_path)
    run.log({7: {MLflowRun.key("bytes_per_step/trainer+pipe+data"): 4.0}})
    history = MlflowClient(run.uri).get_metric_history(run.id, "bytes_per_step/trainer_pipe_data")
    assert [(m.step, m.value) for m in history] == [(7, 4.0)]


def test_a_tracker_that_fails_during_the_run_is_reported_once_and_training_goes_on(
        cosmo_data, tmp_path, monkeypatch, capsys):
    from exatrain.observe import tracker_mlflow

    calls = []

    def disk_full(self, by_step):
        calls.append(min(by_step))
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tracker_mlflow.MLflowRun, "log", disk_full)
    config = load_config(None, _overrides(cosmo_data, tmp_path / "runs",
                                          'observe.trackers=["mlflow"]', "train.steps=3",
                                          "mlperf.enabled=false"))
    summary = run_job(config)
    assert summary["steps"] == 3 and calls == [1]
    assert "No space left on device" in summary["trackers"]["mlflow"]["failed"]
    err = capsys.readouterr().err
    assert err.count("the mlflow tracker failed") == 1 and "training goes on" in err
    assert len((Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()) == 4


def test_a_tracker_that_cannot_be_imported_is_refused_when_the_config_is_read(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'exatrain\[wandb\]'"):
        load_config(None, ['observe.trackers=["wandb"]'])
    load_config(None, ['observe.trackers=["mlflow"]'])          # the other one is there
    with pytest.raises(ConfigError, match="Did you mean 'mlflow'"):
        load_config(None, ['observe.trackers=["mlfow"]'])


def test_tracker_tables_in_toml_and_on_the_command_line(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[observe]\ntrackers = ["wandb"]\n[observe.wandb]\nproject = "cosmo"\n'
                    'tags = ["a"]\n[observe.mlflow]\nexperiment = "e"\n')
    config = load_config(path, ["observe.wandb.mode=online", "observe.mlflow.tags=['k=v']"])
    assert (config.observe.wandb.project, config.observe.wandb.mode) == ("cosmo", "online")
    assert config.observe.mlflow.tags == ["k=v"] and config.observe.mlflow.experiment == "e"
    with pytest.raises(ConfigError, match="unknown key observe.wandb.projet. Did you mean"):
        load_config(None, ["observe.wandb.projet=x"])
    with pytest.raises(ConfigError, match="observe.wandb.mode='offlin'"):
        load_config(None, ['observe.trackers=["wandb"]', "observe.wandb.mode=offlin"])


def test_report_pictures_join_the_tracked_runs(tracked):
    """Last: it adds a W&B segment (`exatrain report` after the run)."""
    from mlflow.tracking import MlflowClient

    from exatrain.observe.report import build_report
    run_dir, summary, _ = tracked
    made = build_report([run_dir])
    pictures = {p.name for p in made.values() if p.suffix == ".png"}
    assert "curves.png" in pictures
    info = summary["trackers"]["mlflow"]
    client = MlflowClient(tracking_uri=info["tracking_uri"])
    assert {Path(a.path).name for a in client.list_artifacts(info["run_id"], "report")} == \
        pictures | {"report.md"}
    last = sorted((run_dir / "wandb").glob("offline-run-*"))[-1]
    assert last.name.endswith(summary["trackers"]["wandb"]["run_id"])
    assert {p.name for p in (last / "files" / "report").iterdir()} == pictures | {"report.md"}


def test_a_population_tracks_one_run_per_trainer_grouped(cosmo_data, tmp_path):
    """Two trainers' rank 0 open one SQLite store at once: one MLflow run each, one group."""
    from mlflow.tracking import MlflowClient

    from harness import run_ranks
    config = load_config(None, _overrides(cosmo_data, tmp_path / "runs",
                                          'observe.trackers=["mlflow"]', "train.steps=2",
                                          "train.eval_every=2", "train.checkpoint_every=0",
                                          "mlperf.enabled=false", "plan.trainer=2",
                                          "population.interval=2"))
    summary = run_ranks(2, run_job, config)[0]
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(r.info.run_name for r in runs) == ["trainer_00", "trainer_01"]
    assert {r.data.tags["exatrain.group"] for r in runs} == {Path(summary["run_dir"]).name}
    assert {r.data.tags["exatrain.plan"] for r in runs} == {"Plan(trainer=2)"}
    assert sorted(r.data.tags["exatrain.trainer"] for r in runs) == ["0", "1"]
    for r in runs:
        assert [m.step for m in client.get_metric_history(r.info.run_id, "loss")] == [1, 2]


def _ends(run_dir: Path) -> list[tuple[int, bool]]:
    """(exit code, marked preempting) of each W&B run under `run_dir`, as its last segment (an
    offline run's `.wandb` log) records them in W&B's own records."""
    from exatrain.observe.tracker_wandb import read_wandb_log
    last: dict[str, Path] = {}
    for log in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        last[log.name] = log
    out = []
    for log in last.values():
        records = read_wandb_log(log)
        kinds = [r.WhichOneof("record_type") for r in records]
        (code,) = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
        out.append((code, "preempting" in kinds))
    return out


def test_a_failed_population_marks_every_trainers_run_failed(cosmo_data, tmp_path):
    """`exatrain run`'s supervisor, as a user's job runs: trainer 1 diverges (an infinite
    learning rate; no tournaments, so it stops the job) and marks its runs failed itself;
    trainer 0, which trained well, is stopped by the launcher while it waits for trainer 1 at
    the final exchange, and the supervisor marks its runs. Both MLflow runs read back FAILED,
    both W&B runs end with exit code 1."""
    from mlflow.tracking import MlflowClient

    from exatrain.launch.local import RankFailed
    from exatrain.train.resilience.restart import supervise
    config = load_config(None, _overrides(cosmo_data, tmp_path / "runs", TRACKED,
                                          "train.steps=3", "train.eval_every=3",
                                          "train.checkpoint_every=0", "mlperf.enabled=false",
                                          "plan.trainer=2", 'population.strategy="none"',
                                          "population.lr=[0.003, inf]", "train.num_workers=0"))
    with pytest.raises(RankFailed, match="NonFiniteLoss"):
        supervise(run_job, config, 2, None, 0, report=lambda _: None)
    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted((r.info.run_name, r.info.status) for r in runs) == \
        [("trainer_00", "FAILED"), ("trainer_01", "FAILED")]
    (job,) = (tmp_path / "runs").glob("cosmoflow-*")
    for trainer in ("trainer_00", "trainer_01"):
        assert _ends(job / trainer) == [(1, False)], trainer


def test_a_stop_by_signal_marks_the_runs_killed_and_preempting(cosmo_data, tmp_path,
                                                                monkeypatch):
    """SIGTERM (a scheduler's warning) as step 2 starts: the run checkpoints and stops; MLflow
    reads KILLED, W&B was told it is preempted and ended with exit code 128 + SIGTERM."""
    import signal

    from mlflow.tracking import MlflowClient
    monkeypatch.setenv("EXATRAIN_INJECT_FAULTS", "term@0:2")
    config = load_config(None, _overrides(cosmo_data, tmp_path / "runs", TRACKED,
                                          "mlperf.enabled=false"))
    summary = run_job(config)
    assert summary["stopped_by_signal"] and summary["steps"] == 2
    info = summary["trackers"]["mlflow"]
    assert MlflowClient(info["tracking_uri"]).get_run(info["run_id"]).info.status == "KILLED"
    assert _ends(Path(summary["run_dir"])) == [(128 + signal.SIGTERM, True)]
