"""The plain-PyTorch training loop of `exatrain bench device`, with each speed lever a switch.

No exatrain in the loop: the model is a deep copy of the workload's plain module (the same
weights exatrain starts from), batches come from `torch.utils.data.DataLoader` over the
workload's data set in the Trainer's sample order (epoch e: `numpy.random.default_rng([seed,
e]).permutation(n)`, consecutive slices of the batch size), the workload's on-device decode is
applied to the copied batch, and the step is autocast forward -> fp32 loss -> backward ->
AdamW step.

Levers (`Levers`), each a switch the bench flips on its own from `PLAIN` (fp32, eager, a
for-loop AdamW, the math attention kernel, contiguous layout):

  precision        bf16 or fp16 autocast (fp16 with `torch.amp.GradScaler`), with channels-last
                   layout of convolution weights and inputs and `cudnn.benchmark`
  compile          `torch.compile` of the model
  cuda_graphs      `torch.compile(mode="reduce-overhead")` of the model (CUDA graphs) and of the
                   optimizer step: static shapes only
  optimizer        "forloop" | "foreach" | "fused" AdamW
  attention        "math" (the reference kernel) | "auto" (SDPA picks flash / memory-efficient)
  fp8              float8 training of the Linear layers (torchao's `convert_to_float8_training`)
                   under bf16 autocast

A lever the device cannot pull is refused before any work with a message saying why
(`refusal`): CUDA graphs need a CUDA device; fp8 needs compute capability 8.9 (Ada, Hopper)
and torchao; bf16 needs Ampere or newer. `cudnn.benchmark` is a no-op on a CPU.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from ..data.batches import plain_collate

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}


@dataclass(frozen=True)
class Levers:
    precision: str = "fp32"        # fp32 | bf16 | fp16 | fp8
    channels_last: bool = False
    cudnn_benchmark: bool = False
    compile: bool = False
    cuda_graphs: bool = False
    optimizer: str = "forloop"     # forloop | foreach | fused
    attention: str = "math"        # math | auto

    def replace(self, **changes) -> "Levers":
        return dataclasses.replace(self, **changes)


PLAIN = Levers()


def best_practice(precision: str, compile: bool = True) -> Levers:
    """The baseline: autocast, channels-last, cuDNN benchmark, fused AdamW, compile, SDPA."""
    return Levers(precision=precision, channels_last=True, cudnn_benchmark=True, compile=compile,
                  optimizer="fused", attention="auto")


# Each lever on its own, as a change from PLAIN.
LEVERS = {
    "bf16": PLAIN.replace(precision="bf16", channels_last=True, cudnn_benchmark=True),
    "fp16": PLAIN.replace(precision="fp16", channels_last=True, cudnn_benchmark=True),
    "compile": PLAIN.replace(compile=True),
    "cuda_graphs": PLAIN.replace(cuda_graphs=True),
    "foreach": PLAIN.replace(optimizer="foreach"),
    "fused": PLAIN.replace(optimizer="fused"),
    "sdpa": PLAIN.replace(attention="auto"),
    "fp8": PLAIN.replace(precision="fp8"),
}


def refusal(levers: Levers, device: torch.device, model: nn.Module | None = None) -> str | None:
    """Why `levers` cannot run on `device` (what would make them run); None when they can."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if levers.cuda_graphs and not cuda:
        return (f"CUDA graphs need a CUDA device; this run is on {device.type}: the lever is "
                "refused here (on a GPU it compiles the step with mode='reduce-overhead').")
    if levers.precision == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        return "bf16 needs a GPU with bf16 support (Ampere or newer); use the fp16 lever."
    if levers.precision == "fp8":
        from ..parallel.float8 import float8_refusal
        return float8_refusal(device, model)
    return None


def notes(levers: Levers, device: torch.device, model: nn.Module) -> str:
    """What a lever does not do on this device or model (a no-op, not a refusal)."""
    out = []
    if levers.cudnn_benchmark and torch.device(device).type != "cuda":
        out.append("cudnn.benchmark is a no-op on a CPU")
    if levers.attention != "math" and not any("Attention" in type(m).__name__
                                              for m in model.modules()):
        out.append("the model has no attention: the SDPA kernel choice is a no-op")
    return "; ".join(out)


