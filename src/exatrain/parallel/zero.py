"""ZeRO stages 1 and 2 over the `shard` axis: `ZeroDataParallel`, its buckets and its
optimizer state in the `Shard(0)` checkpoint form; stage 3 (FSDP2) and the choice between the
stages are in `parallel.shard`, whose docstring holds the state and byte formulas of all three.

Stages 1 and 2 (`ZeroDataParallel`): gradients are collected per bucket (`parallel.bucket_cap_mb`,
filled in reverse registration order, the order backward produces them) with post-accumulate-grad
hooks; a bucket's collective is launched asynchronously as soon as its last gradient arrives, so
communication overlaps the rest of backward; a callback at the end of backward waits for them.
Stage 2 copies each bucket's gradients rank-major into a send buffer (each rank's chunks
contiguous, as FSDP2 does), frees the full gradients, and reduce-scatters straight into the
rank's persistent shard-gradient buffer. After `optimizer.step()` a step hook all-gathers the
updated chunks back into the full parameters, bucket by bucket.

Communication per optimizer step, per rank (Ψ_N = Ψ padded to whole chunks of N = shard ranks):
  stage 1   all-reduce of all gradients over data+shard       4Ψ     tag grad
            all-gather of updated parameters over shard       4Ψ_N   tag param
  stage 2   reduce-scatter of gradients over shard            4Ψ_N   tag grad
            all-reduce of the shard's gradients over data     4Ψ_N/N tag grad (D > 1)
            all-gather of updated parameters over shard       4Ψ_N   tag param

Offload (`parallel.offload`): the optimizer's fp32 copy of the rank's chunks, their gradients and
the optimizer state stay on the host; the reduced chunks are copied to the host, the optimizer
steps there, and the new chunks are copied back before the all-gather.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import all_gather_into, all_reduce, reduce_scatter_into
from ..comm.dtensor import local_tensor
from ..mesh import Mesh
from ..errors import ParallelizeError

_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def clean_fqn(name: str) -> str:
    """A parameter name without wrapper levels (checkpoint, compile), as checkpoints key it."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def _chunk_rows(rows: int, n: int, r: int) -> tuple[int, int, int]:
    """(chunk, lo, hi): chunk size and the row range rank r owns (torch.chunk's rule)."""
    chunk = -(-rows // n)
    lo = min(r * chunk, rows)
    return chunk, lo, min(lo + chunk, rows)


@dataclass
class _Entry:
    """One parameter: its name, full tensor, owned rows and the optimizer's tensor for them."""
    fqn: str
    param: nn.Parameter
    chunk: int           # rows per chunk (padded)
    lo: int
    hi: int
    row: int             # elements per row
    shard: nn.Parameter  # what the optimizer steps: a view of param[lo:hi], or a host copy
    offset: int = 0      # stage 1: start of the full gradient in its bucket's gradient buffer
    seg_offset: int = 0  # start of its chunk in one rank's segment of the bucket
    host_grad: torch.Tensor | None = None  # offload: the chunk's gradient on the host


@dataclass
class _Bucket:
    entries: list = field(default_factory=list)
    numel: int = 0            # elements of its parameters (the bucket cap counts these)
    segment: int = 0          # elements of one rank's chunks (padded rows)
    grad_flat: torch.Tensor | None = None   # stage 1: full gradients; stage 2: the rank's shard
    ready: int = 0            # gradients arrived in this backward
    launched: bool = False
    work: object = None       # the async collective's handle (None on a size-1 axis)
    send: torch.Tensor | None = None  # stage 2: kept alive until the reduce-scatter completes


class ZeroDataParallel(nn.Module):
    """ZeRO stage 1 or 2 around `module` (see the module docstring).

    The optimizer must step `shard_parameters()` and be registered with `bind_optimizer`
    (`optim.factory.build_optimizer_for` does both). `no_sync()` accumulates full gradients locally.
    """

    def __init__(self, module: nn.Module, mesh: Mesh, stage: int, offload: bool = False,
                 bucket_cap_mb: float = 25.0, partial_axes: tuple[str, ...] = ()):
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(f"ZeroDataParallel implements ZeRO stages 1 and 2, not {stage}.")
        self.module = module
        self.stage, self.offload = stage, offload
        # partial_axes (space): ranks holding partial sums of the same gradients, summed in the
        # same collective as the data replicas (see apply.gradient_reduction)
        self.shard_axis, self.data_axis = mesh.axis("shard"), mesh.axis("data", *partial_axes)
        self.grad_axis = mesh.axis("data", "shard", *partial_axes)  # stage 1: all at once
        self.replicas = mesh.plan.shard * mesh.plan.data
        self.shard_mesh = mesh.device_mesh["shard"]
        shard_axis = self.shard_axis
        self.device = mesh.device
        self._sync = True
        self._pending = False
        n, r = shard_axis.size, shard_axis.rank
        norm_axes = (shard_axis,)
        # the buckets' and the master weights' dtype: the parameters' own, float32 or float64
        # (a float64 model's gradients reduced and stepped in float64, as one process's are)
        self.dtype = next((p.dtype for p in module.parameters() if p.requires_grad),
                          torch.float32)
        entries = []
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if p.dim() == 0:
                raise ParallelizeError(
                    f"parameter {clean_fqn(name)!r} is a scalar; ZeRO shards "
                    "parameters along dim 0. Make it shape (1,), or use plan.shard=1.")
            if p.dtype not in (torch.float32, torch.float64):
                raise ParallelizeError(
                    f"parameter {clean_fqn(name)!r} is {p.dtype}; ZeRO-1/2 keep fp32 (or "
                    "float64) parameters (the master weights). Build the model in fp32 and "
                    "set parallel.precision='bf16' or 'fp16' for low-precision compute.")
            if p.dtype != self.dtype:
                raise ParallelizeError(
                    f"parameter {clean_fqn(name)!r} is {p.dtype} where others are "
                    f"{self.dtype}; ZeRO-1/2 reduce every gradient in buffers of one dtype. "
                    f"Build the model in one dtype (model.double() or model.float()), or use "
                    f"parallel.zero_stage=3.")
            if not p.is_contiguous():
                raise ParallelizeError(
                    f"parameter {clean_fqn(name)!r} is not contiguous; ZeRO needs "
                    "contiguous parameters (call .contiguous() when creating it).")
            chunk, lo, hi = _chunk_rows(p.shape[0], n, r)
            own = p.detach()[lo:hi]
            if offload:  # the optimizer's fp32 copy of the chunk, and its gradient, on the host
                shard = nn.Parameter(torch.empty(own.shape, dtype=self.dtype, device="cpu"))
                shard.data.copy_(own)
                host_grad = torch.zeros_like(shard)
            else:
                shard = nn.Parameter(own)  # shares the parameter's storage: no extra memory
                host_grad = None
            # the gradient chunks are split over `shard` and equal over `data` (optim.gradnorm),
            # and over the axes a tensor-parallel layer already split the parameter over
            shard.exatrain_norm_axes = norm_axes + tuple(getattr(p, "exatrain_norm_axes", ()))
            entries.append(_Entry(clean_fqn(name), p, chunk, lo, hi, p[0].numel(), shard,
                                  host_grad=host_grad))
        self._entries = entries
        self._buckets = self._make_buckets(entries, bucket_cap_mb)
        self._bucket_of = {}
        for b in self._buckets:
            for e in b.entries:
                self._bucket_of[id(e.param)] = b
                e.param.register_post_accumulate_grad_hook(self._grad_ready)
        self._entry_of = {id(e.param): e for e in entries}

    # ------------------------------------------------------------------ layout
    def _make_buckets(self, entries, cap_mb: float) -> list[_Bucket]:
        cap = max(1, int(cap_mb * 2 ** 20 / (torch.finfo(self.dtype).bits // 8)))
        buckets, current = [], _Bucket()
        for e in reversed(entries):  # backward produces gradients roughly in reverse order
            if current.entries and current.numel + e.param.numel() > cap:
                buckets.append(current)
                current = _Bucket()
            current.entries.append(e)
            current.numel += e.param.numel()
        if current.entries:
            buckets.append(current)
        for b in buckets:
            full, seg = 0, 0
            for e in b.entries:
                e.offset, e.seg_offset = full, seg
                full += e.param.numel()
                seg += e.chunk * e.row
            b.segment = seg
            if self.stage == 1:  # persistent full-gradient buffer; p.grad are views into it
                b.grad_flat = torch.zeros(full, dtype=self.dtype, device=self.device)
                for e in b.entries:
                    e.param.grad = self._full_grad_view(b, e)
            elif not self.offload:  # persistent buffer of this rank's gradient chunks
                b.grad_flat = torch.zeros(seg, dtype=self.dtype, device=self.device)
            # (with offload, stage 2 allocates it per backward and frees it once on the host)
        return buckets

    def _full_grad_view(self, b: _Bucket, e: _Entry) -> torch.Tensor:
        return b.grad_flat[e.offset:e.offset + e.param.numel()].view_as(e.param)

    def _shard_grad_view(self, b: _Bucket, e: _Entry) -> torch.Tensor:
        if self.stage == 1:
            return self._full_grad_view(b, e)[e.lo:e.hi]
        return b.grad_flat[e.seg_offset:e.seg_offset + (e.hi - e.lo) * e.row].view(e.shard.shape)

    def shard_parameters(self) -> list[nn.Parameter]:
        """The tensors the optimizer steps: this rank's chunk of every parameter."""
        return [e.shard for e in self._entries]

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the full gradients (stage 1 zeroes its buffers in place, keeping the views)."""
        if self.stage == 1:
            for b in self._buckets:
                b.grad_flat.zero_()
                for e in b.entries:
                    e.param.grad = self._full_grad_view(b, e)
        else:
            self.module.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate full gradients locally; the next synchronised backward reduces the sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _grad_ready(self, param: torch.Tensor) -> None:
        b = self._bucket_of[id(param)]
        e = self._entry_of[id(param)]
        if self.stage == 1:
            view = self._full_grad_view(b, e)
            if param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad)  # the grad was reset to None: adopt the new one
                param.grad = view
        if not self._sync:
            return
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        b.ready += 1
        if b.ready == len(b.entries):
            self._launch(b)

    @torch.no_grad()
    def _launch(self, b: _Bucket) -> None:
        """Start bucket b's gradient reduction (asynchronously)."""
        if b.launched:
            return
        b.launched = True
        if self.stage == 1:
            b.grad_flat.div_(self.replicas)
            b.work = all_reduce(b.grad_flat, self.grad_axis, tag="grad", async_op=True)
            return
        n = self.shard_axis.size
        send = torch.zeros(n * b.segment, dtype=self.dtype, device=self.device)
        rows = send.view(n, b.segment)
        for e in b.entries:
            g = e.param.grad
            if g is None:
                continue  # unused in this backward: contributes zeros
            width = e.chunk * e.row
            flat = g.reshape(-1)
            full_rows = e.param.shape[0] // e.chunk  # chunks that are complete
            if full_rows:
                rows[:full_rows, e.seg_offset:e.seg_offset + width].copy_(
                    flat[:full_rows * width].view(full_rows, width))
            rest = flat[full_rows * width:]
            if rest.numel():
                rows[full_rows, e.seg_offset:e.seg_offset + rest.numel()].copy_(rest)
            e.param.grad = None  # the full gradient is freed: ZeRO-2 keeps only the chunk
        send.div_(self.replicas)
        if b.grad_flat is None:
            b.grad_flat = torch.empty(b.segment, dtype=self.dtype, device=self.device)
        b.work = reduce_scatter_into(b.grad_flat, send, self.shard_axis, tag="grad",
                                     async_op=True)
        b.send = send

    @torch.no_grad()
    def _finish_backward(self) -> None:
        """End of a synchronised backward: launch what is left, wait, expose the shard grads."""
        self._pending = False
        for b in self._buckets:
            self._launch(b)
        for b in self._buckets:
            if b.work is not None:
                b.work.wait()
            b.work, b.send, b.ready, b.launched = None, None, 0, False
            if self.stage == 2:
                all_reduce(b.grad_flat, self.data_axis, tag="grad")
        for b in self._buckets:
            for e in b.entries:
                g = self._shard_grad_view(b, e)
                if self.offload:
                    e.host_grad.copy_(g)
                    e.shard.grad = e.host_grad
                else:
                    e.shard.grad = g
            if self.offload and self.stage == 2:
                b.grad_flat = None  # the gradients now live on the host

    def defer(self) -> None:
        """Pipeline stages: reduce only when `sync_now()` is called, after the schedule (its
        zero-bubble weight pass adds to `.grad` by hand, past the hooks; see gradsync.py)."""
        self._sync = False

    @torch.no_grad()
    def sync_now(self) -> None:
        """Reduce the gradients accumulated so far (hooks off), as a synchronised backward would."""
        if self.stage == 1:  # a gradient assigned by hand: move it into the bucket's buffer
            for b in self._buckets:
                for e in b.entries:
                    view = self._full_grad_view(b, e)
                    if e.param.grad is not None and e.param.grad.data_ptr() != view.data_ptr():
                        view.copy_(e.param.grad)
                        e.param.grad = view
        self._finish_backward()

    # ------------------------------------------------------------------ after the step
    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Register the step hook that gathers updated parameters after every optimizer step."""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not {id(e.shard) for e in self._entries} <= ids:
            raise ValueError("the optimizer must step exactly ZeroDataParallel.shard_parameters(); "
                             "build it with exatrain.optim.factory.build_optimizer_for.")
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.gather_parameters())

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """All-gather every rank's updated chunks into the full parameters; reset gradients."""
        n = self.shard_axis.size
        for b in self._buckets:
            send = torch.zeros(b.segment, dtype=self.dtype, device=self.device)
            for e in b.entries:
                if self.offload:
                    e.param.detach()[e.lo:e.hi].copy_(e.shard.detach(), non_blocking=True)
                own = e.param.detach().reshape(-1)[e.lo * e.row:e.hi * e.row]
                send[e.seg_offset:e.seg_offset + own.numel()].copy_(own)
            recv = torch.empty(n * b.segment, dtype=self.dtype, device=self.device)
            all_gather_into(recv, send, self.shard_axis, tag="param")
            rows = recv.view(n, b.segment)
            for e in b.entries:
                width = e.chunk * e.row
                flat = e.param.detach().view(-1)
                full_rows = e.param.shape[0] // e.chunk
                if full_rows:
                    flat[:full_rows * width].view(full_rows, width).copy_(
                        rows[:full_rows, e.seg_offset:e.seg_offset + width])
                rest = flat[full_rows * width:]
                if rest.numel():
                    rest.copy_(rows[full_rows, e.seg_offset:e.seg_offset + rest.numel()])
            if self.stage == 1:
                b.grad_flat.zero_()

    # ------------------------------------------------------------------ checkpoints
    @torch.no_grad()
    def refresh_shards(self) -> None:
        """After the full parameters were overwritten (a checkpoint load): update host copies."""
        if self.offload:
            for e in self._entries:
                e.shard.copy_(e.param.detach()[e.lo:e.hi])

    def _as_dtensor(self, local: torch.Tensor, e: _Entry):
        from torch.distributed.tensor import DTensor, Shard
        return DTensor.from_local(local, self.shard_mesh, [Shard(0)], run_check=False,
                                  shape=e.param.shape, stride=e.param.stride())


def zero_optimizer_state_dict(units: list[ZeroDataParallel], optimizer) -> dict:
    """The optimizer state of one or more ZeRO units (a pipeline rank's stages) keyed like
    `torch.distributed.checkpoint.state_dict`'s: by parameter name, per-element state as
    `Shard(0)` DTensors over the shard mesh (views of the live state, so loading into it writes
    the optimizer's tensors in place)."""
    entries = [(unit, e) for unit in units for e in unit._entries]
    fqn_of = {id(e.shard): e.fqn for _, e in entries}
    state = {}
    for unit, e in entries:
        st = optimizer.state.get(e.shard)
        if not st:
            continue
        state[e.fqn] = {k: unit._as_dtensor(v, e) if isinstance(v, torch.Tensor)
                        and v.dim() > 0 and v.shape == e.shard.shape else v
                        for k, v in st.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [fqn_of[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def zero_load_optimizer_state_dict(units: list[ZeroDataParallel], optimizer, loaded: dict) -> None:
    """Copy a state dict loaded into `zero_optimizer_state_dict`'s skeleton back into `optimizer`."""
    by_fqn = {e.fqn: e for unit in units for e in unit._entries}
    for fqn, values in loaded["state"].items():
        st = optimizer.state[by_fqn[fqn].shard]
        for k, v in values.items():
            if isinstance(v, torch.Tensor):
                local = local_tensor(v)
                if k in st and isinstance(st[k], torch.Tensor):
                    if st[k].data_ptr() != local.data_ptr():
                        st[k].copy_(local)
                else:
                    st[k] = local.clone()
            else:
                st[k] = v
    for group, saved in zip(optimizer.param_groups, loaded["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


def zero_units(model: nn.Module) -> list[ZeroDataParallel]:
    """The ZeRO-1/2 wrappers that train `model`: itself, or each of a pipeline rank's stages."""
    if isinstance(model, ZeroDataParallel):
        return [model]
    return [s for s in getattr(model, "stage_wrappers", ()) if isinstance(s, ZeroDataParallel)]


__all__ = ["ZeroDataParallel", "clean_fqn", "zero_load_optimizer_state_dict",
           "zero_optimizer_state_dict", "zero_units"]
