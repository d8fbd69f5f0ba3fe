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

The host never waits for the device between read points (log, evaluation and checkpoint steps,
every `STOP_CHECK_EVERY` steps with several ranks, the last step): a step leaves its loss, its
global gradient norm and its non-finite verdict on the device (`monitor.step_meters`), its times
as CUDA events, and a non-finite step is skipped by the optimizer's own kernel (`found_inf`, as
`torch.amp.GradScaler` does; fp16's loss scale is updated on the device too). A read point reads
them all with one copy. What the run reports is what every step measured: per-interval medians,
every step's loss in `step_losses`, a `NonFiniteLoss` naming the step. Optimizers without a
device-side skip (K-FAC, foreach and for-loop kernels, FSDP2's DTensors) and
`train.on_nonfinite = "skip"` read the verdict every step instead (`defers_verdict`).

Memory (`train.memory`): logged records carry the bytes of parameters, gradients and
optimizer state held by the rank at the optimizer step of the log step (`state_bytes`), and the peak memory of
forward + backward above the resident state (`peak_activation_bytes`, measured by the CUDA
allocator on GPUs every step, tracked per storage on CPU for the second step of each `fit`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from ..comm import all_gather_object, all_reduce, broadcast_object
from ..data.loader import (EpochSampler, Prefetcher, collate, loader_workers, no_inherited_garbage,
                           run_loader)
from ..mesh import Mesh
from ..parallel.data import unwrap
from ..parallel.gradnorm import clip_grad_norm_, decided_locally, found_nonfinite
from ..parallel.compile_stats import CompileCounter
from ..parallel.options import cuda_graphs_refusal
from ..parallel.layout import channels_last_input, input_memory_format
from ..parallel.pipe.model import PipelineModel
from ..parallel.shard import build_optimizer_for
from ..workloads.base import Workload
from .checkpoints import checkpoint
from . import kfac
from .config import Config, ConfigError, micro_batch_size
from .monitor.cpu_peak import Peak, cpu_peak
from .monitor.memory import StepPeak, peak_memory_bytes, state_bytes
from .monitor.observer import StepObserver
from .monitor.step_meters import PendingSteps
from ..parallel.precision import Precision, keep_norms_fp32, measured_matmul_flops
from .schedule import lr_at, scaled_lr
from .resilience.faults import FaultInjector
from .resilience.policies import SkipBadSamples, out_of_memory_advice, skip_nonfinite
from .resilience.stop import StopOnSignal
from .resilience.watchdog import Watchdog
from ..errors import UserError


STOP_CHECK_EVERY = 5  # steps between a multi-rank run's stop agreements (besides log steps); the
                      # bandwidth watch agrees at these read points too (its check_every: 5)


@dataclass
class Interval:
    """Host values of the steps since the last log record."""
    mark: object                                  # the ledger's snapshot at its start
    losses: list = field(default_factory=list)    # mean over the data replicas
    times: list = field(default_factory=list)     # seconds
    waits: list = field(default_factory=list)     # seconds waited for input


class NonFiniteLoss(UserError, RuntimeError):
    """Training produced a NaN or infinite loss or gradient; the last checkpoint is intact.

    What to do: lower `optim.lr`, add warm-up, or set `train.on_nonfinite = "skip"`; resume from
    the checkpoint the message names.
    """


def build_optimizer(params, options, lr: float) -> torch.optim.Optimizer:
    name = options.kfac_base if options.name == "kfac" else options.name  # K-FAC: see Trainer
    params = list(params)
    kernel = optimizer_kernel(params, getattr(options, "impl", "auto"), sgd=name == "sgd")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=options.momentum,
                               weight_decay=options.weight_decay, **kernel)
    cls = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, betas=tuple(options.betas), eps=options.eps,
               weight_decay=options.weight_decay, **kernel)


