"""What outlives a rank's process: the run directory it resumes from, and its failure record.

`stable_run_dir`: EXATRAIN_RUN_DIR when set (`exatrain run --max-restarts N` sets it for its ranks,
a batch script may set it so a requeued job continues), else under torchelastic
RUN_OUT_DIR/NAME-<TORCHELASTIC_RUN_ID> (the run id is the same for every restart of one
`torchrun` job), else None: a new timestamped directory per run.

`record_failure`: a rank that fails writes `error_rank<R>.log` (its traceback) into the run
directory, and when a collective timed out also its flight record (`comm.flight`).
`cleanup_failed_start`: a run that failed before its first step leaves no empty run directory.
"""

from __future__ import annotations

import os
import shutil
import traceback
from pathlib import Path

from ...comm.flight import diagnose, write_record

RUN_DIR_ENV = "EXATRAIN_RUN_DIR"


def stable_run_dir(config) -> Path | None:
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return Path(config.run.out_dir) / f"{config.run.name or config.run.workload}-{run_id}"
    return None


def _timed_out(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return "timed out" in text or "timeout" in text


def record_failure(run_dir: Path | None, rank: int, ledger, steps_done: int,
                   exc: BaseException) -> None:
    """Rank `rank` failed with `exc` after `steps_done` steps: its traceback (and, when a
    collective timed out, the flight record of `ledger`) into `run_dir`."""
    if run_dir is None or not run_dir.is_dir():
        return
    if _timed_out(exc):
        write_record(run_dir, rank, ledger,
                     f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not a failure to log
        return
    (run_dir / f"error_rank{rank}.log").write_text(
        f"rank {rank} failed at step {steps_done + 1}:\n"
        + "".join(traceback.format_exception(exc)))


def cleanup_failed_start(run_dir: Path | None, rank: int, steps_done: int, resumed: bool) -> None:
    """Rank 0 removes a run directory it created when the run failed before its first step."""
    if resumed or steps_done > 0 or rank != 0 or run_dir is None:
        return
    if os.environ.get(RUN_DIR_ENV) or not run_dir.is_dir():
        return  # a directory the launcher named stays: its restarts and logs live there
    if not any((run_dir / "checkpoints").glob("step_*")):
        shutil.rmtree(run_dir, ignore_errors=True)


def planned_run_dir(config) -> Path:
    """A fresh run directory's path (not created: rank 0 creates it when the run starts)."""
    from ..job import fresh_run_dir
    return fresh_run_dir(config)


def supervise(run_job, config, nproc: int, resume_dir: str | None, max_restarts: int,
              report=print) -> dict:
    """Spawn `nproc` local ranks; when one dies, start them all again (up to `max_restarts`
    times), resuming from the last complete checkpoint. Returns rank 0's summary, which
    holds `restarts`, `restart_history` and `lost_steps` (the ranks are given the history). The
    final failure is rank failure of the rank that failed first, with
    `.diagnosis` (the flight records' verdict when a collective hung)."""
    from ...errors import is_user_error
    from ...launch.local import RankFailed, spawn
    from ..checkpoints import checkpoint

    run_dir = Path(resume_dir) if resume_dir else planned_run_dir(config)
    env = {RUN_DIR_ENV: str(run_dir)}
    history: list[dict] = []  # per restart: the last step logged, the step resumed from
    while True:
        try:
            # the ranks put the restarts into the summary they write (summary.json, trackers)
            return spawn(run_job, nproc, args=(config, None, history), env=env)[0]
        except RankFailed as exc:
            exc.diagnosis = diagnose(run_dir, nproc) if run_dir.is_dir() else None
            restarts = len(history)
            if exc.diagnosis or restarts >= max_restarts or \
                    is_user_error(getattr(exc, "original", None)):
                _end_tracked_runs(run_dir)
                # a population's trainers log in trainer_KK/: their steps count as the run's
                stepped = any(run_dir.glob("metrics.jsonl")) or \
                    any(run_dir.glob("trainer_*/metrics.jsonl"))
                if run_dir.is_dir() and not resume_dir and checkpoint.latest(run_dir) is None \
                        and not stepped and exc.diagnosis is None:
                    shutil.rmtree(run_dir, ignore_errors=True)  # failed before its first step
                exc.restarts = restarts
                raise
            restarts += 1
            last = checkpoint.latest(run_dir)
            history.append({"failed_after_step": checkpoint.last_logged_step(run_dir),
                            "resumed_from_step": int(last.name.removeprefix("step_")) if last else 0,
                            "failure": str(exc).splitlines()[0]})
            if last is None and (run_dir / "metrics.jsonl").exists():
                (run_dir / "metrics.jsonl").unlink()  # starting over: its lines are written again
            report(f"exatrain: {str(exc).splitlines()[0]}; restart {restarts} of {max_restarts} "
                   f"from {last or 'the beginning'}")


def _end_tracked_runs(run_dir: Path) -> None:
    """The job failed for good: its tracked runs that no rank ended (a rank killed, or stopped
    by the launcher while it waited for the one that failed) are marked failed too."""
    if any(run_dir.glob("trackers.json")) or any(run_dir.glob("trainer_*/trackers.json")):
        from ...observe.tracker_records import Outcome
        from ...observe.trackers import end_open_runs
        end_open_runs(run_dir, Outcome("FAILED", 1))
