"""One optimizer step: forward and backward over the micro-batches, unscale, the finiteness
verdict, the optimizer's step. `TrainStep` holds what a step uses and nothing else; the loop around
it (`train.trainer`) decides the learning rate, when to read the device and what follows a step.

Deferred verdict (`defers`): nothing is read from the device. A non-finite step is skipped by the
optimizer's own kernel (`found_inf`, as `torch.amp.GradScaler` has fused optimizers do) and under
`train.on_nonfinite = "stop"` every step after it too (`halted`), until the loop's next read point
raises `NonFiniteLoss` naming it. Otherwise the verdict is read on the host every step and the
non-finite policy (`resilience.policies.NonfiniteSkips`) skips the step or it raises.

Replica groups (`[fault_tolerance]`, `resilience.replicas`): the micro-batches are taken once,
and forward, backward and the average over the groups run until every group commits the attempt;
the finiteness verdict and the optimizer step then act on the groups' average. Under
`fault_tolerance.sync = "local_sgd" | "diloco"` the step is the plain one, and the groups
synchronise inside the optimizer's step every `sync_every` steps (`resilience.replica_sync`).

Determinism: each step's random streams (dropout) are seeded from (seed, step, rank), so a
resumed run replays them without stored RNG state; `process_settings` gives the caller's random
streams (and cuDNN's autotuning setting) back when the steps end.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..parallel.data import unwrap
from ..parallel.nested import call_on, fp32
from ..workloads.user import float64_input_named
from ..optim.factory import match_grad_layouts
from ..optim.gradnorm import clip_grad_norm_, decided_locally, found_nonfinite
from ..parallel.pipe.model import PipelineModel
from ..observe.memory_meters import state_bytes
from ..optim.schedule import lr_at


@dataclass
class LrSchedule:
    """The learning rate of each step: `peak_lr` (a population member's hyperparameter: it
    changes between steps) shaped by the job's `[schedule]` (warm-up, decay)."""
    peak_lr: float
    total_steps: int
    options: object  # config.schedule

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        o = self.options
        return lr_at(step, self.peak_lr, self.total_steps, o.warmup_steps, o.decay,
                     o.min_lr_ratio)


@dataclass
class StepResult:
    loss: torch.Tensor                # this rank's loss, on the device
    grad_norm: torch.Tensor | None    # the global gradient norm (None where nothing needed it)
    found_inf: torch.Tensor           # 1 where the step's gradients were not finite (device)
    state_bytes: dict | None = None   # model-state bytes at the optimizer step, when measured
    healed_to: int | None = None      # replica groups: the step a peer's state brought us to


