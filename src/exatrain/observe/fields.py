"""What every figure of a run's summary.json and metrics.jsonl means: one table, in one place.

The summary printer of `exatrain run` formats each value by the unit given here, and the
documentation's *Run summary* reference page (docs/hooks.py) is generated from these tables.
tests/test_summary_fields.py runs a small job and fails when it writes a key that has no row.

A name with `<...>` stands for a family of keys: `val_<metric>` is `val_mae`, `val_loss`, ...
"""

from __future__ import annotations

import dataclasses
import re

from .units import human_bytes, human_rate, human_seconds, human_value


@dataclasses.dataclass(frozen=True)
class Field:
    name: str        # the key, or a pattern with <...> parts
    unit: str        # "" for a count, a name or a flag
    meaning: str
    when: str = ""   # when the key is present; "" = always


# this rank's model state at the last optimizer step (of the run, or of the logged interval)
_STATE = (
    Field("param_bytes", "bytes", "this rank's parameters"),
    Field("grad_bytes", "bytes", "this rank's gradients"),
    Field("optimizer_bytes", "bytes", "this rank's optimizer state"),
    Field("offloaded_bytes", "bytes", "state held in host memory by CPU offload"),
    Field("state_bytes", "bytes", "the sum of parameters, gradients and optimizer state"),
    Field("peak_activation_bytes", "bytes", "peak memory of a step above the model state",
          "when the device reports it"),
    Field("peak_activation_source", "", "how the peak was measured (CUDA allocator, or the "
          "process's resident memory on a CPU)", "with peak_activation_bytes"),
)