def optimizer_kernel(params: list, impl: str, sgd: bool = False) -> dict:
    """torch.optim's implementation for `optim.impl`: "auto" takes the fused kernel (one launch
    for every parameter, and a step it can skip on the device) wherever torch has one for these
    parameters (plain floating-point tensors on a GPU; on a CPU for Adam and AdamW), else
    torch's own choice. On a CPU, SGD keeps the for-loop kernel: torch 2.13's fused CPU SGD
    disagreed with it by 5e-4 (relative, one step) under 3D tensor parallelism with activation
    checkpointing, where every parameter and gradient was contiguous (cause not found)."""
    plain = all(type(p) in (torch.Tensor, nn.Parameter) and p.is_floating_point()
                and p.device.type in ("cpu", "cuda") for p in params)
    on_cpu = any(p.device.type == "cpu" for p in params)
    if impl == "fused" or (impl == "auto" and plain and not (sgd and on_cpu)):
        return {"fused": True}
    return {"foreach": True} if impl == "foreach" else {"foreach": False} if impl == "forloop" \
        else {}


def match_grad_layouts(params) -> None:
    """Give every gradient its parameter's strides. torch's fused optimizers walk parameter and
    gradient memory in step, assuming the two are laid out alike, which autograd's gradients are
    but gradients a strategy assigns need not be (seen with torch 2.13's fused CPU SGD and AdamW:
    a transposed gradient gave updates off by 0.5-1.0). A host-side check of strides per
    parameter; a copy only where they differ."""
    for p in params:
        g = p.grad
        if g is not None and g.stride() != p.stride() and type(g) is torch.Tensor:
            aligned = torch.empty_like(p)
            aligned.copy_(g)
            p.grad = aligned


