"""The Trainer: steps, micro-batches, schedule, clipping, evaluation, metrics, checkpoints.

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

Memory (`train.memory`): every logged record carries the bytes of parameters, gradients and
optimizer state held by the rank at the optimizer step (`state_bytes`), and the peak memory of
forward + backward above the resident state (`peak_activation_bytes`, measured by the CUDA
allocator on GPUs every step, tracked per storage on CPU for the second step of each `fit`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from ..comm import all_gather_object, all_reduce, broadcast_object
from ..data.loader import EpochSampler, Prefetcher, collate, default_workers, run_loader
from ..mesh import Mesh
from ..parallel.data import unwrap
from ..parallel.gradnorm import clip_grad_norm_
from ..parallel.pipe.model import PipelineModel
from ..parallel.shard import build_optimizer_for
from ..workloads.base import Workload
from .checkpoints import checkpoint
from . import kfac
from .config import Config, micro_batch_size
from .monitor.memory import StepPeak, state_bytes
from .monitor.observer import StepObserver
from ..parallel.precision import Precision, keep_norms_fp32, measured_matmul_flops
from .schedule import lr_at, scaled_lr
from .resilience.faults import FaultInjector
from .resilience.policies import SkipBadSamples, out_of_memory_advice, skip_nonfinite
from .resilience.stop import StopOnSignal
from .resilience.watchdog import Watchdog


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN or infinite loss or gradient; the last checkpoint is intact."""


def build_optimizer(params, options, lr: float) -> torch.optim.Optimizer:
    name = options.kfac_base if options.name == "kfac" else options.name  # K-FAC: see Trainer
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=options.momentum,
                               weight_decay=options.weight_decay)
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, betas=tuple(options.betas), eps=options.eps,
               weight_decay=options.weight_decay)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Peak memory of this rank and where the number comes from."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_peak_rss"


