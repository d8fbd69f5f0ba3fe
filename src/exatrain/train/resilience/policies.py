"""What a run does when a step goes wrong: non-finite loss, out of memory.

Non-finite loss or gradient (`train.on_nonfinite`): "stop" (the default) raises `NonFiniteLoss`
naming the step and the last good checkpoint; "skip" drops that step's update (the gradients are
zeroed, the optimizer does not step, the step still counts so the data position and LR schedule
stay those of an uninterrupted run), counts it in `nonfinite_skipped` and logs the step number
metrics.jsonl uses; after `train.max_nonfinite_skips` skips the next one stops the run. The
verdict uses the global gradient norm, identical on every rank, so all ranks skip together.

Corrupt or out-of-range sample (`train.on_bad_sample`): "stop" (the default) lets the reader's
error through (it names file and index); "skip" (`SkipBadSamples`) logs file, index and error to
RUN_DIR/bad_samples.jsonl and serves the next readable sample in its place, so the batch keeps its
size and every rank its step count; more than `MAX_BAD_IN_A_ROW` unreadable samples in a row stop
the run (the data set itself is broken).

Out of memory: the error names what in this run's Plan and options would lower memory.
"""

from __future__ import annotations

import json
import sys
import time

from torch.utils.data import Dataset

from ...errors import DataError, UserError


class NonFiniteLoss(UserError, RuntimeError):
    """Training produced a NaN or infinite loss or gradient; the last checkpoint is intact.

    What to do: lower `optim.lr`, add warm-up, or set `train.on_nonfinite = "skip"`; resume from
    the checkpoint the message names.
    """


def nonfinite_error(step: int, loss: float, norm: float | None, rank: int, reached: int,
                    last_checkpoint) -> NonFiniteLoss:
    """The error for a non-finite `step` found on `rank` when the run had `reached` its step
    (later, where the verdict was read at a read point), naming the last good checkpoint."""
    what = f"gradient norm {norm}" if norm is not None else "a gradient"
    return NonFiniteLoss(
        f"step {step}: loss {loss} / {what} is not finite on rank {rank}. The optimizer skipped it"
        + (f" and every step after it up to step {reached}" if step < reached else "")
        + "; " + (f"the last good checkpoint is {last_checkpoint}. " if last_checkpoint
                  else "no checkpoint was written yet. ")
        + "Lower optim.lr, add schedule.warmup_steps, set train.clip_grad_norm, or check "
          "the data for NaNs.")

MAX_BAD_IN_A_ROW = 8


class SkipBadSamples(Dataset):
    """A map-style data set that replaces unreadable samples by the next readable one (logged)."""

    __getitems__ = None  # sample by sample, each with its own skip (not the wrapped batch read)

    def __init__(self, dataset, run_dir, rank: int):
        self.dataset, self.run_dir, self.rank = dataset, run_dir, rank
        self.skipped = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):  # bytes_read, baselines ... of the wrapped set
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index):
        for offset in range(MAX_BAD_IN_A_ROW + 1):
            i = (index + offset) % len(self.dataset)
            try:
                return self.dataset[i]
            except (ValueError, IndexError, OSError) as exc:
                self.skipped += 1
                self._log(i, exc)
        raise DataError(f"{MAX_BAD_IN_A_ROW + 1} unreadable samples in a row from index "
                        f"{index}; the data set is broken (see bad_samples.jsonl).")

    def _log(self, index: int, exc: BaseException) -> None:
        print(f"exatrain: rank {self.rank}: skipped sample {index}: {exc}", file=sys.stderr,
              flush=True)
        if self.run_dir is not None:
            with open(self.run_dir / "bad_samples.jsonl", "a") as f:
                f.write(json.dumps({"rank": self.rank, "index": index, "time": time.time(),
                                    "error": f"{type(exc).__name__}: {exc}"}) + "\n")


class NonfiniteSkips:
    """`train.on_nonfinite`'s "skip": how many non-finite steps were skipped, and whether the
    next one may be."""

    def __init__(self, on_nonfinite: str, max_skips: int, is_main: bool):
        self.on_nonfinite, self.max_skips, self.is_main = on_nonfinite, max_skips, is_main
        self.skipped = 0

    def skip(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when non-finite step `step` (1-based, as metrics.jsonl counts) is to be skipped
        (its caller then clears the gradients)."""
        if self.on_nonfinite != "skip" or self.skipped >= self.max_skips:
            return False
        self.skipped += 1
        if self.is_main:
            print(f"exatrain: step {step}: loss {loss} / gradient norm {grad_norm} is not "
                  f"finite; update skipped ({self.skipped} of at most {self.max_skips}, "
                  "train.max_nonfinite_skips)", file=sys.stderr, flush=True)
        return True


def out_of_memory_advice(plan, options, t, micro: int, rank: int, step: int,
                         state: int | None, exc: BaseException) -> str:
    """The OOM message with the Plan axes and options that would lower memory, for this run:
    `options` its `[parallel]`, `t` its `[train]`, `micro` its micro-batch, `step` (1-based) the
    step that failed, `state` the model state's bytes at the last measured step."""
    ideas = []
    if plan.shard == 1 or options.zero_stage < 3:
        ideas.append("shard the parameters, gradients and optimizer state: plan.shard=N with "
                     "parallel.zero_stage=3 (state per rank / N)")
    if plan.tensor == 1 and plan.space == (1, 1, 1):
        ideas.append("split the layers: plan.tensor=N (transformers) or plan.space=[1,1,N] "
                     "(convolutions on large volumes), activations and weights / N")
    if options.activation_checkpointing == "none":
        ideas.append("parallel.activation_checkpointing=\"full\" (recompute activations)")
    if options.precision == "fp32":
        ideas.append("parallel.precision=\"bf16\" (half the activation bytes)")
    ideas.append(f"a smaller micro-batch ({micro} samples now): raise train.grad_accum "
                 f"(now {t.grad_accum}) at the same train.batch_size={t.batch_size}")
    held = f" This rank held {state / 2**30:.2f} GiB of model state at its last step." if state else ""
    return (f"out of memory on rank {rank} at step {step} under {plan}.{held} "
            f"To lower memory: " + "; ".join(ideas) + f". ({exc})")