def supports_found_inf(optimizer) -> bool:
    """Whether `optimizer.step()` honours `optimizer.found_inf` (skips on the device): torch's
    fused Adam, AdamW and SGD do, as `torch.amp.GradScaler` relies on."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD) and \
        bool(optimizer.defaults.get("fused"))


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
            raise ConfigError(f"train.batch_size={t.batch_size} is larger than the training set "
                              f"({n} samples); lower it or add samples.")
        if len(workload.val_set) < self.replicas:
            raise ConfigError(
                f"the validation set has {len(workload.val_set)} samples, fewer than "
                f"the {self.replicas} data replicas; every replica needs at least one.")
        self.total_steps = t.steps or t.epochs * self.steps_per_epoch
        s = config.schedule
        self.peak_lr = scaled_lr(config.optim.lr, t.batch_size, s.base_batch_size, s.lr_scaling)
        self.optimizer = build_optimizer_for(
            model, lambda params: build_optimizer(params, config.optim, self.peak_lr))
        if config.optim.name == "kfac":  # preconditioning in front of the first-order update
            self.optimizer = kfac.KFAC(model, self.optimizer, mesh, kfac.KFACSettings.from_options(
                config.optim), config.train.grad_accum)
        refusal = cuda_graphs_refusal(mesh.plan, config.parallel, mesh.device.type,
                                      config.optim.name)
        if refusal:
            raise ConfigError(refusal)
        # each forward begins a new iteration of the CUDA graphs (parallel.cuda_graphs): the
        # previous one's outputs may then be overwritten, which the step has consumed by then
        self._new_graph_iteration = (torch.compiler.cudagraph_mark_step_begin
                                     if config.parallel.cuda_graphs else lambda: None)
        # what clipping and unscaling act on: the tensors the optimizer steps (ZeRO-1/2: shards)
        self.opt_params = [p for g in self.optimizer.param_groups for p in g["params"]]
        # a CPU step that clips nothing and defers its verdict needs no norm, only finiteness:
        # a fused check stands in for it where this rank's gradients decide (gradnorm). Whether
        # the verdict is deferred is asked at each step: a subclass (the population's trainer)
        # decides it from state it sets after this constructor.
        self._finiteness_only = (mesh.device.type == "cpu" and t.clip_grad_norm <= 0
                                 and decided_locally(self.opt_params,
                                                     getattr(model, "norm_axis", None)))
        self.precision = Precision(config.parallel.precision, mesh.device)
        if self.precision.mixed:
            keep_norms_fp32(model)
        self.scaler = self.precision.loss_scaler(mesh.device)
        self._halted = torch.zeros((), device=mesh.device)  # on_nonfinite = "stop", deferred
        self.last_grad_norm = self.last_found_inf = None
        self.compile_counter: CompileCounter | None = None  # set by fit under parallel.compile
        self._run_times: dict[str, list] = {"times": [], "waits": [], "bytes": []}
        self.step_peak = StepPeak(mesh.device)
        self._track_step = 0             # which step the CPU peak tracker watches (see fit)
        self.last_state_bytes: dict = {}
        self.nonfinite_skipped = 0       # steps skipped under train.on_nonfinite = "skip"
        self.stopped_by_signal = False
        self.stop_signum: int | None = None  # the signal, when this rank received it itself
        self.faults = FaultInjector(mesh.rank, self.run_dir)
        self.checkpoint_writer = checkpoint.Writer(config.train.checkpoint_async)
        if config.train.on_bad_sample == "skip":
            workload.train_set = SkipBadSamples(workload.train_set, self.run_dir, mesh.rank)
        # loader workers per rank: train.num_workers, or (-1) from the cores the node's ranks share
        self.num_workers = loader_workers(t.num_workers)
        self.step = 0
        self.history: list[dict] = []
        self.input_bytes = 0  # training input delivered to this rank's device (data.loader)
        self.stage_figures: dict = {}  # set by train.job.build when the input was staged
        # set by train.run: what started the ranks and how often they were started again
        # (launcher, requeues, restarts), in summary.json and the trackers' summary alike
        self.job_figures: dict = {}
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
            raise ConfigError(
                "data.shuffle = \"node\" needs every data replica's ranks on one node and the "
                f"same number of replicas on every node; replicas per node here: "
                f"{ {h: v for h, v in replicas.items()} }. Use data.shuffle = \"global\", or "
                "launch so each node holds whole replicas (pipe/space/tensor innermost).")
        me = hosts.index(host_name())
        shard = np.array_split(np.arange(len(self.workload.train_set)), len(hosts))[me]
        on_node = len(replicas[host_name()])
        if len(shard) < on_node * (self.config.train.batch_size // self.replicas):
            raise ConfigError(f"data.shuffle = \"node\": a node's shard of {len(shard)} samples "
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
        return Prefetcher(source, self.mesh.device, decode=self._decode(), depth=t.prefetch,
                          workers=self.num_workers)

    def _decode(self):
        """The workload's decode on the device, then the layout the model takes (layout.py)."""
        decode = self.workload.decode
        if not input_memory_format(self.model):
            return decode
        return lambda x: channels_last_input(decode(x) if decode is not None else x)

    def _to_device(self, batch):
        x, y = batch
        x, y = x.to(self.mesh.device, non_blocking=True), y.to(self.mesh.device, non_blocking=True)
        decode = self._decode()
        return (decode(x) if decode is not None else x), y

    # ------------------------------------------------------------------ one step
    def _forward_backward(self, batches) -> torch.Tensor:
        """Forward and backward of every micro-batch; this rank's loss (a device tensor)."""
        accum = self.config.train.grad_accum
        if isinstance(self.model, PipelineModel):  # micro-batches run by the schedule
            x, y = next(batches)
            return torch.as_tensor(self.model.train_step(
                x, y, lambda output, target: self.workload.loss_fn(output.float(), target)))
        loss_sum = None
        for micro in range(accum):
            x, y = next(batches)
            sync = micro == accum - 1 or not hasattr(self.model, "no_sync")
            with (self.model.no_sync() if not sync else contextlib.nullcontext()):
                self._new_graph_iteration()
                with self.precision.autocast(), self.observer.phase("forward"):
                    output = self.model(x)
                loss = self.workload.loss_fn(output.float(), y)  # fp32 loss
                if accum > 1:  # (a division by one would cost a kernel and a backward node)
                    loss = loss / accum
                with self.observer.phase("backward"):
                    self.scaler.scale_loss(loss).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        return loss_sum

    def _train_step(self, batches, measure: bool = False) -> tuple[torch.Tensor, float]:
        """One optimizer step. Returns this rank's loss as a device tensor and the lr; leaves the
        global gradient norm (None where nothing needed it) and the non-finite verdict in
        `last_grad_norm`, `last_found_inf`.

        With `defers_verdict` nothing is read from the device: a non-finite step is skipped by
        the optimizer itself (`found_inf`, as `torch.amp.GradScaler` has fused optimizers do) and
        under `train.on_nonfinite = "stop"` every step after it too, until the next read point
        raises `NonFiniteLoss` naming it. `measure`: count the model state's bytes (log steps)."""
        t = self.config.train
        lr = lr_at(self.step, self.peak_lr, self.total_steps, self.config.schedule.warmup_steps,
                   self.config.schedule.decay, self.config.schedule.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._seed_step()
        if not (self.model.training and unwrap(self.model).training):
            # evaluation restores the mode itself; walking every module each step costs a
            # tiny model's step several percent on a CPU
            self.model.train()
        # CUDA: the allocator's peak, every step for free; CPU: the tracker, one step per fit
        watch = self.mesh.device.type == "cuda" or self.step == self._track_step
        with self.step_peak.track() if watch else contextlib.nullcontext():
            loss_sum = self._forward_backward(batches)
        self.scaler.unscale_(self.opt_params)
        # The gradient norm is global (the same on every rank), so every rank reaches the same
        # verdict on finiteness without another collective.
        if self._finiteness_only and self.defers_verdict:
            grad_norm = None  # not computed: nothing uses it (see found_nonfinite)
            found_inf = found_nonfinite(self.opt_params)
            if found_inf is None:  # no gradients at all
                found_inf = torch.zeros((), device=self.mesh.device)
        else:
            max_norm = t.clip_grad_norm if t.clip_grad_norm > 0 else math.inf
            grad_norm = clip_grad_norm_(self.opt_params, max_norm,
                                        across=getattr(self.model, "norm_axis", None))
            found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
        self.last_grad_norm, self.last_found_inf = grad_norm, found_inf
        if self.defers_verdict:
            skip = found_inf
            if not self.scaler.enabled:  # stop: this step and every later one are skipped
                self._halted = torch.maximum(self._halted, found_inf.to(self._halted.device))
                skip = self._halted
            self.scaler.update(found_inf)
            with self.observer.phase("optimizer"):
                self._step_unless(skip)
        elif self._decide_on_host(loss_sum, grad_norm, found_inf):
            with self.observer.phase("optimizer"):
                self.optimizer.step()
        else:
            self.model.zero_grad(set_to_none=True)
        if measure:  # at the optimizer step: gradients still alive, optimizer state created
            self.last_state_bytes = state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, lr

    def _step_unless(self, skip: torch.Tensor) -> None:
        """The optimizer's step, skipped by its own kernel where `skip` is 1 (no host read)."""
        match_grad_layouts(self.opt_params)
        first = self.optimizer.param_groups[0]["params"][0]
        self.optimizer.found_inf = skip.to(device=first.device, dtype=torch.float32)
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf

    def _decide_on_host(self, loss_sum, grad_norm, found_inf) -> bool:
        """The verdict read on the host (policies that act per step): True to step."""
        finite = not bool(found_inf)
        if not finite and not self.scaler.enabled:
            loss, norm = float(loss_sum), float(grad_norm)
            if skip_nonfinite(self, loss, norm):
                return False
            raise self._nonfinite_error(self.step + 1, loss, norm)
        if self.scaler.enabled and not finite:
            self.last_state_bytes = state_bytes(self.model, self.optimizer)
        return self.scaler.update(finite)

    def _nonfinite_error(self, step: int, loss: float, norm: float | None) -> "NonFiniteLoss":
        last = checkpoint.latest(self.run_dir) if self.run_dir else None
        what = f"gradient norm {norm}" if norm is not None else "a gradient"
        return NonFiniteLoss(
            f"step {step}: loss {loss} / {what} is not finite on rank "
            f"{self.mesh.rank}. The optimizer skipped it"
            + (f" and every step after it up to step {self.step}" if step < self.step else "")
            + "; " + (f"the last good checkpoint is {last}. " if last
                      else "no checkpoint was written yet. ")
            + "Lower optim.lr, add schedule.warmup_steps, set train.clip_grad_norm, or check "
              "the data for NaNs.")

    def _seed_step(self) -> None:
        """Seed this step's random streams (dropout) from (seed, step, rank): the CPU generator
        and this rank's CUDA generator, directly (torch.manual_seed seeds every device type)."""
        seed = hash((self.config.run.seed, self.step, self.mesh.rank)) % 2 ** 63
        torch.default_generator.manual_seed(seed)
        if self.mesh.device.type == "cuda":
            index = self.mesh.device.index
            torch.cuda.default_generators[torch.cuda.current_device() if index is None
                                          else index].manual_seed(seed)

    @property
    def defers_verdict(self) -> bool:
        """True when the step decides on non-finite gradients on the device (see _train_step):
        the optimizer's kernel can skip a step by itself (torch's fused optimizers) and the
        non-finite policy is "stop". Otherwise the verdict is read every step: K-FAC, foreach
        and for-loop optimizers, DTensor (FSDP2) parameters, `on_nonfinite = "skip"`."""
        return supports_found_inf(self.optimizer) and self.config.train.on_nonfinite == "stop"

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
        with no_inherited_garbage(self.num_workers):   # starts the workers
            batches = iter(DataLoader(val, batch_size=self.micro, sampler=indices,
                                      num_workers=self.num_workers, collate_fn=collate))
        for batch in batches:
            x, y = self._to_device(batch)
            if isinstance(model, PipelineModel):
                output = model.eval_batch(x)  # on the last stage's rank only
            else:
                self._new_graph_iteration()
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
                "nonfinite_skipped": self.nonfinite_skipped,
                # the per-rank micro-batch that fitted: an elastic re-formation on fewer
                # ranks accumulates rather than exceed it (resilience/elastic.py)
                "micro_batch": self.micro}

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
    def matmul_flops_measured(self) -> float:
        """This device's measured matmul FLOP/s in the step's dtype, measured once per run."""
        return measured_matmul_flops(self.mesh.device, self.precision.dtype)

    @functools.cached_property
    def peak(self) -> Peak:
        """MFU's denominator, once per run (the live log and the summary share it): on a CPU the
        processor's peak (`monitor.cpu_peak`), elsewhere, or where the CPU does not say enough,
        the measured matmul rate."""
        if self.mesh.device.type == "cpu":
            peak = cpu_peak(self.precision.dtype)
            if peak is not None:
                return peak
        return Peak(self.matmul_flops_measured, "the measured matmul rate "
                    "(matmul_flops_per_s_measured): no peak is known for this device")

    def _throughput(self, samples_per_s: float) -> dict:
        """Tokens/s, model FLOP/s, MFU against this device's peak and the measured matmul rate
        beside it."""
        out = {}
        if self.tokens_per_sample:
            out["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        if self.workload.flops_per_sample and math.isfinite(samples_per_s):
            per_rank = self.workload.flops_per_sample * samples_per_s / self.mesh.world_size
            out.update(model_flops_per_s=per_rank * self.mesh.world_size,
                       peak_flops_per_s=self.peak.flops, peak_flops_source=self.peak.source,
                       mfu=per_rank / self.peak.flops,
                       matmul_flops_per_s_measured=self.matmul_flops_measured)
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

    def _record(self, lr: float) -> dict:
        """The logging interval's training record (host values only; see `_read`)."""
        t, iv = self.config.train, self._interval
        n = len(iv.times)
        peak, source = peak_memory_bytes(self.mesh.device)
        record = {"step": self.step, "loss": statistics.fmean(iv.losses), "lr": lr,
                  "samples_per_s": t.batch_size * n / sum(iv.times),
                  "step_s": statistics.median(iv.times),
                  "data_wait_s": statistics.median(iv.waits),
                  "data_wait_fraction": statistics.median(
                      w / d for w, d in zip(iv.waits, iv.times)),
                  "peak_mem_bytes": peak, "peak_mem_source": source,
                  **self._memory_figures(),
                  "bytes_per_step": {a: b // n for a, b in
                                     self.mesh.ledger.since(iv.mark).bytes_by_axis().items()},
                  "step_losses": list(iv.losses)}
        if self.tokens_per_sample:
            record["tokens_per_s"] = record["samples_per_s"] * self.tokens_per_sample
        if self.scaler.enabled:
            record.update(loss_scale=self.scaler.scale, skipped_steps=self.skipped_steps)
        if isinstance(self.model, PipelineModel):
            record.update(self._pipeline_timeline())
        if self.compile_counter is not None and not any("loss" in h for h in self.history):
            # the first record says whether compile took effect: never a silent eager run
            compiled = self.compile_counter.figures()
            record.update(compiled_graphs=compiled["compiled_graphs"],
                          graph_breaks=compiled["graph_breaks"])
        self._interval = Interval(self.mesh.ledger.snapshot())
        return record

    def _one_step(self, batches, pending: PendingSteps, stop, watchdog, progress) -> dict | None:
        """One step and what follows it (log, evaluation, checkpoint, stop); the evaluation's
        metrics when it evaluated. Sets `_finished` when the run ends early."""
        t = self.config.train
        self.mesh.ledger.step = self.step + 1  # the step number metrics.jsonl will give it
        self.faults.at_step(self.step + 1)
        watchdog.beat()
        self.observer.step_begin()
        last = self.step + 1 == self.total_steps
        read = self._is_read_point(self.step + 1, last)
        pending.clock.begin()
        try:
            loss, lr = self._train_step(batches, measure=read)
        except torch.OutOfMemoryError as exc:
            raise torch.OutOfMemoryError(out_of_memory_advice(self, exc)) from exc
        pending.clock.end()
        pending.add(loss, self.last_grad_norm, self.last_found_inf)
        wait, nbytes = batches.take()  # this step's input wait (host seconds) and bytes
        self.observer.step_end(read)
        self.step += 1
        self._interval.waits.append(wait)
        self._run_times["waits"].append(wait)
        self._run_times["bytes"].append(nbytes)
        self.input_bytes += nbytes
        if progress:
            progress.advance()
        if read:
            self._read(pending)
        if self.step % t.log_every == 0 or last:
            record = self._record(lr)
            self.observer.log(record)
            self._log(record)
            if progress:
                progress.log(record)
        eval_metrics, reached = None, False
        if (t.eval_every and self.step % t.eval_every == 0) or last:
            eval_start = time.time()
            with watchdog.paused():  # long and collective-free under plain data parallelism
                eval_metrics = self.evaluate()
            self._log({"step": self.step, **eval_metrics})
            if progress:
                progress.log({"step": self.step, **eval_metrics})
            reached = self.observer.evaluated(eval_metrics, eval_start)  # train.target
        self.after_step()
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
            self.stopped_by_signal, self.stop_signum = True, stop.signum
            stop.announce(self)
        self._finished = reached or stopping
        return eval_metrics

    @contextlib.contextmanager
    def _process_settings(self):
        """Process-wide state the steps change, given back when they end: the global random
        generators (each step seeds them, so dropout masks replay on resume; the caller's
        streams return, so user code never sees them reset) and, on a GPU, cuDNN's autotuning
        (`parallel.cudnn_benchmark`)."""
        benchmark = torch.backends.cudnn.benchmark
        with torch.random.fork_rng(devices=_rng_devices(self.mesh.device)):
            if self.mesh.device.type == "cuda":
                torch.backends.cudnn.benchmark = self.config.parallel.cudnn_benchmark
            try:
                yield
            finally:
                torch.backends.cudnn.benchmark = benchmark

    def fit(self) -> dict:
        # the second step: the first one also allocates what persists (communication buckets,
        # FSDP2's lazy initialisation), which is not activation memory
        self._track_step = self.step + (1 if self.total_steps - self.step > 1 else 0)
        self._finished = False
        self.compile_counter = CompileCounter() if self.config.parallel.compile else None
        batches = self._batches(self.step)
        pending = PendingSteps(self.mesh.device)
        self._interval = Interval(self.mesh.ledger.snapshot())
        self._run_times: dict[str, list] = {"times": [], "waits": [], "bytes": []}
        start = time.perf_counter()
        eval_metrics: dict[str, float] = {}
        progress = self.console.progress(self.total_steps, self.step) if self.console else None
        self.observer.fit_begin()
        stop = StopOnSignal().install()
        watchdog = Watchdog(self.mesh.ledger, self.mesh.rank, self.run_dir,
                            self.config.run.timeout_s).start(self.mesh.world_size)
        try:
            with self._process_settings():
                while self.step < self.total_steps:
                    eval_metrics = self._one_step(batches, pending, stop, watchdog, progress) \
                        or eval_metrics
                    if self._finished:
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
        t, step_times = self.config.train, self._run_times["times"]
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
                   **self._input_figures(step_times, self._run_times["waits"],
                                         self._run_times["bytes"]),
                   "precision": self.precision.name,
                   "stopped_by_signal": self.stopped_by_signal,
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
        summary.update(self.observer.summary(start))
        if self.stage_figures:  # staging is part of the time it took to train
            summary.update(self.stage_figures)
            if "time_to_train_s" in summary:
                summary["time_to_train_s"] += self.stage_figures["stage_s"]
        summary.update(self.job_figures)
        if self.is_main and self.run_dir:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        # the tracked runs (W&B, MLflow) end with the job, which may still fail after this fit
        # (a population's final exchange): its owner calls observer.finished
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


def _rng_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose generator states `fork_rng` saves: this rank's, or none on CPU."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]
