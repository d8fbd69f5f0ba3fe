"""The Slurm batch script of a job of replica groups (`[fault_tolerance]`, `--print-batch-script
slurm`): a lighthouse, one `srun` step per group, and a restart loop per group.

The script starts torchft's lighthouse (`torchft_lighthouse`, the one beside the Python that wrote
the script) on the batch host, its log `RUN/lighthouse.log`, and exports TORCHFT_LIGHTHOUSE; a
site's lighthouse instead is named by `fault_tolerance.lighthouse` in the config (no lighthouse is
written into the script) or by TORCHFT_LIGHTHOUSE set when the job is submitted (the script starts
none). Each group g is a step of its own (`srun --exact`: the steps share the allocation), its own
torch.distributed world (MASTER_ADDR: the group's first node, MASTER_PORT: the job's + g), its run
directory `RUN/group_GG` (EXATRAIN_RUN_DIR) and REPLICA_GROUP_ID=g. A group whose step fails (a
rank died, a node failed and srun ended the step) is started again at once, up to `restarts` times,
and heals from a live group while the others train on; no checkpoint is read.

Where the groups live: with at least as many nodes as groups, each group has `nodes / groups`
whole nodes (all their GPUs: `--gpu-bind=none`, GPU = local rank); with fewer nodes, each node
holds `groups / nodes` groups side by side, each with its share of the node's tasks (and, with
GPUs, one GPU per task: `--gpus-per-task=1`, so two groups never pick the same GPU).

On the wall-time warning the script writes the warning's file, then signals every step
(`scancel --signal=USR1`); no group is started (again), a group whose step was being made finds
the file as its ranks start (launch.signals), and the job requeues when a group stopped on the
signal (or has no summary after the warning), as the single-step script does. The trap is set
before anything that takes time: Slurm may send the warning early, while the lighthouse starts
(torch's import: seconds on a loaded node), and a shell without its trap dies of USR1 with
nothing said.
"""

from __future__ import annotations

import shlex

from ..errors import ArgumentError
from .lighthouse import lighthouse_flags, lighthouse_program

# a requeue the site refuses (JobRequeue=0, a partition without it) ends the job failed, said
REQUEUE = ('scontrol requeue "$SLURM_JOB_ID" || {{ echo "exatrain: scontrol requeue failed; '
           'resume by submitting this script again with EXATRAIN_RUN_DIR={run_dir}"; status=1; }}')

BODY = """
# the run directory outlives requeues; replica group g runs in RUN/group_GG
run_root="${{EXATRAIN_RUN_DIR:-{out_dir}/{name}-$SLURM_JOB_ID}}"
# the wall-time warning reaches this shell (B:USR1), perhaps as the job starts (Slurm may send it
# up to a minute early, while the lighthouse starts): the trap is set before anything that takes
# time. The warning's file (this shell's only) is written first, then every group's ranks
# are signalled; no group starts after it, and ranks whose step was being made as the signal went
# out find the file as they start (EXATRAIN_STOP_FILE)
export EXATRAIN_STOP_FILE="$run_root/wall_time_warning.$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}.$$"
forward() {{
  mkdir -p "$run_root" && touch "$EXATRAIN_STOP_FILE"
  echo "exatrain: wall time near; the ranks checkpoint, then job $SLURM_JOB_ID requeues"
  scancel --signal=USR1 "$SLURM_JOB_ID"
}}
trap forward USR1
mkdir -p "$run_root"
# CPU threads per rank: the cores Slurm gave each task (1 without --cpus-per-task)
export OMP_NUM_THREADS=${{SLURM_CPUS_PER_TASK:-1}}
hosts=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
# group g's own rendezvous (torch.distributed's TCP store) on its first node, port MASTER_PORT + g
base_port=${{MASTER_PORT:-29500}}
{lighthouse}
# replica group $1 on $2 node(s), $3 task(s), from node $4 of the job: its srun step, started
# again when it fails (up to {restarts} times); a restarted group heals from a live group
group() {{
  local k=$1 starts=0 status dir
  dir="$run_root/group_$(printf %02d "$k")"
  while :; do
    if [[ -f $EXATRAIN_STOP_FILE ]]; then
      echo "exatrain: replica group $k not started: the wall-time warning came first; the requeued job starts it"
      return 0
    fi
    rm -f "$dir/summary.json"
    REPLICA_GROUP_ID=$k EXATRAIN_RUN_DIR="$dir" MASTER_ADDR=${{hosts[$4]}} MASTER_PORT=$((base_port + k)) \\
      srun --exact --kill-on-bad-exit=1 --nodes="$2" --ntasks="$3" --relative="$4" \\
      {gpu_flags}{python} -m exatrain.cli run {config}
    status=$?
    [[ $status == 0 ]] && return 0
    # finished (a summary not stopped by a signal), signalled only as it ended: done
    grep -q '"stopped_by_signal": false' "$dir/summary.json" 2>/dev/null && return 0
    # stopped on the wall-time warning (or by scancel --signal): the requeue starts it again
    grep -q '"stopped_by_signal": true' "$dir/summary.json" 2>/dev/null && return $status
    if [[ -f $EXATRAIN_STOP_FILE ]]; then  # ended otherwise after it: said, not hidden
      echo "exatrain: replica group $k ended (exit $status) after the wall-time warning without a checkpoint of its own; the requeued job resumes it from its last one; see $dir"
      return $status
    fi
    if (( starts >= {restarts} )); then
      echo "exatrain: replica group $k failed (exit $status) after $starts restart(s); see $dir"
      return $status
    fi
    starts=$((starts + 1))
    echo "exatrain: replica group $k failed (exit $status); starting it again ($starts/{restarts}); it heals from a live group"
  done
}}

pids=()
{starts}
status=0
for pid in "${{pids[@]}}"; do  # (a wait the warning's trap interrupts is waited again)
  wait "$pid"; code=$?
  while kill -0 "$pid" 2>/dev/null; do wait "$pid"; code=$?; done
  (( code != 0 )) && status=$code
done
[[ -n ${{LIGHTHOUSE_PID:-}} ]] && kill "$LIGHTHOUSE_PID"

# not finished: requeue (same job id, same run directory) when a group stopped on a signal, or
# when the warning came and a group ended without a summary (it reached the ranks as they started,
# or came before the group started)
for k in $(seq 0 {last}); do
  dir="$run_root/group_$(printf %02d "$k")"
  if grep -q '"stopped_by_signal": true' "$dir/summary.json" 2>/dev/null || \\
      [[ -f $EXATRAIN_STOP_FILE && ! -f $dir/summary.json ]]; then
    {requeue}
    break
  fi
done
exit $status
"""

