"""Memory accounting per rank: model state (parameters, gradients, optimizer state) and the peak
memory of a step's forward and backward.

Model state, `state_bytes(model, optimizer)` — counted, on every device:
  the distinct tensor storages reachable from the model's parameters, from the parameters the
  optimizer steps (ZeRO-1/2 shards, offloaded master copies), from their `.grad`s and from
  `optimizer.state`, each storage counted once (views share their storage: a ZeRO-1/2 shard that
  is a view of the full parameter adds nothing), by its allocated size (so FSDP2's dim-0 padding
  counts, and a parameter FSDP2 has freed by resizing its storage to 0 counts 0). Storages on the
  CPU while the model runs on a GPU are also reported as `offloaded_bytes`. The Trainer measures
  this at the optimizer step — right after `optimizer.step()` and before the gradients are
  released — when parameters, gradients and the (lazily created) optimizer state are all alive.

Peak step memory, `StepPeak` — the most memory held at once during forward and backward, above
what was allocated when the step began (parameters, optimizer state, persistent buffers):
  cuda   measured: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` at the step's
         start, minus `memory_allocated` then (source "cuda_allocator").
  cpu    tracked: a `TorchDispatchMode` sees every op run during the step and adds the bytes of each
         output storage no input shares (a fresh allocation) to a live total, removing them when
         the storage is freed; the peak of that total is reported (source "cpu_tracked_storages").
         Memory allocated outside PyTorch's dispatcher is not seen: kernel-internal scratch
         space and FSDP2's unsharded parameters, which it re-materialises by resizing storage
         in place (they are parameters, not activations; `state_bytes` counts them if alive).
         The tracker slows the step it watches, so the Trainer tracks one step per `fit` (the
         second: the first also allocates persistent buffers and initialises FSDP2). That step
         runs eager under `parallel.compile` (a dispatch mode under a compiled frame would make
         the compiler give up on that code for good), so its figure is eager's activations.
  Both figures are dominated by activations (what autograd saves for backward, and what
  checkpointing recomputes); they also include gradients that backward allocates anew and
  transient communication buffers.

Peak memory of the process, `peak_memory_bytes(device)` — the summary's `peak_mem_bytes`: the CUDA
allocator's maximum on GPUs, the process's peak resident set on CPU.

`zero_state_formula` gives the ZeRO paper's bytes per rank for comparison.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import weakref
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _plain_tensors(t):
    """The plain tensors holding a (possibly subclass, e.g. DTensor) tensor's data."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):  # (DTensor also lists its DeviceMesh)
                yield from _plain_tensors(inner)
    elif t.layout == torch.sparse_coo:  # sparse tensors own no storage: their parts do
        yield from (t._indices(), t._values())
    elif t.layout == torch.sparse_csr:
        yield from (t.crow_indices(), t.col_indices(), t.values())
    elif t.layout == torch.strided:
        yield t


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr()), storage.nbytes()


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes of parameters, gradients and optimizer state held by this rank (see module doc)."""
    seen: set = set()
    totals = {"params": 0, "grads": 0, "optimizer": 0}
    offloaded = 0
    model_device = next((t.device for p in model.parameters() for t in _plain_tensors(p)), None)

    def count(kind: str, tensor) -> None:
        nonlocal offloaded
        if not isinstance(tensor, torch.Tensor):
            return
        for t in _plain_tensors(tensor):
            key, size = _storage_key(t)
            if key[2] == 0 or key in seen:
                continue
            seen.add(key)
            totals[kind] += size
            if model_device is not None and model_device.type != "cpu" and t.device.type == "cpu":
                offloaded += size

    params = list(model.parameters())
    if optimizer is not None:
        params += [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        count("params", p)
    for p in params:
        count("grads", p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                count("optimizer", value)
    totals["total"] = sum(totals.values())
    totals["offloaded_bytes"] = offloaded
    return totals


def zero_state_formula(stage: int, numel: int, world: int, mixed: bool = False) -> float:
    """Bytes per rank of parameters + gradients + Adam state for Ψ=`numel`, N=`world` (ZeRO paper).

    fp32 AdamW (4 + 4 + 8 bytes per parameter): stage 0 16Ψ, 1 8Ψ + 8Ψ/N, 2 4Ψ + 12Ψ/N, 3 16Ψ/N.
    Mixed precision (`mixed`; the paper's 2 + 2 + 12 split: fp16 parameters and gradients, fp32
    master weights and moments): 0 16Ψ, 1 4Ψ + 12Ψ/N, 2 2Ψ + 14Ψ/N, 3 16Ψ/N.
    """
    p, g, o = (2, 2, 12) if mixed else (4, 4, 8)
    psi, n = float(numel), float(world)
    if stage == 0:
        return (p + g + o) * psi
    if stage == 1:
        return (p + g) * psi + o * psi / n
    if stage == 2:
        return p * psi + (g + o) * psi / n
    if stage == 3:
        return (p + g + o) * psi / n
    raise ValueError(f"ZeRO stage {stage} does not exist; stages are 0 (none) to 3.")


class _StorageTracker(TorchDispatchMode):
    """Live bytes of storages allocated by ops while active, and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict = {}
        self.current = 0
        self.peak = 0

    def _free(self, key, size):
        if self.live.pop(key, None) is not None:
            self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            for t in _plain_tensors(leaf):
                if t.device.type == "meta":
                    continue
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key == 0 or key in self.live:
                    continue
                if inputs is None:  # an output sharing an input's storage is a view or in place
                    inputs = {x.untyped_storage().data_ptr()
                              for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
                              for x in _plain_tensors(a) if x.device.type != "meta"}
                if key in inputs:
                    continue
                size = storage.nbytes()
                self.live[key] = size
                self.current += size
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key, size)
        return out


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Peak memory of this rank and where the number comes from."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_peak_rss"


class StepPeak:
    """Measures the peak memory of the code inside `track()` above what was allocated before."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.bytes: int | None = None
        self.source = "cuda_allocator" if self.device.type == "cuda" else "cpu_tracked_storages"

    @contextmanager
    def track(self):
        if self.device.type == "cuda":
            # the caching allocator's counters move when work is queued, not when it runs: no
            # wait for the device is needed to read them
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            yield self
            self.bytes = torch.cuda.max_memory_allocated(self.device) - base
        else:
            tracker = _StorageTracker()
            with _eager(), tracker:
                yield self
            self.bytes = tracker.peak


def _eager():
    """The tracked step runs eager. A TorchDispatchMode active under a compiled frame makes
    Dynamo skip that frame's code for good: every later variant of the model's forward (the
    evaluation's, a new batch shape, another model of the same class) then ran eager, silently,
    while the compile report still counted the first graph. Without Dynamo loaded nothing is
    compiled, and nothing is imported here."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


__all__ = ["StepPeak", "state_bytes", "zero_state_formula"]
