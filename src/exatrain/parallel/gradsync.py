"""Gradient synchronisation driven by parameter metadata: bucketed, overlapped all-reduce.

A strategy that lays parameters out over the mesh says, per parameter, how its gradient must be
combined, and this module does it without knowing anything about the model:

    param.exatrain_grad_sum_axes  = ("tensor_z",)   ranks holding partial sums of the same gradient
                                                    (e.g. the batch split over tensor_z)
    param.exatrain_grad_mean_axes = ("data",)       replicas whose gradients are averaged

The gradient is divided by the product of the mean axes' sizes and summed over the union of both
(one all-reduce over `mesh.axis(*mean, *sum)`). Parameters with neither need no communication.

Bucketing and overlap (as DDP does, with the ledger counting every byte): parameters are grouped
by (axes, dtype, device) and packed, in reverse registration order (roughly the order in which
backward produces their gradients), into buckets of at most `bucket_cap_mb`. A post-accumulate-
grad hook marks a parameter ready; a bucket whose parameters are all ready is copied into its
flat buffer and its all-reduce launched asynchronously while backward goes on. Buckets launch
strictly in their fixed order, so every rank issues the same collectives in the same order. A
callback queued on the autograd engine runs at the end of backward: it launches what is left
(a parameter that got no gradient contributes zeros), waits for everything and copies the reduced
values back into `.grad`.

Communication per step, per rank: one SUM all-reduce of every synchronised gradient, i.e.
4·Ψ_axes bytes on each axis group for Ψ_axes fp32 parameters (the ledger's payload convention).

`no_sync()` suspends it (for gradient accumulation; the Trainer uses it when the model has one).

Deferred mode (`defer()`, used under pipeline schedules): the hooks stay off and `sync_now()`
reduces the accumulated gradients once, after the schedule. A schedule's backward does not
always run through hooks: zero-bubble schedules compute weight gradients with
`torch.autograd.grad` and add them to `.grad` by hand, which no post-accumulate hook sees.
"""

from __future__ import annotations

import contextlib
import math

import torch


from ..comm import all_reduce


def set_grad_axes(param: torch.Tensor, sum_axes=(), mean_axes=()) -> None:
    param.exatrain_grad_sum_axes = tuple(sum_axes)
    param.exatrain_grad_mean_axes = tuple(mean_axes)


def grad_axes(param: torch.Tensor) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (tuple(getattr(param, "exatrain_grad_sum_axes", ())),
            tuple(getattr(param, "exatrain_grad_mean_axes", ())))


class _Bucket:
    def __init__(self, index, params, axis, divisor):
        self.index, self.params, self.axis, self.divisor = index, params, axis, divisor
        self.numel = sum(p.numel() for p in params)
        self.buffer: torch.Tensor | None = None
        self.pending: set[int] = set()
        self.work = None
        self.launched = False


class GradSync:
    """Bucketed all-reduce of `params`' gradients over the axes their metadata names."""

    def __init__(self, params, mesh, bucket_cap_mb: float = 25.0):
        self.mesh = mesh
        self.enabled = True
        self._queued = False
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        cap = max(1, int(bucket_cap_mb * 2 ** 20))
        open_buckets: dict[tuple, list] = {}
        order: list[tuple[tuple, list]] = []   # (key, params) in creation order
        seen = set()
        for p in reversed(list(params)):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            sum_axes, mean_axes = grad_axes(p)
            axes = tuple(dict.fromkeys((*mean_axes, *sum_axes)))
            if not axes or mesh.axis(*axes).size == 1:
                continue
            key = (axes, mean_axes, p.dtype, p.device)
            current = open_buckets.get(key)
            if current is None or sum(q.numel() * q.element_size() for q in current) >= cap:
                current = []
                open_buckets[key] = current
                order.append((key, current))
            current.append(p)
        for index, ((axes, mean_axes, _dtype, _device), group) in enumerate(order):
            divisor = math.prod(mesh.axis(a).size for a in mean_axes)
            bucket = _Bucket(index, group, mesh.axis(*axes), divisor)
            self.buckets.append(bucket)
            for p in group:
                self._bucket_of[id(p)] = bucket
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for b in self.buckets for p in b.params]
        self._next = 0  # index of the next bucket to launch

    # ------------------------------------------------------------------ hooks
    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        if not self._queued:
            self._queued = True
            for b in self.buckets:
                b.pending = {id(p) for p in b.params}
                b.launched, b.work = False, None
            self._next = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket = self._bucket_of[id(param)]
        bucket.pending.discard(id(param))
        while self._next < len(self.buckets) and not self.buckets[self._next].pending:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        first = bucket.params[0]
        if bucket.buffer is None:
            bucket.buffer = torch.empty(bucket.numel, dtype=first.dtype, device=first.device)
        offset = 0
        for p in bucket.params:
            n = p.numel()
            if p.grad is None:
                bucket.buffer[offset:offset + n].zero_()
            else:
                bucket.buffer[offset:offset + n].copy_(p.grad.reshape(-1))
            offset += n
        if bucket.divisor != 1:
            bucket.buffer.div_(bucket.divisor)
        bucket.work = all_reduce(bucket.buffer, bucket.axis, tag="grad", async_op=True)
        bucket.launched = True

    def _finish(self) -> None:
        self._queued = False
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            offset = 0
            for p in bucket.params:
                n = p.numel()
                reduced = bucket.buffer[offset:offset + n].view_as(p)
                if p.grad is not None:
                    p.grad.copy_(reduced)
                else:  # unused here but not on a peer: take the sum, or this replica drifts
                    p.grad = reduced.clone()
                offset += n
            bucket.work = None

    # ------------------------------------------------------------------ public
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside the block synchronises."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def defer(self) -> None:
        """From now on reduce only when `sync_now()` is called (hooks ignored)."""
        self.enabled = False

    def sync_now(self) -> None:
        """Reduce every bucket's accumulated gradients now, in the fixed bucket order."""
        for bucket in self.buckets:
            bucket.work, bucket.launched = None, False
        self._next = 0
        self._finish()

    def bytes_per_step(self) -> dict[str, int]:
        """The formula: each bucket's payload once per step, on its axis."""
        out: dict[str, int] = {}
        for b in self.buckets:
            out[b.axis.name] = out.get(b.axis.name, 0) + b.numel * b.params[0].element_size()
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

