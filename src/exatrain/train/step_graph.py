"""The whole step as one CUDA graph (`parallel.cuda_graphs = true`, `cuda_graphs_scope = "step"`).

torch.compile's "reduce-overhead" mode (the "compiled" scope) records the compiled regions as
CUDA graphs; the loss, the gradient clipping and the optimizer's step still launch kernel by
kernel between them. Here `train.step.TrainStep.run` (forward and backward of every micro-batch,
the gradient norm and clipping, the non-finite verdict, the fused optimizer's step) is recorded
once and replayed every step, with one launch per step:

    steps 1..warmup     eager, on a side stream (torch's recipe for whole-network capture:
                        compiled code compiles, cuBLAS and the optimizer's state are created),
                        the optimizer already as it will be recorded (each learning rate a
                        device tensor, `capturable`)
    step warmup+1       the micro-batches copied into static buffers, then the step recorded
                        (nothing runs while recording) and replayed
    every later step    the batch copied into the static buffers, the learning rate written
                        into its tensor (`TrainStep.begin`), one replay; the loss, the norm and
                        the verdict copied out (the next replay overwrites them)

A batch of another shape (a last, shorter batch) runs eagerly, the recorded step untouched.

What the recording needs, refused by name before the first step where it is missing
(`step_graph_refusal`): one rank and no activation checkpointing (its blocks read the random
state on the host; both in `parallel.options.cuda_graphs_refusal`); a fused optimizer
(its `found_inf` skips a non-finite step on the device; a for-each step reads its step count on
the host); the deferred verdict (`train.on_nonfinite = "stop"`, no hook acting on a non-finite
step: nothing read on the host inside the step); no replica groups (their quorum is a host call).
Randomness (dropout) stays per step: the generators are seeded before each replay and a CUDA
graph's random offsets are taken from the generator at replay.

Checkpoints hold the plain form (float rates), so a recorded run resumes recorded or plain, and
a plain one recorded; a state loaded into a recorded run is written into the tensors the graph
recorded with (the rates, the moments, the step counts).

Memory: the graph keeps a private pool holding the step's activations and gradients between
replays (a compiled step without graphs frees them); `exatrain bench device` reports the peak
beside the compiled step's.
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import ConfigError
from ..parallel.nested import map_tensors, tensors_of
from .step import StepResult

WARMUP_STEPS = 3   # eager steps before the recording (torch's whole-network recipe uses 3)


def step_graph_refusal(optimizer, defers: bool, replicas) -> str | None:
    """Why this step cannot be recorded as one graph (with the fix); None when it can."""
    fix = "or set parallel.cuda_graphs_scope='compiled'"
    if not optimizer.defaults.get("fused"):
        return ("parallel.cuda_graphs_scope='step' records the optimizer's step, which needs a "
                "fused optimizer (optim.impl='auto' or 'fused', optim.name adamw, adam or sgd): "
                f"the others read their step count on the host. Set optim.impl='fused', {fix}.")
    if replicas is not None:
        return ("parallel.cuda_graphs_scope='step' does not run with [fault_tolerance] (each "
                f"step's quorum and commit are host calls). Turn fault_tolerance off, {fix}.")
    if not defers:
        return ("parallel.cuda_graphs_scope='step' needs the non-finite verdict on the device "
                "(train.on_nonfinite='stop', no hook acting on a non-finite step): a step that "
                f"reads it on the host cannot be recorded. Set train.on_nonfinite='stop', {fix}.")
    return None


class CudaGraphCapture:
    """Records a function as one CUDA graph on `device` and replays it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graph, self.outputs = None, None
        self.side_stream = None   # one for every eager step: the allocator caches per stream

    def eager(self, fn):
        """A warm-up step on a side stream (the recipe's: what it allocates stays out of the
        default stream's way)."""
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(self.device)
        stream = self.side_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            out = fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return out

    def record(self, fn) -> None:
        """Record `fn`. "thread_local": the input path's threads (prefetch, pinning) keep
        allocating while this thread records, which the default "global" mode would refuse.
        A recompile would read the random state on the host mid-recording: named instead."""
        self.graph = torch.cuda.CUDAGraph()
        with torch.compiler.set_stance("fail_on_recompile"), \
                torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.outputs = fn()

    def replay(self):
        """Run the recorded step; its outputs (the same tensors every replay)."""
        self.graph.replay()
        return self.outputs


