"""A pipeline stage whose sends are counted on the `pipe` axis and whose work is timestamped.

Communication (torch.distributed.pipelining's point-to-point ops, batched isend/irecv to the
neighbouring stages' ranks): per micro-batch, each stage boundary carries the activations forward
and their gradients backward, `2 · A` bytes for A activation bytes at that boundary. Per step and
over all ranks:

    p2p bytes = 2 · m · Σ_boundaries A_b        (m micro-batches; S stages have S − 1 boundaries)

Each rank records what it sends (tag "act" forward, "grad" backward) on the ledger's `pipe` axis,
so a rank's count is its outgoing share and the sum over ranks is the formula above.

The timeline records (stage, micro-batch, kind, start, end) around each forward (F), backward (B:
input gradients, or input and weight gradients together) and weight-gradient (W, zero-bubble
schedules) call with `time.perf_counter` -- monotonic and shared by the processes of one node --
synchronising the device first on GPUs, so that a box ends when its work does.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch.distributed.pipelining import PipelineStage

from ...comm import Axis
from ...comm.collectives import nbytes
from ..nested import rebuild, skeleton, tensors_of


class Timeline:
    """Work spans of this rank's stages during the current step."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self.events: list[dict] = []
        self.step_start = self.step_end = 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def begin_step(self) -> None:
        self.events = []
        self.step_start = self._now()

    def end_step(self) -> None:
        self.step_end = self._now()

    @contextmanager
    def span(self, stage: int, microbatch: int, kind: str):
        start = self._now()
        try:
            yield
        finally:
            self.events.append({"rank": self.rank, "stage": stage, "microbatch": microbatch,
                                "kind": kind, "start_s": start, "end_s": self._now()})

    def idle_fraction(self) -> float:
        """Share of this rank's step spent not computing: its bubble (and its waits)."""
        span = self.step_end - self.step_start
        busy = sum(e["end_s"] - e["start_s"] for e in self.events)
        return max(0.0, 1.0 - busy / span) if span > 0 else 0.0


class CountedStage(PipelineStage):
    """`PipelineStage` with explicit shapes, counted sends and a timeline."""

    def __init__(self, module, stage_index: int, num_stages: int, device: torch.device,
                 input_args, output_args, axis: Axis, timeline: Timeline):
        super().__init__(module, stage_index, num_stages, device, input_args=input_args,
                         output_args=output_args, group=axis.group)
        self.axis, self.timeline = axis, timeline
        # a last stage whose module returns a dict, a namedtuple or nested tensors: the
        # structure, for the loss (None: a tensor or a flat tuple of them, passed as it is)
        self.output_template = None
        self.outputs: list | None = None   # when a list: each micro-batch's output (evaluation)

    def _count(self, ops, tag: str):
        for op in ops:
            self.axis.ledger.record(self.axis.name, "send", nbytes(op.tensor), tag)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        return self._count(super().get_fwd_send_ops(fwd_chunk_id), "act")

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        return self._count(super().get_bwd_send_ops(bwd_chunk_id), "grad")

    def forward_maybe_with_nosync(self, *args, **kwargs):
        # zero-bubble's split backward (torch's stage_backward_input) detaches the stage output
        # in place, which a view does not allow (a stage of only a Flatten failed, or hung its
        # peer): hand it a tensor of its own. Point-to-point sends need a contiguous tensor, and
        # a stage may end in another layout (a transpose, channels-last convolutions)
        out = super().forward_maybe_with_nosync(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return self._flat(out)
        if not out.is_contiguous():
            return out.contiguous()
        return out.clone() if out._base is not None else out

    def _flat(self, out):
        # torch's stage takes a flat tuple of tensors (after the backward it detaches each one
        # of a last stage's output in place): a dict or namedtuple failed in the first backward
        if type(out) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in out):
            return out
        self.output_template = skeleton(out)
        return tuple(tensors_of(out))

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        with self.timeline.span(self.stage_index, fwd_chunk_id, "F"):
            out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if self.is_last and self.output_template is not None:
            out = rebuild(self.output_template, out)   # the loss takes what the model returned
        if self.outputs is not None:
            self.outputs.append(out)
        return out

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        with self.timeline.span(self.stage_index, bwd_chunk_id, "B"):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        with self.timeline.span(self.stage_index, bwd_chunk_id, "W"):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