def sample_batches(n: int, batch: int, steps: int, seed: int) -> list[list[int]]:
    """The Trainer's sample order at one process: epoch e permutes all n samples with the seed
    (seed, e); step s of an epoch takes the s-th slice of `batch`; a partial last slice is dropped."""
    per_epoch = n // batch
    out: list[list[int]] = []
    epoch = 0
    while len(out) < steps:
        order = np.random.default_rng([seed, epoch]).permutation(n)
        out.extend(order[s * batch:(s + 1) * batch].tolist() for s in range(per_epoch))
        epoch += 1
    return out[:steps]


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if t.dim() == 5:
        return t.contiguous(memory_format=torch.channels_last_3d)
    return t


def _optimizer(params, levers: Levers, optim) -> torch.optim.Optimizer:
    """AdamW at the config's hyperparameters on the lever's kernel (forloop, foreach, fused)."""
    from ..optim.factory import build_optimizer
    return build_optimizer(params, dataclasses.replace(optim, name="adamw"), optim.lr,
                           impl=levers.optimizer)


def train_plain(model: nn.Module, dataset, loss_fn, decode, levers: Levers, device, optim,
                batch: int, warmup: int, steps: int, seed: int, workers: int,
                compile_backend: str = "inductor", window=None) -> dict:
    """Train a copy of `model` for warmup + steps steps (and `window.steps` more, profiled by
    `window`, a `device_profile.Window`); returns losses, step times, peak memory.

    Step times come from CUDA timing events (the host clock on a CPU), read after the last step:
    the loop never waits for the device, as a best-practice loop does not."""
    from ..observe.step_meters import StepClock
    extra = window.steps if window is not None else 0
    device = torch.device(device)
    cuda = device.type == "cuda"
    model = copy.deepcopy(model).to(device)
    if hasattr(model, "channels_last"):  # CosmoFlow's own input conversion: the lever decides
        model.channels_last = False
    if levers.channels_last:
        for p in model.parameters():
            p.data = _channels_last(p.data)
    if levers.precision == "fp8":  # the same layers as exatrain's parallel.precision='fp8'
        from ..parallel.float8 import convert_linears
        convert_linears(model)
    optimizer = _optimizer(model.parameters(), levers, optim)
    forward, opt_step = model, optimizer.step
    if levers.compile or levers.cuda_graphs:
        mode = "reduce-overhead" if levers.cuda_graphs else None
        forward = torch.compile(model, backend=compile_backend, mode=mode)
        if levers.cuda_graphs:
            opt_step = torch.compile(optimizer.step, backend=compile_backend, mode=mode)
    dtype = DTYPES[levers.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=levers.precision == "fp16")
    if levers.attention == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        attention = lambda: sdpa_kernel(SDPBackend.MATH)  # noqa: E731
    else:
        attention = contextlib.nullcontext
    loader = DataLoader(dataset, batch_sampler=sample_batches(len(dataset), batch,
                                                              warmup + steps + extra, seed),
                        num_workers=workers, pin_memory=cuda,
                        collate_fn=plain_collate(dataset),
                        persistent_workers=False, prefetch_factor=2 if workers else None)
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = levers.cudnn_benchmark
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses, waits, clock = [], [], StepClock(device)
    try:
        batches = iter(loader)
        for _ in range(warmup + steps + extra):
            t0 = time.perf_counter()
            clock.begin()
            x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = decode(x) if decode is not None else x
            if levers.channels_last:
                x = _channels_last(x)
            waited = time.perf_counter() - t0
            with attention():
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    output = forward(x)
                loss = loss_fn(output.float(), y)
                scaler.scale(loss).backward()
            if scaler.is_enabled():
                scaler.unscale_(optimizer)
                scaler.step(optimizer)
                scaler.update()
            else:
                opt_step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            clock.end()
            waits.append(waited)
            if window is not None:
                window.step()
    finally:
        torch.backends.cudnn.benchmark = benchmark
        if window is not None:
            window.stop()
    times = clock.read()[:warmup + steps]
    waits = waits[:warmup + steps]
    losses = losses[:warmup + steps]
    timed = times[warmup:] or times
    peak, source = _peak_memory(device)
    return {"losses": [float(v) for v in losses], "step_s_median": statistics.median(timed),
            "data_wait_fraction": statistics.median(w / t for w, t in
                                                    zip(waits[warmup:] or waits, timed)),
            "peak_memory_bytes": peak, "peak_memory_source": source}


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_peak_rss"


def default_workers() -> int:
    """Loader workers for the baseline: exatrain's own policy for one rank on this node (the
    cores this process may use, less one, up to 8), so both paths read with as many."""
    from ..data.loader import loader_workers
    return loader_workers(-1, local_ranks=1)