class WholeStepGraph:
    """A `TrainStep` whose `run` is recorded once and replayed (the module doc). Called like
    the `TrainStep` it wraps; `capture` records and replays (`CudaGraphCapture`)."""

    def __init__(self, step, capture, micro_batches: int, warmup: int = WARMUP_STEPS):
        self.step, self.capture = step, capture
        self.micro_batches, self.warmup = micro_batches, warmup
        self.static: list[tuple[torch.Tensor, ...]] | None = None
        self.recorded = False
        self.eager_steps = 0        # steps run without the graph (warm-up, odd shapes)
        self.state_bytes: dict | None = None   # the model state's bytes, from an eager step
        self.replays = 0

    def __getattr__(self, name):  # rank, halted, ...: the wrapped step's
        return getattr(self.step, name)

    def __call__(self, batches, step: int, lr: float, defers: bool, measure: bool,
                 peak) -> StepResult:
        if not self.eager_steps and not self.recorded:  # the first step: can it be recorded?
            # (here, not when built: a run's hooks may move the verdict to the host until fit)
            refusal = step_graph_refusal(self.step.optimizer, defers, self.step.replicas)
            if refusal:
                raise ConfigError(refusal)
            # the warm-up steps run the optimizer as it will be recorded (tensor rates, capturable)
            self._optimizer_for_recording()
        micro = [next(batches) for _ in range(self.micro_batches)]
        fits = self.static is not None and all(
            len(tensors_of(m)) == len(tensors_of(s)) and all(
                a.shape == b.shape and a.dtype == b.dtype
                for a, b in zip(tensors_of(m), tensors_of(s))) for m, s in zip(micro, self.static))
        if not self.recorded and self.eager_steps < self.warmup or \
                self.recorded and not fits:
            self.eager_steps += 1
            result = self.capture.eager(
                lambda: self.step(iter(micro), step, lr, defers, True, peak))
            self.state_bytes = result.state_bytes
            if not measure:
                result.state_bytes = None
            return result
        if not self.recorded:
            self.static = [map_tensors(m, lambda t: t.detach().clone()) for m in micro]
            self.step.begin(step, lr)
            self.capture.record(lambda: self.step.run(
                iter(self.static), step, defers, False, contextlib.nullcontext()))
            self.recorded = True
        else:
            for m, s in zip(micro, self.static):   # (x, y), x one tensor or several
                for source, target in zip(tensors_of(m), tensors_of(s)):
                    target.copy_(source, non_blocking=True)
            self.step.begin(step, lr)
        with peak:
            out = self.capture.replay()
        self.replays += 1
        result = StepResult(out.loss.detach().clone(),
                            None if out.grad_norm is None else out.grad_norm.detach().clone(),
                            out.found_inf.detach().clone())
        # the state's size is the warm-up steps' (measured with their gradients alive; a replay
        # leaves none outside the graph's pool to count)
        result.state_bytes = self.state_bytes if measure else None
        return result

    def _optimizer_for_recording(self) -> None:
        """Each group's learning rate as a tensor on its parameters' device (the recorded
        optimizer reads it there; `TrainStep.begin` writes each step's rate into it), and
        `capturable` on where the optimizer has it: torch's Adam and AdamW refuse to step inside
        a recording without (their step counts are device tensors already, being fused).

        Checkpoints keep the plain form (a float rate, `capturable` as it was), so any run
        resumes from them. A state loaded while recorded is written into the tensors the graph
        reads: the rates, and the per-parameter state (moments, step counts), which
        `Optimizer.load_state_dict` would otherwise replace with new tensors where the loaded
        ones need a copy (another device or dtype), leaving the graph on freed memory."""
        optimizer = self.step.optimizer
        held: dict = {}   # the per-parameter state tensors before a load (the graph's)
        before = [g.get("capturable") for g in optimizer.param_groups]
        rates = []
        for group in optimizer.param_groups:
            # (also a tensor rate a checkpoint brought back, which may sit on the host)
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32,
                                       device=group["params"][0].device)
            rates.append(group["lr"])
            if "capturable" in group:
                group["capturable"] = True

        def plain_form(_optimizer, state: dict) -> dict:
            for group, capturable in zip(state["param_groups"], before):
                group["lr"] = float(group["lr"])
                if capturable is not None:
                    group["capturable"] = capturable
            return state

        def hold_the_state(_optimizer, state_dict):
            held.clear()
            held.update({p: dict(st) for p, st in optimizer.state.items()})
            return state_dict

        @torch.no_grad()
        def into_the_recorded_tensors(_optimizer) -> None:
            for group, rate in zip(optimizer.param_groups, rates):
                rate.fill_(float(group["lr"]))
                group["lr"] = rate
                if "capturable" in group:
                    group["capturable"] = True
            for param, recorded in held.items():
                now = optimizer.state.get(param)
                for key, tensor in recorded.items() if now else ():
                    loaded = now.get(key)
                    if isinstance(tensor, torch.Tensor) and isinstance(loaded, torch.Tensor) \
                            and loaded is not tensor and loaded.shape == tensor.shape:
                        tensor.copy_(loaded)
                        now[key] = tensor
            held.clear()

        optimizer.register_state_dict_post_hook(plain_form)
        optimizer.register_load_state_dict_pre_hook(hold_the_state)
        optimizer.register_load_state_dict_post_hook(into_the_recorded_tensors)

__all__ = ["CudaGraphCapture", "WholeStepGraph", "step_graph_refusal", "WARMUP_STEPS"]
