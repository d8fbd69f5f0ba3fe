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

from ...errors import DataError

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


def skip_nonfinite(trainer, loss: float, grad_norm: float) -> bool:
    """True when this non-finite step is to be skipped (the gradients are then cleared)."""
    t = trainer.config.train
    if t.on_nonfinite != "skip" or trainer.nonfinite_skipped >= t.max_nonfinite_skips:
        return False
    trainer.nonfinite_skipped += 1
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.model.zero_grad(set_to_none=True)
    if trainer.is_main:
        # the step number metrics.jsonl gives this step is trainer.step + 1
        print(f"exatrain: step {trainer.step + 1}: loss {loss} / gradient norm {grad_norm} is not "
              f"finite; update skipped ({trainer.nonfinite_skipped} of at most "
              f"{t.max_nonfinite_skips}, train.max_nonfinite_skips)", file=sys.stderr, flush=True)
    return True


def out_of_memory_advice(trainer, exc: BaseException) -> str:
    """The OOM message with the Plan axes and options that would lower memory, for this run."""
    plan, options, t = trainer.mesh.plan, trainer.config.parallel, trainer.config.train
    state = trainer.last_state_bytes.get("total")
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
    ideas.append(f"a smaller micro-batch ({trainer.micro} samples now): raise train.grad_accum "
                 f"(now {t.grad_accum}) at the same train.batch_size={t.batch_size}")
    held = f" This rank held {state / 2**30:.2f} GiB of model state at its last step." if state else ""
    return (f"out of memory on rank {trainer.mesh.rank} at step {trainer.step + 1} under {plan}.{held} "
            f"To lower memory: " + "; ".join(ideas) + f". ({exc})")
