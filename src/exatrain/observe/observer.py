"""What a run records about itself, step by step, beside metrics.jsonl.

The Trainer calls one `StepObserver` from a few places (phase ranges, step begin/end, each logged
record, each evaluation, the end of fit), so strategies and the training loop stay free of it. It
is given what it reads (config, mesh, run directory, workload, the run's length), never the
Trainer:

- exposed communication: the seconds this rank was blocked in `exatrain.comm` during the step (the
  ledger's `blocked_s`, see `comm.timing`), as `exposed_comm_s` (mean per step over the logging
  interval) and `exposed_comm_fraction` (of the step time) in every logged record;
- named ranges `phase.forward`, `phase.backward`, `phase.optimizer` (profiler + NVTX);
- `[observe] profile_steps = N` (`exatrain run --profile N`): a torch.profiler trace of N steps, after
  `profile_skip` steps and one warm-up step, written as Chrome/Perfetto JSON to
  RUN_DIR/profile/rank<R>.json on every rank (or the ranks in `profile_ranks`);
- TensorBoard event files in RUN_DIR/tensorboard (rank 0): every number of every metrics.jsonl
  record under its own key, `bytes_per_step/<axis>` for the per-axis bytes, and `step_loss` for
  each step's loss;
- `[observe] trackers` "wandb", "mlflow" (`observe.trackers`, rank 0): the same numbers at
  the same steps in a W&B run (offline by default) and an MLflow run, resumed with the run;
- `[mlperf] enabled`: the MLPerf HPC log (`observe.mlperf`), and `train.target`: stop when reached;
- bus bandwidth per mesh axis (`observe.bandwidth`): `busbw_GBps/<axis>` in every logged record, a
  drop below a fraction of the axis's own median reported once (`bandwidth_drops` in the summary,
  `bandwidth_drop/<axis>` in TensorBoard), and with `on_bandwidth_drop = "stop"` a clean stop.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

from ..comm import all_gather_object
from ..comm.timing import named_range
from .bandwidth import BandwidthWatch
from .memory_meters import peak_memory_bytes
from .target import Target
from .tracker_records import rows


class StepObserver:
    def __init__(self, config, mesh, run_dir, workload, steps_per_epoch: int, total_steps: int,
                 mfu_denominator, setup_times: dict | None = None, profiler=None):
        """`mfu_denominator`: () -> this device's `Peak` (MFU's denominator: a peak, or the
        measured matmul rate, measured when first asked);
        `setup_times`: the MLPerf set-up phases; `profiler`: one stepped after every step in
        place of `[observe] profile_steps`'s."""
        self.config, self.mesh, self.ledger, self.workload = config, mesh, mesh.ledger, workload
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.mfu_denominator = mfu_denominator
        self.options = config.observe
        self.setup_times = setup_times or {}
        self.run_dir = run_dir
        self.is_main = mesh.rank == 0
        self.target = Target.parse(config.train.target) if config.train.target else None
        self.reached_at: int | None = None
        self.time_to_train_s: float | None = None
        self._blocked0 = 0.0
        self._exposed: list[float] = []
        self.writer = self._tensorboard() if self.is_main and self.run_dir else None
        self.profiler = profiler if profiler is not None else self._profiler(mesh.rank)
        self.mlperf = None  # opened at fit_begin, once the launcher's figures are known
        self.trackers = None  # W&B, MLflow: started at fit_begin (after a resume), on rank 0
        self.bandwidth = BandwidthWatch(mesh, self.options, self.is_main) \
            if self.options.bandwidth_watch and mesh.world_size > 1 else None

    # ------------------------------------------------------------------ set-up
    def _tensorboard(self):
        if not self.options.tensorboard or "tensorboard" not in self.options.trackers:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(f"observe.tensorboard = true needs the tensorboard package ({exc}); "
                              "pip install tensorboard, or set observe.tensorboard = false.") from None
        return SummaryWriter(str(self.run_dir / "tensorboard"))

    def _profiler(self, rank: int):
        o = self.options
        if o.profile_steps <= 0 or not self.run_dir or (o.profile_ranks and rank not in o.profile_ranks):
            return None
        out = Path(self.run_dir) / "profile"
        out.mkdir(exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and self.mesh.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)

        def write(prof) -> None:
            prof.export_chrome_trace(str(out / f"rank{rank}.json"))

        profiler = torch.profiler.profile(
            activities=activities, record_shapes=False, with_stack=False,
            schedule=torch.profiler.schedule(wait=o.profile_skip, warmup=1,
                                             active=o.profile_steps, repeat=1),
            on_trace_ready=write)
        profiler.start()
        return profiler

    # ------------------------------------------------------------------ called by the Trainer
    def phase(self, name: str):
        """A named range around one phase of the step (forward, backward, optimizer)."""
        return named_range(f"phase.{name}")

    def fit_begin(self, step: int, peak_lr: float) -> None:
        """`fit` begins at `step` (0-based; a resumed run's later) with peak learning rate
        `peak_lr`."""
        c, w = self.config, self.workload
        if self.is_main and self.run_dir and self.trackers is None and \
                {"wandb", "mlflow"} & set(self.options.trackers):
            from .trackers import Trackers
            self.trackers = Trackers(c, self.mesh, self.run_dir)
        if c.mlperf.enabled and self.is_main and self.run_dir and self.mlperf is None:
            from .mlperf import MLPerfLog
            world = self.mesh.world_size
            # this model instance's size: a population's trainer is smaller than its node
            per_node = min(world, c.mlperf.accelerators_per_node or
                           int(self.setup_times.get("local_world_size") or world))
            self.mlperf = MLPerfLog(self.run_dir / "mlperf.log", c.mlperf, c.run.workload,
                                    -(-world // per_node), per_node)
            hyper = {"global_batch_size": c.train.batch_size, "gradient_accumulation_frequency":
                     c.train.grad_accum, "train_samples": len(w.train_set),
                     "eval_samples": len(w.val_set), "seed": c.run.seed,
                     "opt_name": c.optim.name, "opt_base_learning_rate": peak_lr,
                     "opt_learning_rate_warmup_steps": c.schedule.warmup_steps}
            self.mlperf.begin(self.setup_times, hyper)
            self.mlperf.block_start(self.epoch(step), self._epochs_per_block(step))

    def step_begin(self) -> None:
        self._blocked0 = self.ledger.blocked_total()
        self.ledger.drain_async_tail()  # spans of what ran between steps (evaluation) do not count
        if self.bandwidth:
            self.bandwidth.step_begin()

    def step_end(self, read_point: bool = True) -> None:
        """After a step; `read_point`: the Trainer reads the device after this step, so the
        bandwidth watch may agree across ranks now."""
        self._exposed.append(self.ledger.blocked_total() - self._blocked0
                             + self.ledger.drain_async_tail())
        if self.profiler:
            self.profiler.step()
        sys.audit("exatrain.step_end", self.ledger.step)  # marks start-up's end (observe.startup)
        for drop in self.bandwidth.step_end(self.ledger.step, read_point) \
                if self.bandwidth else ():
            if self.writer:
                self.writer.add_scalar(f"bandwidth_drop/{drop['axis']}", drop["busbw_GBps"],
                                       drop["step"])
                self.writer.flush()

    @property
    def stop_requested(self) -> bool:
        """True on every rank once a bandwidth drop under `on_bandwidth_drop = "stop"` is agreed."""
        return bool(self.bandwidth and self.bandwidth.stop_requested)

    def annotate(self, record: dict) -> None:
        """Add the interval's exposed communication, bus bandwidth and MFU to a training record
        (before it is written)."""
        if self._exposed and "step_s" in record:
            exposed = sum(self._exposed) / len(self._exposed)
            mean_step = record["samples_per_s"] and \
                self.config.train.batch_size / record["samples_per_s"]
            record["exposed_comm_s"] = exposed
            record["exposed_comm_fraction"] = exposed / mean_step if mean_step else math.nan
            self._exposed = []
        if self.bandwidth and self.bandwidth.last:
            record["busbw_GBps"] = {a: f["busbw"] / 1e9 for a, f in self.bandwidth.last.items()}
        flops = self.workload.flops_per_sample
        if flops and "samples_per_s" in record and "mfu" not in record:
            record["mfu"] = flops * record["samples_per_s"] / self.mfu_denominator().flops / \
                self.mesh.world_size

    def written(self, record: dict) -> None:
        """A record went to metrics.jsonl: the same numbers go to TensorBoard and the trackers."""
        if self.trackers:
            self.trackers.log(record)
        if not self.writer:
            return
        for step, values in rows(record).items():
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def epoch(self, step: int) -> float:
        """The (1-based, fractional) epoch of the step after `step` (steps done), as MLPerf
        counts."""
        return 1 + step / self.steps_per_epoch

    def _epochs_per_block(self, step: int) -> float:
        every = self.config.train.eval_every or self.total_steps
        return max(1, min(every, self.total_steps - step)) / self.steps_per_epoch

    def evaluated(self, metrics: dict, eval_start_s: float, step: int) -> bool:
        """After an evaluation at `step` (steps done): MLPerf records; True when `train.target`
        is reached (stop now)."""
        reached = bool(self.target and self.target.reached(metrics))
        if self.mlperf:
            self.mlperf.evaluation(self.epoch(step), metrics, eval_start_s)
            if not reached and step < self.total_steps:
                self.mlperf.block_start(self.epoch(step), self._epochs_per_block(step))
        if reached and self.reached_at is None:
            self.reached_at = step
        return reached

    def summary(self, fit_start_s: float, memory: dict) -> dict:
        """Figures for the run summary (`memory`: this rank's memory figures); closes the log,
        the writer and the profiler."""
        out: dict = {"memory_per_rank": self._memory_per_rank(memory)}
        if self.bandwidth:
            out["bandwidth_drops"] = self.bandwidth.drops
        if self.target:
            out["target"] = str(self.target)
            out["target_reached"] = self.reached_at is not None
            if self.reached_at is not None:
                out["target_reached_step"] = self.reached_at
        if self.mlperf:
            self.time_to_train_s = self.mlperf.end(self.reached_at is not None)
        elif self.reached_at is not None:
            self.time_to_train_s = time.perf_counter() - fit_start_s
        if self.time_to_train_s is not None and self.reached_at is not None:
            out["time_to_train_s"] = self.time_to_train_s
        if self.trackers:
            out["trackers"] = self.trackers.info()  # run ids; `wandb sync DIR` for offline runs
        self.close()
        return out

    def _memory_per_rank(self, figures: dict) -> list[dict]:
        """Every rank's state and peak bytes (one small all-gather at the end of fit)."""
        mine = {"rank": self.mesh.rank, "state_bytes": figures.get("state_bytes"),
                "peak_activation_bytes": figures.get("peak_activation_bytes"),
                "peak_mem_bytes": peak_memory_bytes(self.mesh.device)[0]}
        return all_gather_object(mine, self.mesh.world)

    def finished(self, summary: dict | None, failure: BaseException | None = None,
                 stop_signum: int | None = None) -> None:
        """The job's end, called by its owner (run_job, the population's run, et.fit): with its
        summary once summary.json is written, or with the exception it failed of. The trackers
        get the summary and the run's pictures and logs, and end their runs as finished, failed
        or killed (`tracker_records.outcome`; `stop_signum`: the signal this rank stopped on)."""
        if self.trackers:
            from .tracker_records import outcome
            self.trackers.finish(summary, outcome(summary, failure, stop_signum))
            self.trackers = None

    def close(self) -> None:
        if self.profiler:
            self.profiler.stop()
            self.profiler = None
        if self.writer:
            self.writer.close()
            self.writer = None