SUMMARY: tuple[Field, ...] = (
    # what ran
    Field("steps", "", "optimizer steps taken (a resumed run counts from its start)"),
    Field("world_size", "", "ranks in the job"),
    Field("plan", "", "the Plan the run trained under, e.g. `Plan(data=2)`"),
    Field("zero_stage", "", "ZeRO stage of the shard axis (1, 2 or 3)", "plan.shard > 1"),
    Field("precision", "", "fp32, bf16 or fp16: the step's compute precision"),
    Field("run_dir", "", "the run directory: metrics.jsonl, summary.json, checkpoints/"),
    # model quality
    Field("val_<metric>", "", "the last evaluation's value of each validation metric "
          "(`val_loss`, and the workload's metrics, e.g. `val_mae` and `val_mae_<target>`)",
          "after an evaluation"),
    Field("baseline_<metric>", "", "the same metric for a trivial predictor (the workload's: predict the "
          "mean, all background, no force), to compare `val_<metric>` with", "when the workload gives one"),
    Field("final_loss", "", "the training loss of the last logged interval (mean over its steps)"),
    Field("target", "", "the stopping target, e.g. `val_mae <= 0.25`", "train.target set"),
    Field("target_reached", "", "whether an evaluation met the target", "train.target set"),
    Field("target_reached_step", "", "the step of the first evaluation that met it",
          "the target was reached"),
    Field("time_to_train_s", "s", "seconds from the start of training (staging included) to the "
          "evaluation that met the target; with mlperf.enabled run_stop - run_start of the MLPerf "
          "log, for a resumed run from its first run_start", "the target was reached"),
    # speed
    Field("samples_per_s", "samples/s", "training samples per second, whole job, median of the "
          "steady steps (the first two left out)"),
    Field("step_s_median", "s", "median seconds of a steady training step"),
    Field("tokens_per_s", "tokens/s", "samples_per_s × tokens per sample",
          "sequence workloads"),
    Field("model_flops_per_s", "FLOP/s", "the model's training FLOP/s, whole job",
          "the workload counts its FLOPs"),
    Field("peak_flops_per_s", "FLOP/s", "this rank's peak FLOP/s in the step's dtype, MFU's "
          "denominator: on a CPU cores × clock × FLOPs per cycle of its instruction set "
          "(`peak_flops_source` says where each came from); elsewhere the measured matmul rate",
          "the workload counts its FLOPs"),
    Field("peak_flops_source", "", "how `peak_flops_per_s` was worked out, each factor with "
          "its source and assumption", "the workload counts its FLOPs"),
    Field("mfu", "fraction", "model FLOP utilisation: model FLOP/s per rank over "
          "`peak_flops_per_s`", "the workload counts its FLOPs"),
    Field("matmul_flops_per_s_measured", "FLOP/s", "the rate a square matmul in the step's "
          "dtype reaches on this rank (what it sustains, beside the peak)",
          "the workload counts its FLOPs"),
    Field("wall_s", "s", "seconds of the training loop, evaluations and checkpoints included"),
    # communication
    Field("bytes_per_step", "bytes", "bytes sent per step by this rank, by mesh axis (the "
          "communication ledger), over the last logged interval"),
    Field("bandwidth_drops", "", "bus-bandwidth drops: step, axis and operation of each "
          "collective that stayed below `observe.bandwidth_drop_fraction` of its axis's median",
          "observe.bandwidth_watch, more than one rank"),
    # memory
    *_STATE,
    Field("memory_per_rank", "bytes", "every rank's `state_bytes`, `peak_activation_bytes` and "
          "peak memory (`peak_mem_bytes`); the printed table shows their maximum"),
    # input
    Field("data_wait_s_median", "s", "median seconds a steady step waited for its batch"),
    Field("data_wait_fraction", "fraction", "median share of a steady step spent waiting for "
          "input"),
    Field("data_wait_advice", "", "what would shorten the wait", "the wait exceeds 5 %"),
    Field("input_bytes_per_s", "B/s", "input bytes per second this rank consumed"),
    Field("input_bytes_per_rank", "bytes", "this rank's training input over the run, as "
          "delivered to the device"),
    Field("input_bytes_read_per_rank", "bytes", "bytes this rank's training set read from its "
          "files (loader workers included; under `space`, a data set read by blocks reads only "
          "the rank's block of each input)", "the training set counts its reads "
          "(`et.data.HDF5Dataset`, or a `read_counter` of your own)"),
    Field("input_bytes_read_per_sample", "bytes", "`input_bytes_read_per_rank` over the samples "
          "it read", "with input_bytes_read_per_rank"),
    Field("num_workers", "", "loader worker processes per rank"),
    Field("prefetch", "", "batches loaded ahead of the step (`train.prefetch`)"),
    Field("stage_s", "s", "seconds spent staging the input to `data.stage_to`",
          "data.stage_to set"),
    Field("staged_bytes", "bytes", "bytes on the staging target (copied and reused)",
          "data.stage_to set"),
    Field("stage_copied_bytes", "bytes", "bytes copied by staging", "data.stage_to set"),
    Field("stage_reused_bytes", "bytes", "bytes already on the target from an earlier run",
          "data.stage_to set"),
    Field("stage_files", "", "files staged", "data.stage_to set"),
    Field("stage_linked_files", "", "files linked instead of copied", "data.stage_to set"),
    Field("stage_copier_rank", "", "the rank that copied this node's files", "data.stage_to set"),
    Field("staged_to", "", "the staging directory", "data.stage_to set"),
    # robustness
    Field("stopped_by_signal", "", "the run stopped early on SIGTERM/SIGUSR1 (a scheduler's "
          "warning) after saving a checkpoint"),
    Field("nonfinite_skipped", "", "optimizer steps skipped because the loss or a gradient was "
          "NaN or infinite"),
    Field("loss_scale", "", "the fp16 loss scale at the end", "parallel.precision = \"fp16\""),
    Field("skipped_steps", "", "steps the fp16 loss scaler skipped",
          "parallel.precision = \"fp16\""),
    Field("launcher", "", "what started the ranks: local (exatrain run), torchrun, slurm, "
          "flux, lsf or mpirun"),
    Field("requeues", "", "times the scheduler requeued this job (SLURM_RESTART_COUNT)",
          "under Slurm"),
    Field("trackers", "", "each experiment tracker's run id and where it wrote (with `wandb "
          "sync DIR` for an offline W&B run)", "observe.trackers beyond tensorboard"),
    Field("compiled_frames", "", "Python frames torch.compile compiled (recompilations count "
          "again)", "parallel.compile = true"),
    Field("compiled_graphs", "", "graphs torch.compile handed to its backend during this run: 0 "
          "means the step ran eager, unless an earlier run in the same process compiled the "
          "same model", "parallel.compile = true"),
    Field("graph_breaks", "", "places where torch.compile split the model's frame and ran "
          "Python eagerly between graphs", "parallel.compile = true"),
    Field("graph_break_reasons", "", "the first line of each distinct graph-break reason (at "
          "most 10)", "parallel.compile = true"),
    Field("checkpoint_saves", "", "checkpoints written"),
    Field("checkpoint_blocked_s", "s", "seconds training waited for checkpoint writes"),
    Field("restarts", "", "times the job was restarted after a rank failed",
          "exatrain run --max-restarts or nproc > 1"),
    Field("restart_history", "", "per restart: the last step logged before the failure, the "
          "step resumed from and the failure", "exatrain run --max-restarts or nproc > 1"),
    Field("lost_steps", "", "steps trained again after restarts",
          "exatrain run --max-restarts or nproc > 1"),
    Field("ft_groups", "", "replica groups of the job", "[fault_tolerance] enabled"),
    Field("ft_group", "", "this run directory's replica group (0-based)", "[fault_tolerance] enabled"),
    Field("ft_heals", "", "per heal of this group: the step it rejoined at (its state copied "
          "from a live group, no checkpoint read) and when", "[fault_tolerance] enabled"),
    Field("ft_discarded_attempts", "", "step attempts not committed because a group failed "
          "inside them (the same micro-batches ran again)", "[fault_tolerance] sync = step"),
    Field("ft_pause_s_max", "s", "the longest wait between committed steps beyond the median "
          "step: what a failed group cost this one", "[fault_tolerance] sync = step"),
    Field("ft_steps_with_groups_missing", "", "steps committed while a group was out",
          "[fault_tolerance] sync = step"),
    Field("ft_batch", "", "keep or shrink: whether the groups present covered a missing "
          "group's samples", "[fault_tolerance] sync = step"),
    Field("ft_restarts", "", "times a failed replica group was started again",
          "[fault_tolerance] under exatrain run"),
    Field("ft_restart_history", "", "per group restart: the group, its exit and when",
          "[fault_tolerance] under exatrain run"),
    Field("ft_run_root", "", "the run directory holding every group's `group_KK/`",
          "[fault_tolerance] under exatrain run"),
    Field("ft_sync", "", "how the replica groups synchronise: local_sgd or diloco",
          "[fault_tolerance] sync = local_sgd | diloco"),
    Field("ft_sync_every", "", "optimizer steps between the groups' synchronisations",
          "[fault_tolerance] sync = local_sgd | diloco"),
    Field("ft_syncs", "", "synchronisations committed (a heal counts those it caught up on)",
          "[fault_tolerance] sync = local_sgd | diloco"),
    Field("reformations", "", "per re-formation of an elastic job (each start after the "
          "first): `world_sizes` [before, after], the new `plan`, `resumed_from_step`, "
          "`steps_redone`, `seconds_lost` (from the resumed checkpoint to the first step "
          "again), `grad_accum` and `micro_batch` (the global batch kept)",
          "torchrun (e.g. --nnodes MIN:MAX) after a restart"),
    Field("formations", "", "starts of an elastic job: the first and each re-formation",
          "torchrun (e.g. --nnodes MIN:MAX)"),
)

