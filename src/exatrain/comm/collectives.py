"""Collectives over one named mesh axis (or a group of axes), each recorded in the ledger.

An `Axis` bundles what a collective needs: the process group, this rank's position in it, and the
ledger to record into. Axes of size 1 cost nothing: every collective on them returns at once and
records nothing. Asynchronous calls return the backend's work handle (or None for size 1).

CUDA tensors over gloo (ranks sharing one GPU, `EXATRAIN_SHARE_GPU=1`; NCCL refuses two ranks
on one device). Read from torch 2.13's ProcessGroupGloo: broadcast, all-reduce, reduce,
all-gather (and all_gather_into_tensor, which chunks into it), gather, scatter and all-to-all
have CUDA paths (device-to-host staging inside gloo); reduce_scatter_tensor is an all-reduce
there, so it runs too, at the cost of a full all-reduce. Two kinds have no device check and
hand the CPU a device pointer: point-to-point send/recv (a rank died in its first halo exchange
on an H200) and the coalesced all-gathers. This module uses no coalesced all-gather, and
`exchange` sends CUDA tensors through host copies (`host_only_p2p`).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .ledger import Ledger
from .timing import comm_range, timed

# The single-tensor all-gather / reduce-scatter: torch >= 2.13 names them *_single; older releases
# (2.11, 2.12: what many sites and GPU images ship) only have the *_tensor names, same semantics.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class Axis:
    """One named mesh axis (or a product of axes, names joined with "+") seen from this rank."""

    name: str
    size: int
    rank: int
    group: dist.ProcessGroup | None
    ledger: Ledger
    global_ranks: tuple[int, ...] = ()

    def global_rank(self, local_rank: int) -> int:
        """The world rank of the member at `local_rank` on this axis."""
        return self.global_ranks[local_rank]


def all_reduce(tensor: torch.Tensor, axis: Axis, op=dist.ReduceOp.SUM, tag: str = "",
               async_op: bool = False):
    if axis.size == 1:
        return None
    axis.ledger.record(axis.name, "all_reduce", nbytes(tensor), tag, peers=axis.global_ranks)
    with comm_range(axis.ledger, axis.name, "all_reduce", tag):
        work = dist.all_reduce(tensor, op=op, group=axis.group, async_op=async_op)
    return timed(work, axis.ledger, axis.name, "all_reduce", tag)


def all_reduce_future(tensor: torch.Tensor, axis: Axis, tag: str = "") -> torch.futures.Future:
    """Asynchronous SUM all-reduce returning a Future of the reduced tensor (for DDP comm hooks)."""
    if axis.size == 1:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(tensor)
        return fut
    axis.ledger.record(axis.name, "all_reduce", nbytes(tensor), tag, peers=axis.global_ranks)
    # DDP's reducer waits on this future inside C++, out of our sight: the span from launch to
    # completion is recorded instead (see Ledger.drain_async_tail)
    launched = time.perf_counter()
    with comm_range(axis.ledger, axis.name, "all_reduce", tag):
        work = dist.all_reduce(tensor, group=axis.group, async_op=True)

    def done(_f):
        axis.ledger.add_async_span(launched, time.perf_counter(), axis.name)
        # in place: the result is `tensor` itself (the fake backend's futures carry no value)
        return tensor
    return work.get_future().then(done)


def all_gather_into(output: torch.Tensor, tensor: torch.Tensor, axis: Axis, tag: str = "",
                    async_op: bool = False):
    """Gather `tensor` from every member, concatenated along dim 0 into `output`."""
    if axis.size == 1:
        output.copy_(tensor)
        return None
    axis.ledger.record(axis.name, "all_gather", nbytes(output), tag, peers=axis.global_ranks)
    with comm_range(axis.ledger, axis.name, "all_gather", tag):
        work = all_gather_single(output, tensor, group=axis.group, async_op=async_op)
    return timed(work, axis.ledger, axis.name, "all_gather", tag)


def reduce_scatter_into(output: torch.Tensor, tensor: torch.Tensor, axis: Axis,
                        op=dist.ReduceOp.SUM, tag: str = "", async_op: bool = False):
    """Sum `tensor` over members and keep this rank's dim-0 chunk in `output`."""
    if axis.size == 1:
        output.copy_(tensor)
        return None
    axis.ledger.record(axis.name, "reduce_scatter", nbytes(tensor), tag, peers=axis.global_ranks)
    with comm_range(axis.ledger, axis.name, "reduce_scatter", tag):
        work = reduce_scatter_single(output, tensor, op=op, group=axis.group, async_op=async_op)
    return timed(work, axis.ledger, axis.name, "reduce_scatter", tag)