LIGHTHOUSE = """# torchft's lighthouse on this (the batch) host: it keeps the quorum of live groups. A site's
# lighthouse instead: submit with TORCHFT_LIGHTHOUSE=http://HOST:PORT in the environment
if [[ -z ${{TORCHFT_LIGHTHOUSE:-}} ]]; then
  lighthouse_port=${{LIGHTHOUSE_PORT:-29510}}
  {program} --bind "[::]:$lighthouse_port" {flags} > "$run_root/lighthouse.log" 2>&1 &
  LIGHTHOUSE_PID=$!
  export TORCHFT_LIGHTHOUSE="http://$(hostname):$lighthouse_port"
  for _ in $(seq 300); do  # up to 30 s: the groups connect to it as they start
    (exec 3<>"/dev/tcp/127.0.0.1/$lighthouse_port") 2>/dev/null && break
    kill -0 "$LIGHTHOUSE_PID" || {{ echo "exatrain: the lighthouse failed; see $run_root/lighthouse.log"; exit 1; }}
    sleep 0.1
  done
fi"""


def placement(groups: int, nodes: int, tasks_per_node: int) -> list[tuple[int, int, int]]:
    """(nodes, tasks, first node) of each group's step."""
    if nodes >= groups:
        if nodes % groups:
            raise ArgumentError(f"--nodes {nodes} does not split into {groups} replica groups; "
                                f"use a multiple of {groups} nodes (whole nodes per group), or "
                                f"fewer nodes than groups with the groups side by side.")
        per = nodes // groups
        return [(per, per * tasks_per_node, k * per) for k in range(groups)]
    side_by_side = groups // nodes
    if groups % nodes or tasks_per_node % side_by_side:
        raise ArgumentError(f"{groups} replica groups on --nodes {nodes} of --tasks-per-node "
                            f"{tasks_per_node}: the groups cannot share the nodes evenly; use a "
                            f"node count that divides the groups, with tasks per node a multiple "
                            f"of groups / nodes, or a multiple of {groups} nodes.")
    tasks = tasks_per_node // side_by_side
    return [(1, tasks, k // side_by_side) for k in range(groups)]


def replica_groups_body(config, groups: int, nodes: int, tasks_per_node: int, restarts: int,
                        gpus_per_node: int, words: dict) -> str:
    """The script's body after its `#SBATCH` lines; `words`: batch.py's (name, out_dir, python,
    config)."""
    f = config.fault_tolerance
    steps = placement(groups, nodes, tasks_per_node)
    if f.lighthouse != "auto":
        lighthouse = f"# the lighthouse: {f.lighthouse} (fault_tolerance.lighthouse)"
    else:
        python = shlex.split(words["python"])[0]
        program = lighthouse_program(python)
        if program is None:
            raise ArgumentError(f"[fault_tolerance]: torchft_lighthouse is not installed beside "
                                f"{python}; `pip install 'exatrain[ft]'` there, or name a site's "
                                f"lighthouse with fault_tolerance.lighthouse.")
        lighthouse = LIGHTHOUSE.format(program=shlex.quote(program),
                                       flags=" ".join(lighthouse_flags(f)))
    if not gpus_per_node:
        gpu_flags = ""
    elif nodes >= groups:  # whole nodes: each rank sees its node's GPUs, takes LOCAL_RANK's
        gpu_flags = "--gpu-bind=none "
    else:  # groups side by side on a node: each task its own GPU, so none is picked twice
        gpu_flags = "--gpus-per-task=1 "
    starts = "\n".join(f"group {k} {n} {t} {first} &\npids+=($!)"
                       for k, (n, t, first) in enumerate(steps))
    return BODY.format(**words, lighthouse=lighthouse, restarts=restarts, gpu_flags=gpu_flags,
                       starts=starts, last=groups - 1, requeue=REQUEUE.format(run_dir="$run_root"))
