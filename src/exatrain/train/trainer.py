"""The Trainer: the training loop around one step, read top to bottom in `fit` and `_after_step`.

Each step (`train.step.TrainStep`: micro-batches, unscale, the finiteness verdict, the optimizer
step) is followed by what the config asks of it: a read of the device's values, a log record, an
evaluation, the hooks' turn (a population's tournaments), a stop agreement and a checkpoint. The
pieces live beside it under train/: the sample order (`sampling`), the step (`step`), evaluation
(`evaluation`), the records, throughput and memory figures (`records`), and the policies
(`resilience`: non-finite steps, bad samples, stop signals, faults, the watchdog, replica groups).

Determinism: the model is initialised from `run.seed` identically on every rank; the sample order
of epoch e is a permutation seeded by (seed, e); and the random state of each step (dropout) is
reseeded from (seed, step, rank). So a run's loss curve depends only on seed and Plan, and a
resumed run continues exactly where the checkpoint left it without storing RNG state.

Batches: the global batch of step s is samples perm[s·B : (s+1)·B]; data replica r takes the r-th
of R equal slices and splits it into `grad_accum` micro-batches. The replicas are the ranks of
`data` × `shard` (sharded data parallelism splits the batch too). With R = 1 the same samples form
the same step, which is what makes data-parallel training equal serial training.

Precision (`parallel.precision`, see `parallel.precision`): the forward pass runs under autocast in
the compute dtype, the loss in fp32 on `output.float()`, and with fp16 the loss is scaled; a step
whose gradients overflow is skipped and counted (`skipped_steps`).

The host never waits for the device between read points (log, evaluation and checkpoint steps,
every `STOP_CHECK_EVERY` steps with several ranks, the last step): a step leaves its loss, its
global gradient norm and its non-finite verdict on the device (`observe.step_meters`), its times
as CUDA events, and a non-finite step is skipped by the optimizer's own kernel (`found_inf`, as
`torch.amp.GradScaler` does; fp16's loss scale is updated on the device too). A read point reads
them all with one copy. What the run reports is what every step measured: per-interval medians,
every step's loss in `step_losses`, a `NonFiniteLoss` naming the step. Optimizers without a
device-side skip (K-FAC, foreach and for-loop kernels, FSDP2's DTensors),
`train.on_nonfinite = "skip"` and hooks that handle a non-finite step themselves read the verdict
every step instead (`defers_verdict`).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

from ..data.loader import loader_workers
from ..mesh import Mesh
from ..parallel.compile_stats import CompileCounter
from ..parallel.options import cuda_graphs_refusal, graph_scope
from ..workloads.base import Workload
from .checkpoints import checkpoint
from ..optim.factory import optimizer_for, supports_found_inf
from .config import Config, ConfigError, micro_batch_size
from .evaluation import Evaluation
from .hooks import RunHooks
from ..observe.memory_meters import StepPeak
from ..observe.observer import StepObserver
from ..observe.step_meters import PendingSteps
from ..parallel.precision import Precision, keep_norms_fp32
from .records import Interval, Records
from .sampling import Sampling, device_decode
from ..optim.schedule import scaled_lr
from .step import LrSchedule, StepResult, TrainStep, process_settings
from .step_graph import CudaGraphCapture, WholeStepGraph
from .resilience.faults import FaultInjector
from .resilience.policies import (NonFiniteLoss, NonfiniteSkips, SkipBadSamples, nonfinite_error,
                                  out_of_memory_advice)
from .resilience.stop import StopOnSignal
from .resilience.watchdog import Watchdog


STOP_CHECK_EVERY = 5  # steps between a multi-rank run's stop agreements (besides log steps); the
                      # bandwidth watch agrees at these read points too (its check_every: 5)


class Trainer:
    def __init__(self, mesh: Mesh, workload: Workload, config: Config, model: nn.Module,
                 run_dir: Path | None = None, console=None, *, setup_times: dict | None = None,
                 stage_figures: dict | None = None, job_figures: dict | None = None,
                 profiler=None):
        """`setup_times`: the MLPerf set-up phases (job.build); `stage_figures`: staging's, when
        the input was staged; `job_figures`: what started the ranks and how often (launcher,
        requeues, restarts), in summary.json and the trackers' summary alike; `profiler`: a
        profiler stepped after every step instead of `[observe] profile_steps`'s."""
        self.mesh, self.workload, self.config = mesh, workload, config
        self.model = model
        self.run_dir = Path(run_dir) if run_dir else None
        self.console = console
        self.is_main = mesh.rank == 0
        self.stage_figures, self.job_figures = stage_figures or {}, job_figures or {}
        t = config.train
        # the batch is split over data replicas and over the ranks of a sharded group
        self.data_axis = mesh.axis("data", "shard") if mesh.plan.shard > 1 else mesh.axis("data")
        self.replicas = self.data_axis.size
        # [fault_tolerance]: this group's side of the replica axis (None when off); the batch is
        # then split over every group's replicas (its `sample_axis`), not only this group's
        self.replica_groups = None
        sample_axis = self.data_axis
        if config.fault_tolerance.enabled:
            from .resilience.replicas import ReplicaGroups
            self.replica_groups = ReplicaGroups(config, mesh, self.data_axis)
            sample_axis = self.replica_groups.sample_axis
        self.micro = micro_batch_size(config, sample_axis.size)
        if t.on_bad_sample == "skip":
            workload.train_set = SkipBadSamples(workload.train_set, self.run_dir, mesh.rank)
        # loader workers per rank: train.num_workers, or (-1) from the cores the node's ranks share
        self.num_workers = loader_workers(t.num_workers)
        self.sampling = Sampling(config, mesh, sample_axis, workload.train_set, self.micro,
                                 self.num_workers, workload.collate_fn)
        self.steps_per_epoch = self.sampling.steps_per_epoch
        if len(workload.val_set) < self.replicas:
            raise ConfigError(
                f"the validation set has {len(workload.val_set)} samples, fewer than "
                f"the {self.replicas} data replicas; every replica needs at least one.")
        self.total_steps = t.steps or t.epochs * self.steps_per_epoch
        s = config.schedule
        self.schedule = LrSchedule(scaled_lr(config.optim.lr, t.batch_size, s.base_batch_size,
                                             s.lr_scaling), self.total_steps, s)
        # K-FAC: preconditioning in front of the first-order update
        self.optimizer = optimizer_for(model, config.optim, self.schedule.peak_lr, mesh,
                                       config.train.grad_accum)
        refusal = cuda_graphs_refusal(mesh.plan, config.parallel, mesh.device.type,
                                      config.optim.name)
        if refusal:
            raise ConfigError(refusal)
        # each forward begins a new iteration of the CUDA graphs (parallel.cuda_graphs): the
        # previous one's outputs may then be overwritten, which the step has consumed by then
        graphs = graph_scope(config.parallel)
        new_graph_iteration = (torch.compiler.cudagraph_mark_step_begin
                               if graphs == "compiled" else lambda: None)
        self.precision = Precision(config.parallel.precision, mesh.device)
        if self.precision.mixed:
            keep_norms_fp32(model)
        self.scaler = self.precision.loss_scaler(mesh.device)
        self.step_peak = StepPeak(mesh.device)
        self.records = Records(config, mesh, workload, model, self.precision, self.step_peak,
                               self.num_workers, self.run_dir)
        # exposed comm, ranges, profile, TensorBoard, MLPerf
        self.observer = StepObserver(config, mesh, self.run_dir, workload, self.steps_per_epoch,
                                     self.total_steps, lambda: self.records.mfu_denominator,
                                     setup_times=setup_times, profiler=profiler)
        self.decode = device_decode(workload, model)
        self.nonfinite_skips = NonfiniteSkips(t.on_nonfinite, t.max_nonfinite_skips,
                                              self.is_main)
        self.train_step = TrainStep(model, self.optimizer, workload, t, mesh,
                                    self.precision, self.scaler, self.observer.phase,
                                    new_graph_iteration, self.nonfinite_skips,
                                    self._nonfinite_error, config.run.seed,
                                    replicas=self.replica_groups,
                                    seed_rank=self.replica_groups.seed_rank
                                    if self.replica_groups else None,
                                    autocast_cache=graphs != "step")
        if graphs == "step":  # the whole step as one CUDA graph (train.step_graph)
            self.train_step = WholeStepGraph(self.train_step, CudaGraphCapture(mesh.device),
                                             self.config.train.grad_accum)
        self._evaluate = Evaluation(mesh, workload, model, self.data_axis, self.micro,
                                    self.num_workers, self.precision, self.decode,
                                    new_graph_iteration)
        self.hooks = RunHooks()
        # (the job's rank: under [fault_tolerance] group k's ranks follow group k-1's)
        self.faults = FaultInjector(self.train_step.rank, self.run_dir)
        self.checkpoint_writer = checkpoint.Writer(config.train.checkpoint_async)
        self.checkpoint_group = mesh.group  # who writes a checkpoint: the job, or one trainer
        self.compile_counter: CompileCounter | None = None  # set by fit under parallel.compile
        self._run_times: dict[str, list] = {"times": [], "waits": [], "bytes": []}
        self._track_step = 0             # which step the CPU peak tracker watches (see fit)
        self.last_state_bytes: dict = {}  # the model state's bytes at the last measured step
        self.last_step: StepResult | None = None  # the last step's values (on the device)
        self.stopped_early = False       # by a stop signal or a bandwidth drop (on every rank)
        self.stop_signum: int | None = None  # the signal, when this rank received it itself
        self.validation_s = 0.0          # seconds in validation passes since fit began
        self.step = 0
        self.history: list[dict] = []
        self.input_bytes = 0  # training input delivered to this rank's device (data.loader)

    def compose(self, hooks: RunHooks) -> None:
        """Run `hooks` (e.g. a population member's tournaments) at their points of the loop."""
        self.hooks = hooks

    # ------------------------------------------------------------------ what others read
    @property
    def peak_lr(self) -> float:
        return self.schedule.peak_lr

    @property
    def nonfinite_skipped(self) -> int:
        """Steps skipped under train.on_nonfinite = "skip"."""
        return self.nonfinite_skips.skipped

    @property
    def defers_verdict(self) -> bool:
        """True when the step decides on non-finite gradients on the device (see train.step):
        the optimizer's kernel can skip a step by itself (torch's fused optimizers), the
        non-finite policy is "stop" and no hook handles a non-finite step itself. Otherwise the
        verdict is read every step: K-FAC, foreach and for-loop optimizers, DTensor (FSDP2)
        parameters, `on_nonfinite = "skip"`, a population's tournaments."""
        return supports_found_inf(self.optimizer) and self.config.train.on_nonfinite == "stop" \
            and not self.hooks.handles_nonfinite

    @property
    def step_times(self) -> list[float]:
        """Seconds of every step of the last `fit` read so far (device time on a GPU)."""
        return list(self._run_times["times"])

    @property
    def step_waits(self) -> list[float]:
        """Seconds every step of the last `fit` waited for its input."""
        return list(self._run_times["waits"])

    @property
    def skipped_steps(self) -> int:
        """fp16 steps skipped for overflowing gradients (reads the device)."""
        return self.scaler.skipped_steps if self.scaler.enabled else 0

    def evaluate(self, dataset=None) -> dict[str, float]:
        """The workload's metrics on the validation set (or on `dataset`, e.g. a tournament set)."""
        if dataset is not None:
            return self._evaluate(dataset)
        start = time.perf_counter()
        try:
            return self._evaluate(self.workload.val_set)
        finally:
            self.validation_s += time.perf_counter() - start

    def log(self, record: dict) -> None:
        """Write `record` (with the hooks' fields) to metrics.jsonl and the observer's sinks."""
        record = {**record, **self.hooks.record_fields(self.validation_s)}
        self.history.append(record)
        if self.is_main and self.run_dir:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        self.observer.written(record)

    def finished(self, summary: dict | None, failure: BaseException | None = None) -> None:
        """The job's end, told by its owner (see `StepObserver.finished`)."""
        self.observer.finished(summary, failure, self.stop_signum)

    def add_job_figures(self, figures: dict) -> None:
        """Figures of how the job started that are known only once the Trainer is built and
        resumed (an elastic formation's re-formations, `resilience.elastic`): in the summary."""
        self.job_figures = {**self.job_figures, **figures}

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        # the second step: the first one also allocates what persists (communication buckets,
        # FSDP2's lazy initialisation), which is not activation memory
        self._track_step = self.step + (1 if self.total_steps - self.step > 1 else 0)
        self.hooks.fit_begin()
        self.validation_s = 0.0
        self._finished = False
        compiled = self.config.parallel.compile or self.workload.compile   # (the user's own)
        self.compile_counter = CompileCounter() if compiled else None
        batches = self.sampling.batches(self.step, self.decode)
        pending = PendingSteps(self.mesh.device)
        self._interval = Interval(self.mesh.ledger.snapshot())
        self._run_times = {"times": [], "waits": [], "bytes": []}
        start = time.perf_counter()
        eval_metrics: dict[str, float] = {}
        progress = self.console.progress(self.total_steps, self.step) if self.console else None
        self.observer.fit_begin(self.step, self.schedule.peak_lr)
        stop = StopOnSignal().install()
        watchdog = Watchdog(self.mesh.ledger, self.mesh.rank, self.run_dir,
                            self.config.run.timeout_s).start(self.mesh.world_size)
        if self.replica_groups:  # [fault_tolerance]: join the other groups, last before stepping
            self.replica_groups.start(self.model, self.optimizer, self.scaler,
                                      self.nonfinite_skips, self.schedule, lambda: self.step,
                                      self.sampling, self.decode)
        try:
            with process_settings(self.mesh.device, self.config.parallel.cudnn_benchmark):
                while self.step < self.total_steps and not self._finished:
                    if self._one_step(batches, pending, watchdog, progress):
                        # healed from a replica group: the samples go on from the new step
                        batches.close()
                        batches = self.sampling.batches(self.step, self.decode)
                    eval_metrics = self._after_step(pending, stop, watchdog, progress) \
                        or eval_metrics
            self.checkpoint_writer.wait()
        finally:  # a failed step must not leave a live progress bar or loader workers
            stop.restore()
            watchdog.stop()
            if progress:
                progress.close()
            batches.close()
            self.observer.close()  # the profile trace and event files of what ran
            if self.replica_groups:
                self.replica_groups.close()
        if not eval_metrics and not self.stopped_early:
            eval_metrics = self.evaluate()
        return self._summary(eval_metrics, time.perf_counter() - start, start)

    def _one_step(self, batches, pending: PendingSteps, watchdog, progress) -> bool:
        """Step `self.step + 1`, its values left pending on the device (read at read points).
        True when the step healed from a replica group (the step number jumped)."""
        self.mesh.ledger.step = self.step + 1  # the step number metrics.jsonl will give it
        self.faults.at_step(self.step + 1)
        watchdog.beat()
        self.observer.step_begin()
        self._read_now = self._is_read_point(self.step + 1, self.step + 1 == self.total_steps)
        # CUDA: the allocator's peak, every step for free; CPU: the tracker, one step per fit
        watch = self.mesh.device.type == "cuda" or self.step == self._track_step
        self._lr = self.schedule.lr(self.step)
        pending.clock.begin()
        try:
            result = self.train_step(batches, self.step, self._lr, self.defers_verdict,
                                     measure=self._read_now,
                                     peak=self.step_peak.track() if watch
                                     else contextlib.nullcontext())
        except torch.OutOfMemoryError as exc:
            raise torch.OutOfMemoryError(out_of_memory_advice(
                self.mesh.plan, self.config.parallel, self.config.train, self.micro,
                self.mesh.rank, self.step + 1, self.last_state_bytes.get("total"), exc)) from exc
        except NonFiniteLoss:
            if not self.hooks.handles_nonfinite:
                raise
            result = self._diverged()
        pending.clock.end()
        self.last_step = result
        if result.state_bytes is not None:
            self.last_state_bytes = result.state_bytes
        pending.add(result.loss, result.grad_norm, result.found_inf)
        wait, nbytes = batches.take()  # this step's input wait (host seconds) and bytes
        self.observer.step_end(self._read_now)
        if result.healed_to is not None:  # [fault_tolerance]: a peer's step N was applied here
            self.step = result.healed_to
            self._lr = self.schedule.lr(self.step)  # the rate the heal set, as logged
        self.step += 1
        self._interval.waits.append(wait)
        self._run_times["waits"].append(wait)
        self._run_times["bytes"].append(nbytes)
        self.input_bytes += nbytes
        if progress:
            progress.advance()
        return result.healed_to is not None

    def _after_step(self, pending: PendingSteps, stop, watchdog, progress) -> dict | None:
        """What follows a step: read, log, evaluate, the hooks, stop, checkpoint. Returns the
        evaluation's metrics when it evaluated; sets `_finished` when the run ends early."""
        t, last = self.config.train, self.step == self.total_steps  # (a heal may jump to it)
        read = self._read_now or last
        if read:
            self._read(pending)
        if self.step % t.log_every == 0 or last:
            record = self._training_record(self._lr)
            self.observer.annotate(record)
            self.log(record)
            if progress:
                progress.log(record)
        eval_metrics, reached = None, False
        if (t.eval_every and self.step % t.eval_every == 0) or last:
            eval_start = time.time()
            with watchdog.paused():  # long and collective-free under plain data parallelism
                eval_metrics = self.evaluate()
            self.log({"step": self.step, **eval_metrics})
            if progress:
                progress.log({"step": self.step, **eval_metrics})
            reached = self.observer.evaluated(eval_metrics, eval_start, self.step)  # train.target
        done = self.hooks.after_step(self.step, self.history)  # e.g. a population's tournament
        # one rank decides alone; several agree (a collective) at read points only
        check = self.mesh.world_size == 1 or read
        stopping = not last and not reached and check and (stop.agreed(self.mesh)
                                                          or self.observer.stop_requested)
        if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or last or reached \
                or stopping:
            self._read(pending)  # a step not yet read could be the non-finite one
            with watchdog.paused():  # file system time; the backend's timeout still holds
                self._save()
        if stopping:
            self.stopped_early, self.stop_signum = True, stop.signum
            if self.is_main:
                stop.announce(self.step, self.total_steps, self.run_dir,
                              bandwidth_drop=self.observer.stop_requested)
        self._finished = reached or stopping or done
        return eval_metrics

    def _diverged(self) -> StepResult:
        """A non-finite step the hooks handle (a population member's model diverged): no update,
        a NaN loss, counted by the hooks."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self.hooks.diverged()
        return StepResult(torch.tensor(math.nan), None, torch.ones((), device=self.mesh.device))

    def _is_read_point(self, step: int, last: bool) -> bool:
        """Whether the device's values are read after `step` (1-based): log, evaluation,
        checkpoint and (with several ranks) stop-check steps, and the last. The same on every
        rank: the config decides."""
        t = self.config.train
        return last or step % t.log_every == 0 or bool(t.eval_every and step % t.eval_every == 0) \
            or bool(t.checkpoint_every and step % t.checkpoint_every == 0) \
            or (self.mesh.world_size > 1 and step % STOP_CHECK_EVERY == 0)

    def _read(self, pending: PendingSteps) -> None:
        """Bring the pending steps' values to the host; a deferred non-finite verdict raises."""
        if not len(pending):
            return
        first = self.step - len(pending) + 1
        values = pending.read(self.data_axis, self.replicas)
        self._interval.losses += values.losses
        self._interval.times += values.times
        self._run_times["times"] += values.times
        if self.defers_verdict and not self.scaler.enabled and any(values.nonfinite):
            bad = values.nonfinite.index(True)
            raise self._nonfinite_error(first + bad, values.losses[bad], values.grad_norms[bad])
        if self.defers_verdict:
            self.scaler.check()

    def _training_record(self, lr: float) -> dict:
        """The logging interval's training record (host values only; see `_read`)."""
        scaler = dict(loss_scale=self.scaler.scale, skipped_steps=self.skipped_steps) \
            if self.scaler.enabled else {}
        record = self.records.training_record(self.step, lr, self._interval,
                                              self.last_state_bytes, scaler)
        if self.compile_counter is not None and not any("loss" in h for h in self.history):
            # the first record says whether compile took effect: never a silent eager run
            compiled = self.compile_counter.figures()
            record.update(compiled_graphs=compiled["compiled_graphs"],
                          graph_breaks=compiled["graph_breaks"])
        self._interval = Interval(self.mesh.ledger.snapshot())
        return record

    def _nonfinite_error(self, step: int, loss: float, norm: float | None) -> NonFiniteLoss:
        return nonfinite_error(step, loss, norm, self.mesh.rank, self.step,
                               checkpoint.latest(self.run_dir) if self.run_dir else None)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> dict:
        """What a checkpoint stores besides model and optimizer (the hooks add theirs)."""
        return {"step": self.step, "plan": str(self.mesh.plan),
                "world_size": self.mesh.world_size,
                "zero_stage": self.config.parallel.zero_stage if self.mesh.plan.shard > 1 else 0,
                "precision": self.precision.name,
                "loss_scaler": self.scaler.state_dict(),
                "skipped_steps": self.skipped_steps,
                "nonfinite_skipped": self.nonfinite_skipped,
                # the per-rank micro-batch that fitted: an elastic re-formation on fewer
                # ranks accumulates rather than exceed it (resilience/elastic.py)
                "micro_batch": self.micro,
                **self.hooks.checkpoint_state()}

    def _save(self) -> None:
        if self.run_dir:
            self.checkpoint_writer.save(self.run_dir, self.step, self.model, self.optimizer,
                                        self.checkpoint_state(),
                                        keep=self.config.train.checkpoint_keep,
                                        config=self.config.to_dict(),
                                        before_commit=lambda: self.faults.in_save(self.step),
                                        group=self.checkpoint_group)

    def resume(self, path: Path) -> dict:
        state = checkpoint.load(path, self.model, self.optimizer, group=self.checkpoint_group)
        self.step = int(state["step"])
        if self.scaler.enabled and "loss_scaler" in state and state.get("precision") == "fp16":
            self.scaler.load_state_dict(state["loss_scaler"])
        self.nonfinite_skips.skipped = int(state.get("nonfinite_skipped", 0))
        if self.is_main and self.run_dir:  # lines past the checkpoint are written again
            checkpoint.truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.hooks.load_state(state)
        return state

    # ------------------------------------------------------------------ the summary
    def _summary(self, eval_metrics: dict, wall: float, start: float) -> dict:
        """The run's summary (summary.json on rank 0)."""
        memory = self.records.memory_figures(self.last_state_bytes)
        summary = {**eval_metrics, **self.workload.baselines, "steps": self.step,
                   "world_size": self.mesh.world_size, "plan": str(self.mesh.plan),
                   **self.records.run_figures(self.history, self._run_times, memory),
                   "precision": self.precision.name,
                   "stopped_by_signal": self.stopped_early,  # (a bandwidth drop's stop too)
                   "nonfinite_skipped": self.nonfinite_skipped,
                   "checkpoint_blocked_s": self.checkpoint_writer.blocked_s,
                   "checkpoint_saves": self.checkpoint_writer.saves,
                   "wall_s": wall, "run_dir": str(self.run_dir) if self.run_dir else None}
        # this rank's training input over the run, as delivered to the device (as stored in the
        # files when the workload decodes on the device: a spatial rank's blocks only)
        summary["input_bytes_per_rank"] = self.input_bytes
        # what the training set read from its files on this rank (its loader workers included):
        # under space, a data set read by blocks reads only this rank's block (data/reads.py)
        counter = getattr(self.workload.train_set, "read_counter", None)
        if counter is not None:
            summary.update(counter.figures())
        if self.compile_counter is not None:
            summary.update(self.compile_counter.figures())
        if self.mesh.plan.shard > 1:
            summary["zero_stage"] = self.config.parallel.zero_stage
        if self.scaler.enabled:
            summary.update(loss_scale=self.scaler.scale, skipped_steps=self.skipped_steps)
        summary.update(self.observer.summary(start, memory))
        if self.stage_figures:  # staging is part of the time it took to train
            summary.update(self.stage_figures)
            if "time_to_train_s" in summary:
                summary["time_to_train_s"] += self.stage_figures["stage_s"]
        summary.update(self.job_figures)
        if self.replica_groups:
            summary.update(self.replica_groups.figures())
        if self.is_main and self.run_dir:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        # the tracked runs (W&B, MLflow) end with the job, which may still fail after this fit
        # (a population's final exchange): its owner calls `finished`
        return summary