POPULATION: tuple[Field, ...] = (
    Field("trainers", "", "trainers in the population (`plan.trainer`)"),
    Field("strategy", "", "the tournament strategy (`population.strategy`)"),
    Field("trainer_plan", "", "the Plan of each trainer"),
    Field("steps_by_trainer", "", "steps each trainer took"),
    Field("best_trainer", "", "the trainer with the best final metric"),
    Field("best_<metric>", "", "the best trainer's final metric"),
    Field("final_<metric>_by_trainer", "", "every trainer's final metric"),
    Field("final_lr_by_trainer", "", "every trainer's learning rate at the end"),
    Field("transfers", "", "models sent between trainers by the tournaments"),
    Field("diverged_steps_by_trainer", "", "steps each trainer skipped as diverged"),
    Field("exchange_bytes", "bytes", "bytes of model exchange, whole job"),
    Field("best_model", "", "path of the best trainer's final weights"),
    Field("models_reached_target", "", "trainers that reached the target",
          "population.strategy = \"none\""),
    Field("models_per_minute", "models/min", "MLPerf HPC's weak-scaling score: models that "
          "reached the target over the minutes from the first instance's start to the last "
          "one's stop; with mlperf.enabled read from their MLPerf logs (run_start, run_stop), "
          "else from the trainers' clocks",
          "population.strategy = \"none\""),
    Field("time_to_train_all_s", "s", "from the first instance's run_start to the last "
          "run_stop of those that reached the target (MLPerf's time_to_train_all)",
          "population.strategy = \"none\", mlperf.enabled"),
    Field("instance_scale", "", "accelerators per model instance (number_of_nodes x "
          "accelerators_per_node of its MLPerf log)",
          "population.strategy = \"none\", mlperf.enabled"),
    Field("mlperf_results", "", "the instances' MLPerf logs as result_K.txt, the layout of a "
          "submission's results/<system>/weak/<benchmark>/ folder",
          "population.strategy = \"none\", mlperf.enabled"),
)

