"""What a run reports: the logging interval's training record, the run's throughput (tokens/s,
model FLOP/s, MFU), its input wait, its memory figures and the pipeline's timeline.

Memory (`observe.memory_meters`): logged records carry the bytes of parameters, gradients and optimizer
state held by the rank at the optimizer step of the log step (`state_bytes`), and the peak memory
of forward + backward above the resident state (`peak_activation_bytes`, measured by the CUDA
allocator on GPUs every step, tracked per storage on CPU for one step of each `fit`).

MFU's denominator (`mfu_denominator`): on a CPU the processor's peak (`monitor.cpu_peak`),
elsewhere, or where the CPU does not say enough, the measured rate of a matrix multiply in the
step's dtype (a median of repeats, not a peak; the summary's `peak_flops_source` says which).
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from dataclasses import dataclass, field

import torch

from ..comm import all_gather_object
from ..parallel.pipe.model import PipelineModel
from ..observe.matmul_rate import measured_matmul_flops_cached
from .config import Config
from ..observe.cpu_peak import Peak, cpu_peak
from ..observe.memory_meters import peak_memory_bytes

DATA_WAIT_WARN = 0.05  # a run that waits longer than this share of its steps for input says so


@dataclass
class Interval:
    """Host values of the steps since the last log record."""
    mark: object                                  # the ledger's snapshot at its start
    losses: list = field(default_factory=list)    # mean over the data replicas
    times: list = field(default_factory=list)     # seconds
    waits: list = field(default_factory=list)     # seconds waited for input


class Records:
    """The figures of one rank's run, from what the loop measured."""

    def __init__(self, config: Config, mesh, workload, model, precision, step_peak,
                 num_workers: int, run_dir):
        self.config, self.mesh, self.workload, self.model = config, mesh, workload, model
        self.precision, self.step_peak, self.num_workers = precision, step_peak, num_workers
        self.run_dir, self.is_main = run_dir, mesh.rank == 0

    def training_record(self, step: int, lr: float, interval: Interval, state: dict,
                        scaler: dict) -> dict:
        """The logging interval's training record (host values only); `state`: the model
        state's bytes at the last measured step; `scaler`: fp16's loss-scale figures."""
        t, iv = self.config.train, interval
        n = len(iv.times)
        peak, source = peak_memory_bytes(self.mesh.device)
        record = {"step": step, "loss": statistics.fmean(iv.losses), "lr": lr,
                  "samples_per_s": t.batch_size * n / sum(iv.times),
                  "step_s": statistics.median(iv.times),
                  "data_wait_s": statistics.median(iv.waits),
                  "data_wait_fraction": statistics.median(
                      w / d for w, d in zip(iv.waits, iv.times)),
                  "peak_mem_bytes": peak, "peak_mem_source": source,
                  **self.memory_figures(state),
                  "bytes_per_step": {a: b // n for a, b in
                                     self.mesh.ledger.since(iv.mark).bytes_by_axis().items()},
                  "step_losses": list(iv.losses)}
        if self.workload.tokens_per_sample:
            record["tokens_per_s"] = record["samples_per_s"] * self.workload.tokens_per_sample
        record.update(scaler)
        if isinstance(self.model, PipelineModel):
            record.update(self.pipeline_timeline(step))
        return record

    def run_figures(self, history: list[dict], run_times: dict, memory: dict) -> dict:
        """The summary's figures of the run's steps: steady-state speed (the first steps pay for
        warm-up: allocator, DDP bucket rebuild), the last loss and bytes per step (`history`),
        `memory`, throughput and MFU, input wait. `run_times`: every step's "times", "waits"
        and input "bytes"."""
        batch, step_times = self.config.train.batch_size, run_times["times"]
        steady = step_times[min(len(step_times) - 1, 2):] if step_times else [float("nan")]
        samples_per_s = batch / statistics.median(steady)
        return {"samples_per_s": samples_per_s, "step_s_median": statistics.median(steady),
                "final_loss": next((h["loss"] for h in reversed(history) if "loss" in h), None),
                "bytes_per_step": next((h["bytes_per_step"] for h in reversed(history)
                                        if "bytes_per_step" in h), {}),
                **memory, **self.throughput(samples_per_s),
                **self.input_figures(step_times, run_times["waits"], run_times["bytes"])}

    def memory_figures(self, state: dict) -> dict:
        """This rank's model-state bytes at the last measured optimizer step (`state`) and its
        peak step memory."""
        names = {"params": "param_bytes", "grads": "grad_bytes", "optimizer": "optimizer_bytes",
                 "total": "state_bytes", "offloaded_bytes": "offloaded_bytes"}
        out = {names[k]: v for k, v in state.items()}
        if self.step_peak.bytes is not None:
            out.update(peak_activation_bytes=self.step_peak.bytes,
                       peak_activation_source=self.step_peak.source)
        return out

    @functools.cached_property
    def matmul_flops_measured(self) -> float:
        """This device's measured matmul FLOP/s in the step's dtype (measured once per process)."""
        return measured_matmul_flops_cached(self.mesh.device, self.precision.dtype)

    @functools.cached_property
    def mfu_denominator(self) -> Peak:
        """MFU's denominator, once per run (the live log and the summary share it): a peak, or
        the measured matmul rate."""
        if self.mesh.device.type == "cpu":
            peak = cpu_peak(self.precision.dtype)
            if peak is not None:
                return peak
        return Peak(self.matmul_flops_measured, "the measured matmul rate "
                    "(matmul_flops_per_s_measured): no peak is known for this device")

    def throughput(self, samples_per_s: float) -> dict:
        """Tokens/s, model FLOP/s, MFU against this device's peak and the measured matmul rate
        beside it."""
        out = {}
        if self.workload.tokens_per_sample:
            out["tokens_per_s"] = samples_per_s * self.workload.tokens_per_sample
        if self.workload.flops_per_sample and math.isfinite(samples_per_s):
            per_rank = self.workload.flops_per_sample * samples_per_s / self.mesh.world_size
            out.update(model_flops_per_s=per_rank * self.mesh.world_size,
                       peak_flops_per_s=self.mfu_denominator.flops,
                       peak_flops_source=self.mfu_denominator.source,
                       mfu=per_rank / self.mfu_denominator.flops,
                       matmul_flops_per_s_measured=self.matmul_flops_measured)
        return out

    def input_figures(self, step_times: list, waits: list, sizes: list) -> dict:
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

    def pipeline_timeline(self, step: int) -> dict:
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
                "step": step, "bubble_measured": bubble,
                "bubble_formula": model.bubble_formula(), "events": events}))
        return {"bubble_fraction": bubble, "bubble_formula": model.bubble_formula()}


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