def broadcast(tensor: torch.Tensor, axis: Axis, src: int = 0, tag: str = ""):
    """Broadcast from the member at position `src` on this axis."""
    if axis.size == 1:
        return None
    axis.ledger.record(axis.name, "broadcast", nbytes(tensor), tag, peers=axis.global_ranks)
    with comm_range(axis.ledger, axis.name, "broadcast", tag):
        return dist.broadcast(tensor, src=axis.global_rank(src), group=axis.group)


def host_only_p2p(device_type: str, backend: str) -> bool:
    """Whether point-to-point transfers of `device_type` tensors over `backend` must go through
    host memory: gloo's send and recv read and write the tensor's memory from the CPU, so a CUDA
    tensor (ranks sharing one GPU over gloo, `EXATRAIN_SHARE_GPU=1`) would be read through a
    device pointer and crash the rank (seen on an H200: the rank died in its first halo exchange)."""
    return device_type == "cuda" and backend == "gloo"


def stages_through_host(tensor: torch.Tensor, group) -> bool:
    """Whether `exchange` sends `tensor` through a host copy (`host_only_p2p`)."""
    return tensor.is_cuda and host_only_p2p("cuda", dist.get_backend(group))


class _Staged:
    """A transfer through host copies: `wait()` finishes it, then copies each received host
    buffer into its device tensor; the host copies live as long as the handle."""

    def __init__(self, work, staged: list[tuple[torch.Tensor, torch.Tensor | None]]):
        self._work, self._staged = work, staged   # (host copy, device tensor; None: a send)

    def wait(self, *args, **kwargs):
        done = self._work.wait(*args, **kwargs)
        for host, target in self._staged:
            if target is not None:
                target.copy_(host)
        return done

    def __getattr__(self, name):  # is_completed, get_future, ... act on the real handle
        return getattr(self._work, name)


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
             axis: Axis, tag: str = "", through_host=stages_through_host) -> list:
    """Batched non-blocking point-to-point: `sends`/`recvs` are (tensor, peer position on axis).

    Returns the request handles; call `.wait()` on each before reading the received tensors.
    CUDA tensors over gloo travel through host copies (`stages_through_host`): one device-to-host
    copy per send before the transfer, one host-to-device copy per receive in its `wait()`; the
    bytes on the wire are the same.
    """
    ops, staged = [], []   # staged[i]: op i's (host copy, device tensor or None for a send)
    for tensors, op, kind in ((sends, dist.isend, "send"), (recvs, dist.irecv, "recv")):
        for tensor, peer in tensors:
            axis.ledger.record(axis.name, kind, nbytes(tensor), tag,
                               peers=(axis.global_rank(peer),))
            host = None
            if through_host(tensor, axis.group) and kind == "send":
                host = tensor.to("cpu", copy=True)
            elif through_host(tensor, axis.group):
                host = torch.empty(tensor.shape, dtype=tensor.dtype)
            staged.append(None if host is None else (host, None if kind == "send" else tensor))
            ops.append(dist.P2POp(op, tensor if host is None else host, axis.global_rank(peer),
                                  group=axis.group))
    if not ops:
        return []
    with comm_range(axis.ledger, axis.name, "exchange", tag):
        works = dist.batch_isend_irecv(ops)
    if any(staged):
        if len(works) == len(ops):  # gloo: one handle per op
            works = [w if s is None else _Staged(w, [s]) for w, s in zip(works, staged)]
        else:  # one handle for the whole batch
            works = [_Staged(works[0], [s for s in staged if s is not None]), *works[1:]]
    return [timed(w, axis.ledger, axis.name, "exchange", tag) for w in works]


def broadcast_object(obj, axis: Axis, src: int = 0, tag: str = "control"):
    """Broadcast a picklable object from position `src`; returns it on every member."""
    if axis.size == 1:
        return obj
    holder = [obj]
    with comm_range(axis.ledger, axis.name, "broadcast", tag):
        dist.broadcast_object_list(holder, src=axis.global_rank(src), group=axis.group)
    axis.ledger.record(axis.name, "broadcast", len(pickle.dumps(holder[0])), tag,
                       peers=axis.global_ranks)
    return holder[0]


def all_gather_object(obj, axis: Axis, tag: str = "control") -> list:
    """Every member's picklable `obj`, in axis order, on every member."""
    if axis.size == 1:
        return [obj]
    out = [None] * axis.size
    with comm_range(axis.ledger, axis.name, "all_gather", tag):
        dist.all_gather_object(out, obj, group=axis.group)
    axis.ledger.record(axis.name, "all_gather", sum(len(pickle.dumps(o)) for o in out), tag,
                       peers=axis.global_ranks)
    return out