class TrainStep:
    def __init__(self, model, optimizer, workload, train_options, mesh, precision, scaler, phase,
                 new_graph_iteration, nonfinite_skips, nonfinite_error, seed: int,
                 replicas=None, seed_rank: int | None = None, autocast_cache: bool = True):
        # the workload's loss_fn is looked up at each step (it may be replaced between steps)
        self.model, self.optimizer, self.workload = model, optimizer, workload
        self.options, self.device = train_options, mesh.device
        self.rank = mesh.rank if seed_rank is None else seed_rank  # dropout's stream
        # [fault_tolerance]: the replica axis (resilience.replicas.ReplicaGroups), else None
        self.replicas = replicas
        self.precision, self.scaler, self.phase = precision, scaler, phase
        self.new_graph_iteration = new_graph_iteration
        self.autocast_cache = autocast_cache  # off when the step is recorded (train.step_graph)
        self.nonfinite_skips, self.nonfinite_error, self.seed = nonfinite_skips, nonfinite_error, seed
        # what clipping and unscaling act on: the tensors the optimizer steps (ZeRO-1/2: shards)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        # a CPU step that clips nothing and defers its verdict needs no norm, only finiteness:
        # a fused check stands in for it where this rank's gradients decide (gradnorm)
        self.finiteness_only = (self.device.type == "cpu" and train_options.clip_grad_norm <= 0
                                and decided_locally(self.params, getattr(model, "norm_axis", None)))
        self.halted = torch.zeros((), device=self.device)  # on_nonfinite = "stop", deferred

    def __call__(self, batches, step: int, lr: float, defers: bool, measure: bool,
                 peak) -> StepResult:
        """Optimizer step `step` (0-based) at learning rate `lr`; `measure`: count the model
        state's bytes; `peak`: the context that tracks this step's activation memory."""
        self.begin(step, lr)
        return self.run(batches, step, defers, measure, peak)

    def begin(self, step: int, lr: float) -> None:
        """The host's settings of step `step`: the learning rate (written into a tensor learning
        rate, which a recorded step reads), the random streams, training mode."""
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._seed(step)
        if not (self.model.training and unwrap(self.model).training):
            self.model.train()  # (evaluation restores the mode: a walk per step costs CPU steps)

    def run(self, batches, step: int, defers: bool, measure: bool, peak) -> StepResult:
        """The device's work of the step `begin` set up: forward and backward, the verdict, the
        optimizer. With `defers` nothing in it waits for the host (a CUDA graph can record it)."""
        with peak:
            if self.replicas is None or not self.replicas.per_step:
                # (local_sgd, diloco: the groups synchronise in the optimizer's step hook)
                loss = self._forward_backward(batches)
            else:
                loss = self._replicated_forward_backward(batches, step)
        self.scaler.unscale_(self.params)
        # the norm is global (the same on every rank): every rank reaches the same verdict
        if self.finiteness_only and defers:
            grad_norm = None  # not computed: nothing uses it (see found_nonfinite)
            found_inf = found_nonfinite(self.params)
            if found_inf is None:  # no gradients at all
                found_inf = torch.zeros((), device=self.device)
        else:
            clip = self.options.clip_grad_norm
            grad_norm = clip_grad_norm_(self.params, clip if clip > 0 else math.inf,
                                        across=getattr(self.model, "norm_axis", None))
            found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
        result = StepResult(loss, grad_norm, found_inf)
        if defers:
            skip = found_inf
            if not self.scaler.enabled:  # stop: this step and every later one are skipped
                # (in place: a recorded step reads and writes this one tensor every replay)
                torch.maximum(self.halted, found_inf.to(self.halted.device), out=self.halted)
                skip = self.halted
            self.scaler.update(found_inf)
            with self.phase("optimizer"):
                self._step_unless(skip)
        elif self._decide_on_host(step, result):
            with self.phase("optimizer"):
                self.optimizer.step()
        else:
            self.model.zero_grad(set_to_none=True)
        if self.replicas:  # after the optimizer step: local_sgd and diloco heal inside it
            result.healed_to = self.replicas.take_heal()
        if measure:  # at the optimizer step: gradients still alive, optimizer state created
            result.state_bytes = state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return result

    def _forward_backward(self, batches, count: int | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch (`count`: of the step's own and a missing
        replica group's, which add to the gradient alike); this rank's loss over its own
        micro-batches (a device tensor)."""
        accum = self.options.grad_accum
        if isinstance(self.model, PipelineModel):  # micro-batches run by the schedule
            x, y = next(batches)
            with float64_input_named(x):
                return torch.tensor(self.model.train_step(   # float64: a float64 model's digits
                    x, y, lambda output, target: self.workload.loss_fn(fp32(output), target)),
                    dtype=torch.float64)
        loss_sum = None
        count = count or accum
        for micro in range(count):
            x, y = next(batches)
            sync = micro == count - 1 or not hasattr(self.model, "no_sync")
            with (self.model.no_sync() if not sync else contextlib.nullcontext()):
                self.new_graph_iteration()
                with self.precision.autocast(self.autocast_cache), self.phase("forward"), \
                        float64_input_named(x):
                    output = call_on(self.model, x)
                loss = self.workload.loss_fn(fp32(output), y)  # (several tensors: each)
                if accum > 1:  # (a division by one would cost a kernel and a backward node)
                    loss = loss / accum
                with self.phase("backward"):
                    self.scaler.scale_loss(loss).backward()
            if micro < accum:
                loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        return loss_sum

    def _replicated_forward_backward(self, batches, step: int) -> torch.Tensor:
        """[fault_tolerance]: forward and backward, the gradients averaged over the replica
        groups, until every group commits the attempt; a discarded attempt (a group died in it)
        runs again on the same micro-batches, so no committed step is ever redone."""
        micro = [next(batches) for _ in range(self.options.grad_accum)]
        while True:
            self.replicas.begin_step()  # the quorum (and a peer's heal) during the forward
            # batch = "keep": the micro-batches of groups missing from this step, covered here
            adopted = self.replicas.adopted_micro_batches(step)
            loss = self._forward_backward(iter(micro + adopted), len(micro) + len(adopted))
            self.replicas.reduce_gradients(self.params)
            if self.replicas.should_commit():  # applies a peer's state first when healing
                return loss
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
            healed = self.replicas.healed_to
            if healed is not None and healed != step:
                # a peer's state was applied although the attempt was discarded: the retry is
                # the peer's step, and this group takes part in it, so it must train on that
                # step's micro-batches, not on those of the step it was at
                step = healed
                self._seed(step)
                micro = self.replicas.own_micro_batches(step)

    def _step_unless(self, skip: torch.Tensor) -> None:
        """The optimizer's step, skipped by its own kernel where `skip` is 1 (no host read)."""
        match_grad_layouts(self.params)  # gradients laid out as their parameters (fused kernels)
        # on the parameters' device (CPU offload keeps them on the host); a rank with nothing
        # to train (a pipeline stage of frozen layers) steps an empty group
        first = next((p for g in self.optimizer.param_groups for p in g["params"]), None)
        self.optimizer.found_inf = skip.to(device=first.device if first is not None
                                           else self.device, dtype=torch.float32)
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf

    def _decide_on_host(self, step: int, result: StepResult) -> bool:
        """The verdict read on the host (policies that act per step): True to step."""
        finite = not bool(result.found_inf)
        if not finite and not self.scaler.enabled:
            loss, norm = float(result.loss), float(result.grad_norm)
            if self.nonfinite_skips.skip(step + 1, loss, norm):
                return False
            raise self.nonfinite_error(step + 1, loss, norm)
        if self.scaler.enabled and not finite:
            result.state_bytes = state_bytes(self.model, self.optimizer)
        return self.scaler.update(not finite)

    def _seed(self, step: int) -> None:
        """Seed this step's random streams (dropout) from (seed, step, rank): the CPU generator
        and this rank's CUDA generator, directly (torch.manual_seed seeds every device type)."""
        seed = hash((self.seed, step, self.rank)) % 2 ** 63
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            index = self.device.index
            torch.cuda.default_generators[torch.cuda.current_device() if index is None
                                          else index].manual_seed(seed)


@contextlib.contextmanager
def process_settings(device: torch.device, cudnn_benchmark: bool):
    """Process-wide state the steps change, given back when they end: the global random
    generators (each step seeds them, so dropout masks replay on resume; the caller's streams
    return, so user code never sees them reset) and, on a GPU, cuDNN's autotuning
    (`parallel.cudnn_benchmark`)."""
    benchmark = torch.backends.cudnn.benchmark
    with torch.random.fork_rng(devices=_rng_devices(device)):
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = cudnn_benchmark
        try:
            yield
        finally:
            torch.backends.cudnn.benchmark = benchmark


def _rng_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose generator states `fork_rng` saves: this rank's, or none on CPU."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]
