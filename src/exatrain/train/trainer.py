"""The Trainer: steps, micro-batches, schedule, clipping, evaluation, metrics, checkpoints.

Determinism: the model is initialised from `run.seed` identically on every rank; the sample order
of epoch e is a permutation seeded by (seed, e); and the random state of each step (dropout) is
reseeded from (seed, step, rank). So a run's loss curve depends only on seed and Plan, and a
resumed run continues exactly where the checkpoint left it without storing RNG state.

Batches: the global batch of step s is samples perm[s·B : (s+1)·B]; data replica r takes the r-th
of R equal slices and splits it into `grad_accum` micro-batches. With R = 1 the same samples form
the same step, which is what makes data-parallel training equal serial training.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from ..comm import all_reduce
from ..mesh import Mesh
from ..parallel.data import unwrap
from ..parallel.gradnorm import clip_grad_norm_
from ..workloads.base import Workload
from . import checkpoint
from .config import Config, micro_batch_size
from .schedule import lr_at, scaled_lr


class NonFiniteLoss(RuntimeError):
    """Training produced a NaN or infinite loss or gradient; the last checkpoint is intact."""


def build_optimizer(params, options, lr: float) -> torch.optim.Optimizer:
    if options.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=options.momentum,
                               weight_decay=options.weight_decay)
    cls = torch.optim.AdamW if options.name == "adamw" else torch.optim.Adam
    return cls(params, lr=lr, betas=tuple(options.betas), eps=options.eps,
               weight_decay=options.weight_decay)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Peak memory of this rank and where the number comes from."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_peak_rss"


class Trainer:
    def __init__(self, mesh: Mesh, workload: Workload, config: Config, model: nn.Module,
                 run_dir: Path | None = None, console=None):
        self.mesh, self.workload, self.config = mesh, workload, config
        self.model = model
        self.run_dir = Path(run_dir) if run_dir else None
        self.console = console
        self.is_main = mesh.rank == 0
        self.data_axis = mesh.axis("data")
        self.replicas = self.data_axis.size
        self.micro = micro_batch_size(config, self.replicas)
        t = config.train
        n = len(workload.train_set)
        self.steps_per_epoch = n // t.batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"train.batch_size={t.batch_size} is larger than the training set "
                             f"({n} samples); lower it or add samples.")
        if len(workload.val_set) < self.replicas:
            raise ValueError(f"the validation set has {len(workload.val_set)} samples, fewer than "
                             f"the {self.replicas} data replicas; every replica needs at least one.")
        self.total_steps = t.steps or t.epochs * self.steps_per_epoch
        s = config.schedule
        self.peak_lr = scaled_lr(config.optim.lr, t.batch_size, s.base_batch_size, s.lr_scaling)
        self.optimizer = build_optimizer(
            [p for p in model.parameters() if p.requires_grad], config.optim, self.peak_lr)
        self.step = 0
        self.history: list[dict] = []

    # ------------------------------------------------------------------ data
    def _rank_indices(self, epoch: int, first_step: int) -> list[int]:
        """This replica's sample indices for steps first_step.. of `epoch`, in order."""
        t = self.config.train
        perm = np.random.default_rng([self.config.run.seed, epoch]).permutation(
            len(self.workload.train_set))
        per_replica = t.batch_size // self.replicas
        r = self.data_axis.rank
        out: list[int] = []
        for s in range(first_step, self.steps_per_epoch):
            batch = perm[s * t.batch_size:(s + 1) * t.batch_size]
            out.extend(batch[r * per_replica:(r + 1) * per_replica].tolist())
        return out

    def _batches(self, start_step: int):
        """Yield micro-batches (x, y) from `start_step` on, epoch after epoch."""
        epoch, offset = divmod(start_step, self.steps_per_epoch)
        while True:
            loader = DataLoader(self.workload.train_set, batch_size=self.micro,
                                sampler=self._rank_indices(epoch, offset),
                                num_workers=self.config.train.num_workers,
                                pin_memory=self.mesh.device.type == "cuda",
                                # its own generator: starting an epoch must not draw from the
                                # global RNG, or dropout after a resume would differ
                                generator=torch.Generator().manual_seed(epoch))
            yield from loader
            epoch, offset = epoch + 1, 0

    def _to_device(self, batch):
        x, y = batch
        return x.to(self.mesh.device, non_blocking=True), y.to(self.mesh.device, non_blocking=True)

    # ------------------------------------------------------------------ one step
    def _train_step(self, batches) -> tuple[float, float]:
        t, accum = self.config.train, self.config.train.grad_accum
        lr = lr_at(self.step, self.peak_lr, self.total_steps, self.config.schedule.warmup_steps,
                   self.config.schedule.decay, self.config.schedule.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(hash((self.config.run.seed, self.step, self.mesh.rank)) % 2 ** 63)
        self.model.train()
        loss_sum = 0.0
        for micro in range(accum):
            x, y = self._to_device(next(batches))
            sync = micro == accum - 1 or not hasattr(self.model, "no_sync")
            with (self.model.no_sync() if not sync else contextlib.nullcontext()):
                loss = self.workload.loss_fn(self.model(x), y) / accum
                loss.backward()
            loss_sum += loss.detach().item()
        # Gradients are identical on every replica after the all-reduce, so every rank reaches
        # the same verdict on finiteness without another collective.
        max_norm = t.clip_grad_norm if t.clip_grad_norm > 0 else math.inf
        grad_norm = clip_grad_norm_(self.model.parameters(), max_norm)
        if not math.isfinite(grad_norm) or not math.isfinite(loss_sum):
            last = checkpoint.latest(self.run_dir) if self.run_dir else None
            raise NonFiniteLoss(
                f"step {self.step}: loss {loss_sum} / gradient norm {grad_norm} is not finite on "
                f"rank {self.mesh.rank}. Stopped before the optimizer step; "
                + (f"the last good checkpoint is {last}. " if last else "no checkpoint was written yet. ")
                + "Lower optim.lr, add schedule.warmup_steps, set train.clip_grad_norm, or check "
                  "the data for NaNs.")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, lr

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        model = unwrap(self.model)
        was_training = model.training
        model.eval()
        val = self.workload.val_set
        indices = list(range(len(val)))[self.data_axis.rank::self.replicas]
        sums: dict[str, torch.Tensor] = {}
        for batch in DataLoader(val, batch_size=self.micro, sampler=indices,
                                num_workers=self.config.train.num_workers):
            x, y = self._to_device(batch)
            for key, value in self.workload.metric_sums(model(x), y).items():
                sums[key] = sums.get(key, 0) + value.detach().double().cpu()
        keys = sorted(sums)
        vector = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float64) for k in keys])
        all_reduce(vector, self.mesh.axis(*self.workload.metric_axes), tag="metric")
        model.train(was_training)
        return {k: float(v) for k, v in self.workload.finalize(dict(zip(keys, vector))).items()}

    # ------------------------------------------------------------------ the loop
    def _log(self, record: dict) -> None:
        self.history.append(record)
        if self.is_main and self.run_dir:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def _save(self) -> None:
        if self.run_dir:
            checkpoint.save(self.run_dir, self.step, self.model, self.optimizer,
                            {"step": self.step, "plan": str(self.mesh.plan),
                             "world_size": self.mesh.world_size},
                            keep=self.config.train.checkpoint_keep)

    def resume(self, path: Path) -> None:
        state = checkpoint.load(path, self.model, self.optimizer)
        self.step = int(state["step"])

    def fit(self) -> dict:
        t = self.config.train
        batches = self._batches(self.step)
        ledger = self.mesh.ledger
        interval_losses, interval_times, step_times = [], [], []
        mark, start = ledger.snapshot(), time.perf_counter()
        eval_metrics: dict[str, float] = {}
        progress = self.console.progress(self.total_steps, self.step) if self.console else None
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            loss, lr = self._train_step(batches)
            if self.mesh.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            self.step += 1
            interval_losses.append(loss)
            interval_times.append(dt)
            step_times.append(dt)
            if progress:
                progress.advance(loss)
            last = self.step == self.total_steps
            if self.step % t.log_every == 0 or last:
                losses = torch.tensor(interval_losses, dtype=torch.float64)
                all_reduce(losses, self.data_axis, tag="metric")
                losses /= self.replicas
                delta = ledger.since(mark)
                n = len(interval_times)
                peak, source = peak_memory_bytes(self.mesh.device)
                record = {"step": self.step, "loss": float(losses.mean()), "lr": lr,
                          "samples_per_s": t.batch_size * n / sum(interval_times),
                          "step_s": statistics.median(interval_times),
                          "peak_mem_bytes": peak, "peak_mem_source": source,
                          "bytes_per_step": {a: b // n for a, b in delta.bytes_by_axis().items()},
                          "step_losses": losses.tolist()}
                self._log(record)
                if progress:
                    progress.log(record)
                interval_losses, interval_times, mark = [], [], ledger.snapshot()
            if (t.eval_every and self.step % t.eval_every == 0) or last:
                eval_metrics = self.evaluate()
                self._log({"step": self.step, **eval_metrics})
                if progress:
                    progress.log({"step": self.step, **eval_metrics})
            if (t.checkpoint_every and self.step % t.checkpoint_every == 0) or last:
                self._save()
        if progress:
            progress.close()
        if not eval_metrics:
            eval_metrics = self.evaluate()
        wall = time.perf_counter() - start
        # The first steps pay for warm-up (allocator, DDP bucket rebuild): leave them out.
        steady = step_times[min(len(step_times) - 1, 2):] if step_times else [float("nan")]
        summary = {**eval_metrics, **self.workload.baselines, "steps": self.step,
                   "samples_per_s": t.batch_size / statistics.median(steady),
                   "step_s_median": statistics.median(steady),
                   "world_size": self.mesh.world_size, "plan": str(self.mesh.plan),
                   "final_loss": next((h["loss"] for h in reversed(self.history) if "loss" in h), None),
                   "bytes_per_step": next((h["bytes_per_step"] for h in reversed(self.history)
                                           if "bytes_per_step" in h), {}),
                   "wall_s": wall, "run_dir": str(self.run_dir) if self.run_dir else None}
        if self.is_main and self.run_dir:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary
