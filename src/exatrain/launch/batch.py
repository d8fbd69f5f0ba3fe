"""Ready batch scripts for `exatrain run --print-batch-script {slurm,flux}`.

Both scripts ask the scheduler for a warning signal (USR1) a few minutes before the wall-time
limit; exatrain answers it by finishing the step on every rank, writing a checkpoint and exiting
cleanly. The run directory is fixed by EXATRAIN_RUN_DIR, so a requeued or resubmitted job resumes
from the last checkpoint by itself.

Slurm: `--requeue`, and a `trap` that passes the batch shell's USR1 on to the job step. When the
step has ended, a run that stopped on a signal (the wall-time warning, or `scancel --signal=USR1`
sent to the ranks) but did not finish requeues the job: same SLURM_JOB_ID, so the same run
directory, and SLURM_RESTART_COUNT, which the run's summary reports as `requeues`. So does a
step that ended without a summary after the warning came (the warning reached ranks still
starting), and a job warned before its step started (Slurm may warn up to a minute early; the
trap comes before any command that takes time, since a shell without it dies of USR1 with nothing
said): no rank starts, the requeued job starts them. The warning's file, written before the ranks
are signalled, stops ranks that srun started too late for the signal (launch.signals). A requeue
the site refuses ends the job failed, with a line that says so. A run that crashed without a
warning is not requeued.
With `[fault_tolerance]` the Slurm script starts a lighthouse and one step per replica group
instead (`batch_groups`). Flux has no requeue: resubmit the same script (the run directory is
named after the run, not the job id), or wrap it in a loop.

Every `#SBATCH` line has its own comment line above it (a comment on the same line is not
portable across Slurm versions). Resources a GPU centre needs -- GPUs per node, CPUs per task,
account, partition, QoS, constraint, and any other `--name=value` -- come from `Resources`.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field

from ..errors import ArgumentError
from .batch_groups import REQUEUE, replica_groups_body


@dataclass
class Resources:
    """What a centre asks of a job besides nodes and time; empty or 0 = not written."""
    gpus_per_node: int = 0
    cpus_per_task: int = 0
    account: str = ""
    partition: str = ""
    qos: str = ""
    constraint: str = ""
    sbatch_args: list[str] = field(default_factory=list)  # "--name=value" or "name=value"


_ARG = re.compile(r"^(--)?([a-z][a-z0-9-]*)(=(\S.*))?$")


def sbatch_arg(text: str) -> str:
    """"mail-type=END" or "--mail-type=END" -> "--mail-type=END"; anything else is refused."""
    match = _ARG.match(text.strip())
    if not match or "\n" in text:
        raise ArgumentError(f"--sbatch-arg {text!r}: write one sbatch option as NAME=VALUE or "
                         f"--NAME=VALUE (e.g. --sbatch-arg mail-type=END), or a bare flag NAME.")
    return f"--{match.group(2)}" + (f"={match.group(4)}" if match.group(3) else "")


def _directives(name: str, nodes: int, tasks_per_node: int, time: str, warn_s: int,
                res: Resources) -> list[tuple[str, str]]:
    """(comment, sbatch option) pairs, in the order they are written."""
    lines = [("the job's name in squeue and in its output file", f"--job-name={name}"),
             ("nodes", f"--nodes={nodes}"),
             ("ranks per node: one per GPU where the nodes have GPUs", f"--ntasks-per-node={tasks_per_node}")]
    if res.gpus_per_node:
        lines.append(("GPUs per node: local rank r (SLURM_LOCALID) drives GPU r, see the srun line",
                      f"--gpus-per-node={res.gpus_per_node}"))
    if res.cpus_per_task:
        lines.append(("CPU cores per rank: its loader workers and OMP_NUM_THREADS",
                      f"--cpus-per-task={res.cpus_per_task}"))
    for comment, flag, value in (("the allocation charged", "account", res.account),
                                 ("the partition (queue)", "partition", res.partition),
                                 ("the quality of service", "qos", res.qos),
                                 ("node features required, e.g. gpu", "constraint", res.constraint)):
        if value:
            lines.append((comment, f"--{flag}={value}"))
    lines += [("wall time; the run checkpoints before it and requeues itself", f"--time={time}"),
              (f"the warning: USR1 to this script {warn_s} s before the wall-time limit "
               "(Slurm may send it up to a minute early)", f"--signal=B:USR1@{warn_s}"),
              ("may be requeued: by the script on the warning, by Slurm on a node failure",
               "--requeue"),
              ("a requeued job appends to its output file", "--open-mode=append"),
              ("output file, one per job id", f"--output={name}-%j.out")]
    lines += [("given with --sbatch-arg", sbatch_arg(a)) for a in res.sbatch_args]
    return lines


SLURM_BODY = """
# the run directory outlives requeues: a requeued job resumes from its last checkpoint there
export EXATRAIN_RUN_DIR="${{EXATRAIN_RUN_DIR:-{out_dir}/{name}-$SLURM_JOB_ID}}"
# the wall-time warning reaches this shell (B:USR1), perhaps as the job starts (Slurm may send it
# up to a minute early): the trap is set before anything that takes time. The warning's file
# (this shell's only) is written first, then the ranks are signalled through srun; ranks
# that srun had not started yet find the file as they start (EXATRAIN_STOP_FILE)
export EXATRAIN_STOP_FILE="$EXATRAIN_RUN_DIR/wall_time_warning.$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}.$$"
warned=0
forward() {{
  warned=1
  mkdir -p "$EXATRAIN_RUN_DIR" && touch "$EXATRAIN_STOP_FILE"
  echo "exatrain: wall time near; the ranks checkpoint, then job $SLURM_JOB_ID requeues"
  if [[ -n ${{STEP_PID:-}} ]]; then kill -USR1 "$STEP_PID"; fi
}}
trap forward USR1

# rank 0's node holds the rendezvous (torch.distributed's TCP store)
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${{MASTER_PORT:-29500}}
# CPU threads per rank: the cores Slurm gave each task (1 without --cpus-per-task)
export OMP_NUM_THREADS=${{SLURM_CPUS_PER_TASK:-1}}

# written anew when the run stops (finished, or stopped on a signal); a crash leaves none
rm -f "$EXATRAIN_RUN_DIR/summary.json"
status=0
if [[ $warned == 0 ]]; then  # (after an early warning no rank starts: the requeued job starts them)
  # one rank per task; {gpu_comment}
  srun --kill-on-bad-exit=1 {gpu_bind}{python} -m exatrain.cli run {config} &
  STEP_PID=$!
  wait "$STEP_PID"; status=$?
  while kill -0 "$STEP_PID" 2>/dev/null; do wait "$STEP_PID"; status=$?; done
fi

# not finished: requeue (same job id, same run directory) when the run stopped on a signal
# (the warning, or `scancel --signal=USR1` to the ranks), or when the warning came and the
# ranks ended without a summary (it reached them as they started)
summary="$EXATRAIN_RUN_DIR/summary.json"
if grep -q '"stopped_by_signal": true' "$summary" 2>/dev/null || [[ $warned == 1 && ! -f $summary ]]; then
  {requeue}
fi
exit $status
"""

FLUX = """#!/bin/bash
#flux: --job-name={name}
#flux: --nodes={nodes}
#flux: --ntasks={ntasks}
#flux: --time-limit={time}
#flux: --signal=SIGUSR1@{warn_s}s
#flux: --output={name}-{{{{id}}}}.out
# Generated by `exatrain run --print-batch-script flux`. On the wall-time warning every rank
# finishes its step and checkpoints; resubmit this script to resume (same EXATRAIN_RUN_DIR).
export EXATRAIN_RUN_DIR=${{EXATRAIN_RUN_DIR:-{out_dir}/{name}}}
export MASTER_ADDR=$(flux hostlist --nth=0 instance)
export MASTER_PORT=${{MASTER_PORT:-29500}}
flux run --nodes={nodes} --ntasks={ntasks} --tasks-per-node={tasks_per_node} \\
  {python} -m exatrain.cli run {config}
"""


def batch_script(kind: str, config_path: str, config, nodes: int, tasks_per_node: int,
                 time: str = "04:00:00", warn_s: int = 180, python: str | None = None,
                 overrides: list[str] | tuple = (), resources: Resources | None = None,
                 replica_groups: int = 0, group_restarts: int = 3) -> str:
    """The script's text. `python`: the interpreter the ranks run (default: this one, so the
    job runs the environment that wrote the script); `overrides`: `--set` values passed on;
    `replica_groups`: with `[fault_tolerance]`, the groups (one step each, `batch_groups`),
    each started again up to `group_restarts` times."""
    if kind not in ("slurm", "flux"):
        raise ArgumentError(f"--print-batch-script {kind!r}: choose slurm or flux.")
    if replica_groups and kind == "flux":
        raise ArgumentError("--print-batch-script flux with [fault_tolerance]: only the Slurm "
                            "script starts replica groups; under Flux start a lighthouse and one "
                            "`flux run` per group as the long-run tutorial shows.")
    name = re.sub(r"[^\w.-]", "_", config.run.name or config.run.workload)  # a word in the script
    res = resources or Resources()
    if res.gpus_per_node and tasks_per_node > res.gpus_per_node:
        raise ArgumentError(f"--tasks-per-node {tasks_per_node} with --gpus-per-node "
                         f"{res.gpus_per_node}: one rank per GPU, so at most "
                         f"{res.gpus_per_node} ranks per node.")
    python = python or sys.executable
    args = [shlex.quote(config_path)] if config_path else []
    args += [a for s in overrides for a in ("--set", shlex.quote(s))]
    words = dict(name=name, nodes=nodes, tasks_per_node=tasks_per_node, ntasks=nodes * tasks_per_node,
                 time=time, warn_s=warn_s, out_dir=shlex.quote(str(config.run.out_dir)), python=shlex.quote(python),
                 config=" ".join(args))
    if kind == "flux":
        return FLUX.format(**words)
    head = ["#!/bin/bash",
            "# Generated by `exatrain run --print-batch-script slurm`; submit with `sbatch FILE`."]
    for comment, option in _directives(name, nodes, tasks_per_node, time, warn_s, res):
        head += [f"# {comment}", f"#SBATCH {option}"]
    if res.gpus_per_node:
        gpu = dict(gpu_bind="--gpu-bind=none ",
                   gpu_comment="every rank sees its node's GPUs and takes GPU LOCAL_RANK "
                               "(= SLURM_LOCALID),\n# so one GPU per local rank, and NCCL sees "
                               "its peers on the node for direct GPU-to-GPU copies")
    else:
        gpu = dict(gpu_bind="", gpu_comment="no GPUs asked for: ranks on CPUs (gloo)")
    if replica_groups:
        head[1] += (f"\n# [fault_tolerance]: a lighthouse and {replica_groups} replica groups, "
                    "one srun step each, a failed group started again")
        return "\n".join(head) + "\n" + replica_groups_body(
            config, replica_groups, nodes, tasks_per_node, group_restarts, res.gpus_per_node,
            words)
    requeue = REQUEUE.format(run_dir="$EXATRAIN_RUN_DIR")
    return "\n".join(head) + "\n" + SLURM_BODY.format(**words, **gpu, requeue=requeue)