METRICS: tuple[Field, ...] = (
    Field("step", "", "the optimizer step the line describes"),
    Field("loss", "", "mean training loss over the interval's steps", "training lines"),
    Field("step_losses", "", "every step's training loss of the interval", "training lines"),
    Field("lr", "", "the learning rate at the step", "training lines"),
    Field("samples_per_s", "samples/s", "training samples per second over the interval, whole "
          "job", "training lines"),
    Field("tokens_per_s", "tokens/s", "samples_per_s × tokens per sample",
          "sequence workloads"),
    Field("step_s", "s", "median step seconds of the interval", "training lines"),
    Field("data_wait_s", "s", "median seconds a step waited for input", "training lines"),
    Field("data_wait_fraction", "fraction", "median share of a step spent waiting for input",
          "training lines"),
    Field("exposed_comm_s", "s", "communication the step waited for (not hidden behind "
          "compute), mean over the interval", "when measured"),
    Field("exposed_comm_fraction", "fraction", "exposed_comm_s over the mean step",
          "when measured"),
    Field("busbw_GBps", "GB/s", "bus bandwidth of the last checked collective, by mesh axis",
          "observe.bandwidth_watch, more than one rank"),
    Field("mfu", "fraction", "model FLOP utilisation over the interval (over the summary's "
          "`peak_flops_per_s`)",
          "the workload counts its FLOPs"),
    Field("peak_mem_bytes", "bytes", "this rank's peak device memory (or resident host memory "
          "on a CPU)", "training lines"),
    Field("peak_mem_source", "", "how peak_mem_bytes was measured", "training lines"),
    Field("compiled_graphs", "", "graphs torch.compile compiled so far (see the summary)",
          "the first training line, parallel.compile = true"),
    Field("graph_breaks", "", "graph breaks so far (see the summary)",
          "the first training line, parallel.compile = true"),
    *_STATE,
    Field("bytes_per_step", "bytes", "bytes sent per step by this rank, by mesh axis",
          "training lines"),
    Field("loss_scale", "", "the fp16 loss scale", "parallel.precision = \"fp16\""),
    Field("skipped_steps", "", "steps the fp16 loss scaler skipped so far",
          "parallel.precision = \"fp16\""),
    Field("bubble_fraction", "fraction", "measured idle share of a pipeline stage's step",
          "plan.pipe > 1"),
    Field("bubble_formula", "fraction", "the schedule's idle share by formula", "plan.pipe > 1"),
    Field("val_<metric>", "", "validation metrics", "evaluation lines"),
)


def _pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.sub(r"<[^>]+>", ".+", re.escape(name)) + "$")


def lookup(key: str, table: tuple[Field, ...] = SUMMARY + POPULATION) -> Field | None:
    """The row of `key`: its exact name first, then the first pattern that matches it."""
    for row in table:
        if row.name == key:
            return row
    for row in table:
        if "<" in row.name and _pattern(row.name).match(key):
            return row
    return None


def format_value(key: str, value) -> str:
    """A value as a person reads it, in the unit its row gives (the summary printer's format)."""
    row = lookup(key)
    if row is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return human_value(key, value)
    if row.unit == "bytes":
        return human_bytes(value)
    if row.unit == "s":
        return human_seconds(value)
    if row.unit == "fraction":
        return f"{100 * value:.1f} %"
    if row.unit in ("B/s", "FLOP/s", "tokens/s"):
        return human_rate(value, row.unit)
    if row.unit in ("samples/s", "models/min"):
        return f"{value:.4g} {row.unit}"
    return human_value(key, value)
