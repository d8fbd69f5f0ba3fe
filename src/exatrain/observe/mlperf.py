"""MLPerf HPC logging: an `:::MLLOG` file (RUN_DIR/mlperf.log) written with `mlperf_logging.mllog`.

Rank 0 writes it. The structure the HPC ruleset (3.0.0) checks: submission keys, `cache_clear`,
`init_start`, `staging_start`/`staging_stop` (writing or staging the data set), `init_stop`,
`run_start`; then per evaluation interval a block (`block_start`/`block_stop` with
`first_epoch_num`, `epoch_count`), `eval_start`/`eval_stop` and the quality key (`eval_error` for
CosmoFlow: the validation MAE; `eval_accuracy` for DeepCAM: the mean IoU; `eval_error` for
OpenCatalyst, `oc20`, the catalysis workload: the force MAE); finally `run_stop` with
status "success" when `train.target` was reached, "aborted" otherwise. Epoch numbers are
fractional (step / steps per epoch) and start at 1, as the reference implementations count.

Time to train is `run_stop - run_start`, the figure MLPerf ranks by.

A resumed run (`exatrain run --resume RUN_DIR`, or a restart) continues the log it finds: the
checker accepts one `run_start` and one `run_stop` per log, so the first segment's keys up to
`run_start` stand, a `run_stop` written when an earlier segment stopped is taken back (the run did
not end there), and the resumed segment writes a `run_resumed` event (a key of exatrain's own, which
the checker passes over) and its blocks. Time to train then runs from the first `run_start`: the
time lost to the interruption counts, as it would on the clock MLPerf ranks by.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from mlperf_logging.mllog import constants as C
from mlperf_logging.mllog.mllog import MLLogger

# the validation figure MLPerf HPC judges each benchmark by: (mllog key, exatrain metric)
QUALITY = {"cosmoflow": ("eval_error", "val_mae"), "deepcam": (C.EVAL_ACCURACY, "val_mean_iou"),
           "oc20": ("eval_error", "val_forces_mae")}
# MLPerf HPC's name of a built-in workload's benchmark, where it is not the workload's name
BENCHMARK_OF_WORKLOAD = {"catalysis": "oc20"}


def benchmark_name(options, workload: str) -> str:
    """The `submission_benchmark` of a run: `mlperf.benchmark`, else the workload's MLPerf name."""
    return options.benchmark or BENCHMARK_OF_WORKLOAD.get(workload, workload)


PREFIX = ":::MLLOG "


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _key(line: str) -> str | None:
    """The key of one `:::MLLOG` line (None for any other line)."""
    if not line.startswith(PREFIX):
        return None
    try:
        return json.loads(line[len(PREFIX):]).get("key")
    except json.JSONDecodeError:
        return None  # a line cut short by a crash mid-write


def continue_log(path) -> float | None:
    """Prepare an earlier segment's log at `path` for a resumed run; returns its `run_start` (s
    since the epoch), or None when there is no run to continue (no file, or no `run_start` in it:
    then the file is emptied, as a fresh run's log starts).

    Trailing `run_stop` lines (and a line cut short by a crash) are removed: the run goes on."""
    path = Path(path)
    lines = path.read_text().splitlines() if path.exists() else []
    starts = [line for line in lines if _key(line) == C.RUN_START]
    if not starts:
        if lines:
            path.write_text("")
        return None
    while lines and _key(lines[-1]) in (C.RUN_STOP, None):
        lines.pop()
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(line + "\n" for line in lines))
    os.replace(partial, path)  # all or nothing: a crash here leaves the earlier log whole
    return json.loads(starts[0][len(PREFIX):])["time_ms"] / 1000


class MLPerfLog:
    """One run's MLPerf log; every call names its time explicitly, so phases can be back-dated."""

    def __init__(self, path, options, workload: str, nodes: int, accelerators_per_node: int):
        # a resumed run's log goes on from its earlier segment's (see the module docstring)
        self.run_start_s: float | None = continue_log(path)
        self.resumed = self.run_start_s is not None
        logger = logging.Logger(f"exatrain.mlperf.{path}")  # private: not the shared root logger
        handler = logging.FileHandler(path, mode="a")
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        self.handler = handler
        self.log = MLLogger(logger=logger, default_stack_offset=2)
        self.benchmark = benchmark_name(options, workload)
        self.quality = QUALITY.get(self.benchmark, ("eval_error", ""))
        self.options, self.nodes, self.per_node = options, nodes, accelerators_per_node
        self.block_first_epoch = 1.0

    def _event(self, key, value=None, metadata=None, at=None):
        self.log.event(key=key, value=value, metadata=metadata,
                       time_ms=_ms(at if at is not None else time.time()))

    def begin(self, setup_times: dict, hyper: dict) -> None:
        """Everything up to `run_start`: submission keys, init and staging phases, hyperparameters;
        for a resumed run, which has written them, a `run_resumed` event."""
        if self.resumed:
            self._event("run_resumed", True)
            return
        now = time.time()
        init_start = setup_times.get("init_start", now)
        o = self.options
        self._event(C.CACHE_CLEAR, True, at=init_start)
        self.log.start(key=C.INIT_START, time_ms=_ms(init_start))
        for key, value in ((C.SUBMISSION_BENCHMARK, self.benchmark), (C.SUBMISSION_ORG, o.organization),
                           (C.SUBMISSION_DIVISION, o.division), (C.SUBMISSION_STATUS, o.status),
                           (C.SUBMISSION_PLATFORM,
                            o.platform or f"{self.nodes}x{self.per_node}-rank node"),
                           ("number_of_nodes", self.nodes),
                           ("accelerators_per_node", self.per_node), *hyper.items()):
            self._event(key, value, at=init_start)
        if "staging_start" in setup_times:
            self.log.start(key=C.STAGING_START, time_ms=_ms(setup_times["staging_start"]))
            self.log.end(key=C.STAGING_STOP, time_ms=_ms(setup_times["staging_stop"]),
                         metadata={"staged_bytes": setup_times.get("staged_bytes", 0)})
        self.log.end(key=C.INIT_STOP, time_ms=_ms(now))
        self.run_start_s = time.time()
        self.log.start(key=C.RUN_START, time_ms=_ms(self.run_start_s))

    def block_start(self, epoch: float, epoch_count: float) -> None:
        self.block_first_epoch = epoch
        self.log.start(key=C.BLOCK_START, time_ms=_ms(time.time()),
                       metadata={"first_epoch_num": epoch, "epoch_count": epoch_count})

    def evaluation(self, epoch: float, metrics: dict, eval_start_s: float) -> None:
        self.log.end(key=C.BLOCK_STOP, time_ms=_ms(eval_start_s),
                     metadata={"first_epoch_num": self.block_first_epoch})
        self.log.start(key=C.EVAL_START, time_ms=_ms(eval_start_s), metadata={"epoch_num": epoch})
        key, metric = self.quality
        if metric in metrics:
            self._event(key, metrics[metric], metadata={"epoch_num": epoch})
        self.log.end(key=C.EVAL_STOP, time_ms=_ms(time.time()), metadata={"epoch_num": epoch})

    def end(self, reached: bool) -> float:
        """Write `run_stop`; returns the time to train in seconds."""
        stop = time.time()
        self.log.end(key=C.RUN_STOP, time_ms=_ms(stop),
                     metadata={"status": C.SUCCESS if reached else C.ABORTED})
        self.handler.close()
        return stop - (self.run_start_s or stop)