class Trainer:
    def __init__(self, mesh: Mesh, workload: Workload, config: Config, model: nn.Module,
                 run_dir: Path | None = None, console=None):
        self.mesh, self.workload, self.config = mesh, workload, config
        self.model = model
        self.run_dir = Path(run_dir) if run_dir else None
        self.console = console
        self.is_main = mesh.rank == 0
        # the batch is split over data replicas and over the ranks of a sharded group
        self.data_axis = mesh.axis("data", "shard") if mesh.plan.shard > 1 else mesh.axis("data")
        self.replicas = self.data_axis.size
        self.micro = micro_batch_size(config, self.replicas)
        t = config.train
        n = len(workload.train_set)
        self.node_shard = self._node_shards()  # data.shuffle = "node": this node's samples
        self.steps_per_epoch = n // t.batch_size
        if self.node_shard is not None:  # the smallest shard sets every node's steps
            _, _, _, on_node, nodes = self.node_shard
            self.steps_per_epoch = (n // nodes) // (on_node * (t.batch_size // self.replicas))
        if self.steps_per_epoch == 0:
            raise ValueError(f"train.batch_size={t.batch_size} is larger than the training set "
                             f"({n} samples); lower it or add samples.")
        if len(workload.val_set) < self.replicas:
            raise ValueError(f"the validation set has {len(workload.val_set)} samples, fewer than "
                             f"the {self.replicas} data replicas; every replica needs at least one.")
        self.total_steps = t.steps or t.epochs * self.steps_per_epoch
        s = config.schedule
        self.peak_lr = scaled_lr(config.optim.lr, t.batch_size, s.base_batch_size, s.lr_scaling)
        self.optimizer = build_optimizer_for(
            model, lambda params: build_optimizer(params, config.optim, self.peak_lr))
        if config.optim.name == "kfac":  # preconditioning in front of the first-order update
            self.optimizer = kfac.KFAC(model, self.optimizer, mesh, kfac.KFACSettings.from_options(
                config.optim), config.train.grad_accum)
        # what clipping and unscaling act on: the tensors the optimizer steps (ZeRO-1/2: shards)
        self.opt_params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.precision = Precision(config.parallel.precision, mesh.device)
        if self.precision.mixed:
            keep_norms_fp32(model)
        self.scaler = self.precision.loss_scaler()
        self.step_peak = StepPeak(mesh.device)
        self._track_step = 0             # which step the CPU peak tracker watches (see fit)
        self.last_state_bytes: dict = {}
        self.skipped_steps = 0
        self.nonfinite_skipped = 0       # steps skipped under train.on_nonfinite = "skip"
        self.stopped_by_signal = False
        self.faults = FaultInjector(mesh.rank, self.run_dir)
        self.checkpoint_writer = checkpoint.Writer(config.train.checkpoint_async)
        if config.train.on_bad_sample == "skip":
            workload.train_set = SkipBadSamples(workload.train_set, self.run_dir, mesh.rank)
        # loader workers per rank: train.num_workers, or (-1) from the cores the node's ranks share
        self.num_workers = t.num_workers if t.num_workers >= 0 else _auto_workers()
        self.step = 0
        self.history: list[dict] = []
        self.input_bytes = 0  # training input delivered to this rank's device (data.loader)
        self.stage_figures: dict = {}  # set by train.run when the data set was staged
        # the ranks that write a checkpoint together: the job, or one trainer of a population
        self.checkpoint_group = mesh.group
        self.observer = StepObserver(self)  # exposed comm, ranges, profile, TensorBoard, MLPerf

    # ------------------------------------------------------------------ data
    def _rank_indices(self, epoch: int, first_step: int) -> list[int]:
        """This replica's sample indices for steps first_step.. of `epoch`, in order.

        Global shuffle: epoch e permutes all samples with the seed (seed, e); step s's global
        batch is perm[s·B : (s+1)·B] and replica r takes its r-th slice. Node shuffle: the
        samples are split into one contiguous shard per node, each node permutes only its shard
        (seed (seed, e, node)), and the node's replicas take consecutive slices of it, so a node
        reads each sample of its shard once per epoch and no other (stage only that shard)."""
        t = self.config.train
        per_replica = t.batch_size // self.replicas
        if self.node_shard is None:
            order = np.random.default_rng([self.config.run.seed, epoch]).permutation(
                len(self.workload.train_set))
            step_size, first = t.batch_size, self.data_axis.rank * per_replica
        else:
            node, shard, position, on_node, _ = self.node_shard
            order = shard[np.random.default_rng([self.config.run.seed, epoch, node]).permutation(
                len(shard))]
            step_size, first = on_node * per_replica, position * per_replica
        out: list[int] = []
        for s in range(first_step, self.steps_per_epoch):
            batch = order[s * step_size:(s + 1) * step_size]
            out.extend(batch[first:first + per_replica].tolist())
        return out

    def _node_shards(self) -> tuple | None:
        """data.shuffle = "node": (this node's index, its shard of sample indices, this replica's
        position among the node's replicas, replicas on the node, nodes); None for the global
        shuffle.
        Nodes are told apart by host name (data.stage.host_name)."""
        if getattr(self.config.data, "shuffle", "global") != "node":
            return None
        from ..data.stage import host_name
        every = all_gather_object((host_name(), self.data_axis.rank), self.mesh.world)
        hosts = list(dict.fromkeys(h for h, _ in every))  # in rank order
        replicas = {h: sorted({r for hh, r in every if hh == h}) for h in hosts}
        split = [r for r in range(self.replicas) if sum(r in v for v in replicas.values()) > 1]
        counts = {len(v) for v in replicas.values()}
        if split or len(counts) > 1:
            raise ValueError(
                "data.shuffle = \"node\" needs every data replica's ranks on one node and the "
                f"same number of replicas on every node; replicas per node here: "
                f"{ {h: v for h, v in replicas.items()} }. Use data.shuffle = \"global\", or "
                "launch so each node holds whole replicas (pipe/space/tensor innermost).")
        me = hosts.index(host_name())
        shard = np.array_split(np.arange(len(self.workload.train_set)), len(hosts))[me]
        on_node = len(replicas[host_name()])
        if len(shard) < on_node * (self.config.train.batch_size // self.replicas):
            raise ValueError(f"data.shuffle = \"node\": a node's shard of {len(shard)} samples "
                             "is smaller than its part of one batch; lower train.batch_size.")
        return me, shard, replicas[host_name()].index(self.data_axis.rank), on_node, len(hosts)

    def _batches(self, start_step: int) -> Prefetcher:
        """Micro-batches (x, y) on the device from `start_step` on, epoch after epoch: one loader
        for the whole run (workers start once), `train.prefetch` batches ahead, decoded on the
        device by the workload's `decode` (see data.loader)."""
        t = self.config.train
        sampler = EpochSampler(self._rank_indices, self.steps_per_epoch, start_step)
        source = run_loader(self.workload.train_set, sampler, self.micro, self.num_workers,
                            self.mesh.device, seed=start_step // self.steps_per_epoch,
                            timeout_s=self.config.run.timeout_s)
        return Prefetcher(source, self.mesh.device, decode=self.workload.decode, depth=t.prefetch)

    def _to_device(self, batch):
        x, y = batch
        x, y = x.to(self.mesh.device, non_blocking=True), y.to(self.mesh.device, non_blocking=True)
        return self.workload.decode_inputs(x), y

    # ------------------------------------------------------------------ one step
    def _train_step(self, batches) -> tuple[float, float]:
        t, accum = self.config.train, self.config.train.grad_accum
        lr = lr_at(self.step, self.peak_lr, self.total_steps, self.config.schedule.warmup_steps,
                   self.config.schedule.decay, self.config.schedule.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(hash((self.config.run.seed, self.step, self.mesh.rank)) % 2 ** 63)
        self.model.train()
        loss_sum = 0.0
        # CUDA: the allocator's peak, every step for free; CPU: the tracker, one step per fit
        watch = self.mesh.device.type == "cuda" or self.step == self._track_step
        track = self.step_peak.track() if watch else contextlib.nullcontext()
        with track:
            if isinstance(self.model, PipelineModel):  # micro-batches run by the schedule
                x, y = next(batches)
                loss_sum = self.model.train_step(
                    x, y, lambda output, target: self.workload.loss_fn(output.float(), target))
            for micro in range(accum if not isinstance(self.model, PipelineModel) else 0):
                x, y = next(batches)
                sync = micro == accum - 1 or not hasattr(self.model, "no_sync")
                with (self.model.no_sync() if not sync else contextlib.nullcontext()):
                    with self.precision.autocast(), self.observer.phase("forward"):
                        output = self.model(x)
                    loss = self.workload.loss_fn(output.float(), y) / accum  # fp32 loss
                    with self.observer.phase("backward"):
                        self.scaler.scale_loss(loss).backward()
                loss_sum += loss.detach().item()
        self.scaler.unscale_(self.opt_params)
        # The gradient norm is global (the same on every rank), so every rank reaches the same
        # verdict on finiteness without another collective.
        max_norm = t.clip_grad_norm if t.clip_grad_norm > 0 else math.inf
        grad_norm = clip_grad_norm_(self.opt_params, max_norm,
                                    across=getattr(self.model, "norm_axis", None))
        finite = math.isfinite(grad_norm)
        # (the local loss is only reported: deciding on it could stop one rank and strand the rest)
        if not finite and not self.scaler.enabled and skip_nonfinite(self, loss_sum, grad_norm):
            return loss_sum, lr
        if not finite and not self.scaler.enabled:
            last = checkpoint.latest(self.run_dir) if self.run_dir else None
            raise NonFiniteLoss(
                f"step {self.step + 1}: loss {loss_sum} / gradient norm {grad_norm} is not finite on "
                f"rank {self.mesh.rank}. Stopped before the optimizer step; "
                + (f"the last good checkpoint is {last}. " if last else "no checkpoint was written yet. ")
                + "Lower optim.lr, add schedule.warmup_steps, set train.clip_grad_norm, or check "
                  "the data for NaNs.")
        if self.scaler.update(finite):
            with self.observer.phase("optimizer"):
                self.optimizer.step()
            # at the optimizer step: gradients still alive, optimizer state (lazily) created
            self.last_state_bytes = state_bytes(self.model, self.optimizer)
        else:  # fp16 overflow: skip this step, with a halved loss scale
            self.last_state_bytes = state_bytes(self.model, self.optimizer)
            self.skipped_steps += 1
            self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, lr

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, dataset=None) -> dict[str, float]:
        """The workload's metrics on the validation set (or on `dataset`, e.g. a tournament set)."""
        model = unwrap(self.model)
        was_training = model.training
        model.eval()
        val = self.workload.val_set if dataset is None else dataset
        indices = list(range(len(val)))[self.data_axis.rank::self.replicas]
        # Every rank runs the same number of batches, because a sharded or split model's forward
        # is itself collective: the short ranks pad with a repeated sample and ignore its output.
        valid = len(indices)
        indices += indices[:1] * (-(-len(val) // self.replicas) - valid)
        sums: dict[str, torch.Tensor] = {}
        seen = 0
        for batch in DataLoader(val, batch_size=self.micro, sampler=indices,
                                num_workers=self.num_workers, collate_fn=collate):
            x, y = self._to_device(batch)
            if isinstance(model, PipelineModel):
                output = model.eval_batch(x)  # on the last stage's rank only
            else:
                with self.precision.autocast():
                    output = model(x)
            keep = max(0, min(len(y), valid - seen))
            seen += len(y)
            if keep == 0 or output is None:
                continue
            for key, value in self.workload.metric_sums(output[:keep].float(), y[:keep]).items():
                sums[key] = sums.get(key, 0) + value.detach().double().cpu()
        keys = sorted(sums)
        axes = tuple(self.workload.metric_axes)
        if isinstance(model, PipelineModel):  # the last stage's rank has the sums: share them
            pipe = self.mesh.axis("pipe")
            keys = broadcast_object(keys, pipe, src=pipe.size - 1)
            axes += ("pipe",)
        vector = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float64)
                              for k in keys]).to(self.mesh.device)
        # validation samples are split like training batches: over data and shard ranks too
        if self.mesh.plan.shard > 1 and "shard" not in axes:
            axes += ("shard",)
        all_reduce(vector, self.mesh.axis(*axes), tag="metric")
        vector = vector.cpu()
        model.train(was_training)
        return {k: float(v) for k, v in self.workload.finalize(dict(zip(keys, vector))).items()}

    # ------------------------------------------------------------------ the loop
    def _log(self, record: dict) -> None:
        self.history.append(record)
        if self.is_main and self.run_dir:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        self.observer.written(record)

    def checkpoint_state(self) -> dict:
        """What a checkpoint stores besides model and optimizer (subclasses add theirs)."""
        return {"step": self.step, "plan": str(self.mesh.plan),
                "world_size": self.mesh.world_size,
                "zero_stage": self.config.parallel.zero_stage if self.mesh.plan.shard > 1 else 0,
                "precision": self.precision.name,
                "loss_scaler": self.scaler.state_dict(),
                "skipped_steps": self.skipped_steps,
                "nonfinite_skipped": self.nonfinite_skipped}

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
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))
        if self.is_main and self.run_dir:  # lines past the checkpoint are written again
            checkpoint.truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
        return state

    def after_step(self) -> None:
        """Called after every step's logging and evaluation, before its checkpoint (a hook for
        subclasses: the population's tournaments)."""

    @property
    def tokens_per_sample(self) -> int:
        return self.workload.tokens_per_sample

    def _memory_figures(self) -> dict:
        """This rank's model-state bytes at the last optimizer step and its peak step memory."""
        names = {"params": "param_bytes", "grads": "grad_bytes", "optimizer": "optimizer_bytes",
                 "total": "state_bytes", "offloaded_bytes": "offloaded_bytes"}
        out = {names[k]: v for k, v in self.last_state_bytes.items()}
        if self.step_peak.bytes is not None:
            out.update(peak_activation_bytes=self.step_peak.bytes,
                       peak_activation_source=self.step_peak.source)
        return out

    @functools.cached_property
    def peak_matmul_flops(self) -> float:
        """This device's measured matmul FLOP/s in the step's dtype (MFU's denominator), measured
        once per run: the live log and the summary share it."""
        return measured_matmul_flops(self.mesh.device, self.precision.dtype)

    def _throughput(self, samples_per_s: float) -> dict:
        """Tokens/s, model FLOP/s and MFU against this device's measured matmul rate."""
        out = {}
        if self.tokens_per_sample:
            out["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        if self.workload.flops_per_sample and math.isfinite(samples_per_s):
            per_rank = self.workload.flops_per_sample * samples_per_s / self.mesh.world_size
            peak = self.peak_matmul_flops
            out.update(model_flops_per_s=per_rank * self.mesh.world_size,
                       matmul_flops_per_s_measured=peak, mfu=per_rank / peak)
        return out

    def _input_figures(self, step_times: list, waits: list, sizes: list) -> dict:
        """The run's input wait: median seconds a step waited for its batch, the median share of
        the step that was, and the input bytes per second this rank consumed (steady steps)."""
        first = min(len(step_times) - 1, 2) if step_times else 0
        times, waits, sizes = step_times[first:], waits[first:], sizes[first:]
        if not times:
            return {}
        out = {"data_wait_s_median": statistics.median(waits),
               "data_wait_fraction": statistics.median(w / d for w, d in zip(waits, times)),
               "input_bytes_per_s": sum(sizes) / sum(times),
               "num_workers": self.num_workers, "prefetch": self.config.train.prefetch}
        if out["data_wait_fraction"] > DATA_WAIT_WARN:
            out["data_wait_advice"] = data_wait_advice(out, self.config, self.mesh.device)
        return out

    def _pipeline_timeline(self) -> dict:
        """The last step's bubble (idle share of stage time, mean over ranks); rank 0 keeps the
        step's timeline as pipeline_timeline.json in the run directory."""
        model = self.model
        line = model.timeline
        # the picture shows one pipeline: the one of rank 0 (every other mesh coordinate 0); the
        # stages' other ranks (data, shard, space, tensor) would draw over its boxes
        drawn = all(c == 0 for axis, c in self.mesh.coords.items() if axis != "pipe")
        mine = {"events": line.events if drawn else [], "start": line.step_start,
                "end": line.step_end, "idle": line.idle_fraction()}
        every = all_gather_object(mine, self.mesh.world)
        bubble = sum(r["idle"] for r in every) / len(every)
        if self.is_main and self.run_dir:
            t0 = min(r["start"] for r in every)
            events = [{**e, "start_s": e["start_s"] - t0, "end_s": e["end_s"] - t0}
                      for r in every for e in r["events"]]
            (self.run_dir / "pipeline_timeline.json").write_text(json.dumps({
                "schedule": model.schedule_name, "stages": model.axis.size,
                "virtual_stages": model.per_rank, "microbatches": model.microbatches,
                "step": self.step, "bubble_measured": bubble,
                "bubble_formula": model.bubble_formula(), "events": events}))
        return {"bubble_fraction": bubble, "bubble_formula": model.bubble_formula()}

    def fit(self) -> dict:
        # the second step: the first one also allocates what persists (communication buckets,
        # FSDP2's lazy initialisation), which is not activation memory
        self._track_step = self.step + (1 if self.total_steps - self.step > 1 else 0)
        t = self.config.train
        batches = self._batches(self.step)
        ledger = self.mesh.ledger
        interval_losses, interval_times, step_times = [], [], []
        interval_waits, step_waits, step_bytes = [], [], []
        mark, start = ledger.snapshot(), time.perf_counter()
        eval_metrics: dict[str, float] = {}
        progress = self.console.progress(self.total_steps, self.step) if self.console else None
        self.observer.fit_begin()
        stop = StopOnSignal().install()
        watchdog = Watchdog(ledger, self.mesh.rank, self.run_dir, self.config.run.timeout_s).start(
            self.mesh.world_size)
        try:
            while self.step < self.total_steps:
                ledger.step = self.step + 1  # the step number metrics.jsonl will give it
                self.faults.at_step(self.step + 1)
                watchdog.beat()
                t0 = time.perf_counter()
                self.observer.step_begin()
                try:
                    # the step seeds the global generators (dropout masks replayable on resume);
                    # fork_rng gives the caller's streams back after it, so user code never sees
                    # them reset
                    with torch.random.fork_rng(devices=_rng_devices(self.mesh.device)):
                        loss, lr = self._train_step(batches)
                except torch.OutOfMemoryError as exc:
                    raise torch.OutOfMemoryError(out_of_memory_advice(self, exc)) from exc
                if self.mesh.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                wait, nbytes = batches.take()  # this step's input wait (within dt) and bytes
                self.observer.step_end()
                self.step += 1
                interval_losses.append(loss)
                interval_times.append(dt)
                step_times.append(dt)
                interval_waits.append(wait)
                step_waits.append(wait)
                step_bytes.append(nbytes)
                self.input_bytes += nbytes
                if progress:
                    progress.advance(loss)
                last = self.step == self.total_steps
                if self.step % t.log_every == 0 or last:
                    # on the mesh device: NCCL reduces only GPU tensors
                    losses = torch.tensor(interval_losses, dtype=torch.float64, device=self.mesh.device)
                    all_reduce(losses, self.data_axis, tag="metric")
                    losses = losses.cpu() / self.replicas
                    delta = ledger.since(mark)
                    n = len(interval_times)
                    peak, source = peak_memory_bytes(self.mesh.device)
                    record = {"step": self.step, "loss": float(losses.mean()), "lr": lr,
                              "samples_per_s": t.batch_size * n / sum(interval_times),
                              "step_s": statistics.median(interval_times),
                              "data_wait_s": statistics.median(interval_waits),
                              "data_wait_fraction": statistics.median(
                                  w / d for w, d in zip(interval_waits, interval_times)),
                              "peak_mem_bytes": peak, "peak_mem_source": source,
                              **self._memory_figures(),
                              "bytes_per_step": {a: b // n for a, b in delta.bytes_by_axis().items()},
                              "step_losses": losses.tolist()}
                    if self.tokens_per_sample:
                        record["tokens_per_s"] = record["samples_per_s"] * self.tokens_per_sample
                    if self.scaler.enabled:
                        record.update(loss_scale=self.scaler.scale, skipped_steps=self.skipped_steps)
                    if isinstance(self.model, PipelineModel):
                        record.update(self._pipeline_timeline())
                    self.observer.log(record)
                    self._log(record)
                    if progress:
                        progress.log(record)
                    interval_losses, interval_times, mark = [], [], ledger.snapshot()
                    interval_waits = []
                reached = False
                if (t.eval_every and self.step % t.eval_every == 0) or last:
                    eval_start = time.time()
                    with watchdog.paused():  # long and collective-free under plain data parallelism
                        eval_metrics = self.evaluate()
                    self._log({"step": self.step, **eval_metrics})
                    if progress:
                        progress.log({"step": self.step, **eval_metrics})
                    reached = self.observer.evaluated(eval_metrics, eval_start)  # train.target
                self.after_step()
                stopping = not last and not reached and (stop.agreed(self.mesh)
                                                         or self.observer.stop_requested)
                if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or last or reached \
                        or stopping:
                    with watchdog.paused():  # file system time; the backend's timeout still holds
                        self._save()
                if reached:
                    break
                if stopping:
                    self.stopped_by_signal = True
                    stop.announce(self)
                    break
            self.checkpoint_writer.wait()
        finally:  # a failed step must not leave a live progress bar or loader workers
            stop.restore()
            watchdog.stop()
            if progress:
                progress.close()
            batches.close()
            self.observer.close()  # the profile trace and event files of what ran
        if not eval_metrics and not self.stopped_by_signal:
            eval_metrics = self.evaluate()
        wall = time.perf_counter() - start
        # The first steps pay for warm-up (allocator, DDP bucket rebuild): leave them out.
        steady = step_times[min(len(step_times) - 1, 2):] if step_times else [float("nan")]
        summary = {**eval_metrics, **self.workload.baselines, "steps": self.step,
                   "samples_per_s": t.batch_size / statistics.median(steady),
                   "step_s_median": statistics.median(steady),
                   "world_size": self.mesh.world_size, "plan": str(self.mesh.plan),
                   "final_loss": next((h["loss"] for h in reversed(self.history) if "loss" in h), None),
                   "bytes_per_step": next((h["bytes_per_step"] for h in reversed(self.history)
                                           if "bytes_per_step" in h), {}),
                   **self._memory_figures(),
                   **self._throughput(t.batch_size / statistics.median(steady)),
                   **self._input_figures(step_times, step_waits, step_bytes),
                   "precision": self.precision.name,
                   "stopped_by_signal": self.stopped_by_signal,
                   "nonfinite_skipped": self.nonfinite_skipped,
                   "checkpoint_blocked_s": self.checkpoint_writer.blocked_s,
                   "checkpoint_saves": self.checkpoint_writer.saves,
                   "wall_s": wall, "run_dir": str(self.run_dir) if self.run_dir else None}
        # this rank's training input over the run, as delivered to the device (as stored in the
        # files when the workload decodes on the device: a spatial rank's blocks only)
        summary["input_bytes_per_rank"] = self.input_bytes
        if self.mesh.plan.shard > 1:
            summary["zero_stage"] = self.config.parallel.zero_stage
        if self.scaler.enabled:
            summary.update(loss_scale=self.scaler.scale, skipped_steps=self.skipped_steps)
        summary.update(self.observer.summary(start))
        if self.stage_figures:  # staging is part of the time it took to train
            summary.update(self.stage_figures)
            if "time_to_train_s" in summary:
                summary["time_to_train_s"] += self.stage_figures["stage_s"]
        if self.is_main and self.run_dir:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.observer.finished(summary)  # W&B, MLflow: the summary, pictures, logs; the end
        return summary


DATA_WAIT_WARN = 0.05  # a run that waits longer than this share of its steps for input says so


def data_wait_advice(figures: dict, config: Config, device: torch.device) -> str:
    """One line: how long steps waited for input, and the levers that would shorten it."""
    t = config.train
    levers = []
    if t.prefetch == 0:
        levers.append("train.prefetch = 2 (load the next batches while this one trains)")
    levers.append(f"more loader workers (train.num_workers, now {figures['num_workers']})")
    if not getattr(config.data, "stage_to", ""):
        levers.append("data.stage_to = \"/dev/shm\" or node-local NVMe (reads from a parallel "
                      "file system are the usual cause)")
    if device.type == "cuda" and hasattr(config.data, "decode_on_device") \
            and not config.data.decode_on_device:
        levers.append("data.decode_on_device = true")
    return (f"steps waited {figures['data_wait_fraction']:.0%} of their time for input "
            f"(median {figures['data_wait_s_median'] * 1e3:.1f} ms a step): try "
            + "; ".join(levers) + ".")


def _auto_workers() -> int:
    """train.num_workers = -1: loader processes from the cores each rank of a launched job has
    (exatrain run, torchrun, srun, ...); none in a plain process (a notebook, a script or test
    process started without a launcher), which may already run threads that a forked worker
    would inherit broken (seen: a worker forked from a test process died of a segfault)."""
    from ..launch import detect
    launch = detect()
    return default_workers(launch.local_world_size) if launch else 0


def _rng_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose generator states `fork_rng` saves: this rank's, or none on CPU."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]
