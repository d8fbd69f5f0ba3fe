#!/usr/bin/env bash
# The GPU figures on a machine with one GPU (H100 or H200), in parts that each fit one device
# call of at most 10 minutes. `--dry-run` after the part prints its steps and time limits:
#
#   bash scripts/gpu-figures.sh once        # one call for a 15-minute lease (device timeout_s at
#                                           #    least BUDGET_S + 60): GPU binding,
#                                           #    GPT 125m (+ CUDA graphs beside it), ViT, DeepCAM
#                                           #    (their data written on the CPU cores meanwhile),
#                                           #    then one case of each axis on CUDA tensors
#   bash scripts/gpu-figures.sh lease       # one call for a 15-minute lease once `once` has run:
#                                           #    one case of each axis on CUDA tensors, then GPT
#                                           #    1.3b in bf16 beside fp8 (torchao carried in .whl/)
#   bash scripts/gpu-figures.sh planner     # the planner beside the device: GPT 125m, 350m, 1.3b and
#                                           #    CosmoFlow 128³ at two batch sizes each, then
#                                           #    `exatrain plan --calibrate-from` on them
#   bash scripts/gpu-figures.sh graphs      # GPT 125m and CosmoFlow: the whole step as one CUDA
#                                           #    graph (cuda_graphs_scope = "step") beside the
#                                           #    compiled step without graphs (no plain loop)
#   bash scripts/gpu-figures.sh fp8         # GPT 1.3b: bf16 beside float8 Linears (torchao carried
#                                           #    as a wheel in .whl/, installed by this script)
#   bash scripts/gpu-figures.sh step        # 0. the step's figures in one ~7-minute call: CosmoFlow,
#                                           #    DeepCAM, GPT 125m with --profile, GPT 125m with
#                                           #    parallel.cuda_graphs, then a table
#   bash scripts/gpu-figures.sh bench       # 1. baseline vs exatrain, all five workloads
#   bash scripts/gpu-figures.sh levers      # 2. each lever on its own (gpt_125m, cosmoflow, vit)
#   bash scripts/gpu-figures.sh multirank   # 3. distributed-equals-serial, ranks sharing the GPU
#
# Output under $OUT (the device tool's folder) or ./gpu-figures:
#   device.txt                  nvidia-smi, torch and CUDA versions
#   bench-<case>.json / .log    `exatrain bench device --sizes full` per workload: samples/s (tokens/s),
#                               mfu_peak, mfu_measured, peak memory, data wait, vs_baseline,
#                               vs_published; levers-<case>.json the same with --levers all
#   multirank-<axis>.log        pytest of that axis's distributed-equals-serial tests with
#                               EXATRAIN_SHARE_GPU=1 (gloo between ranks, CUDA tensors)
#   summary.txt                 one line per step: its exit status (124: ran out of its time)
# A step that runs out of the part's time is cut (exit 124, or 137 when killed, in summary.txt); the next calls go on.
# Data sets are written once under data/bench-device (git-ignored, so kept between calls on a
# warm machine); the first `bench` call pays for writing them.
set -uo pipefail
cd "$(dirname "$0")/.."
PART="${1:-bench}"
DRY=$([[ "${2:-}" == "--dry-run" ]] && echo 1 || echo 0)
OUT="${OUT:-gpu-figures}"
[[ "${2:-}" == "--dry-run" ]] || mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
DATA="${EXATRAIN_BENCH_DATA:-$PWD/data/bench-device}"
BUDGET="${BUDGET_S:-540}"   # the whole part, under the device tool's 600 s; steps that would
                            # end past it are cut or skipped, so what it wrote comes back
SIZES="${SIZES:-full}"      # small: a CPU smoke run of the script itself

left() { echo $(( BUDGET - SECONDS )); }
step() {  # step NAME LIMIT_S CMD...: run with the smaller of LIMIT_S and what is left; record it
    local name=$1 limit=$2; shift 2
    (( limit > $(left) - 15 )) && limit=$(( $(left) - 15 ))   # a cut step gets 15 s to exit
    if (( DRY )); then   # what the part would run, and the time each step may take
        DRY_TOTAL=$(( ${DRY_TOTAL:-0} + limit )); SECONDS=$DRY_TOTAL
        echo "$PART $name: up to ${limit}s (by ${DRY_TOTAL}s of ${BUDGET}s): $*"
        return
    fi
    if (( limit < 20 )); then   # the part's budget is a hard limit: the device call ends after it
        echo "$PART $name: skipped, ${SECONDS}s of ${BUDGET}s used" | tee -a "$OUT/summary.txt"
        return
    fi
    timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$PART $name: exit $? after ${SECONDS}s" | tee -a "$OUT/summary.txt"
}

# Nothing here may outlast BUDGET_S: a device call cut at its limit brings back nothing at all
# (a whole 10-minute call was lost so, with no log to say which wait ran on). Every step
# runs under `timeout`; a watchdog stops the part at the budget, and the table and the archive
# are written on every exit.
if (( ! DRY )) && [[ -d .whl ]]; then   # wheels carried to a machine that cannot download
    timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/exatrain-site .whl/*.whl \
        && export PYTHONPATH="/tmp/exatrain-site:$PYTHONPATH"
fi
(( DRY )) || { timeout 30 nvidia-smi; timeout 60 python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } \
    > "$OUT/device.txt" 2>&1

table() {  # the figures that say whether the step is fast, one line per case
    python3 - "$OUT" <<'PY'
import glob, json, sys
keys = ("vs_baseline", "exatrain_samples_per_s", "baseline_samples_per_s",
        "exatrain_data_wait_fraction", "exatrain_host_syncs_per_step",
        "baseline_host_syncs_per_step", "exatrain_compiled_graphs", "exatrain_graph_breaks",
        "exatrain_compiled_share", "baseline_compiled_share", "loss_max_rel_diff",
        "exatrain_mfu_peak", "exatrain_peak_memory_bytes", "exatrain_step_s_median",
        "alt_vs_exatrain", "alt_samples_per_s", "alt_tokens_per_s", "alt_loss_rel_diff",
        "alt_graph_breaks", "alt_refused")
for path in sorted(glob.glob(f"{sys.argv[1]}/bench-*.json")):
    d = json.load(open(path))
    for case in d["cases"].split(","):
        name = path.rsplit("/", 1)[-1].removesuffix(".json")   # bench-gpt_125m-graphs, ...
        row = {k: d.get(f"{case}_{k}") for k in keys}
        print(f"{name}:{case}", {k: round(v, 4) if isinstance(v, float) else v
                                 for k, v in row.items()})
PY
}

bench_case() {  # bench_case NAME LIMIT_S [bench args]: one case, baseline and exatrain
    local c=$1 limit=$2; shift 2
    step "bench-$c" "$limit" python3 -m exatrain.cli bench device --sizes "$SIZES" --cases "$c" \
        --warmup 3 --steps 12 --data-dir "$DATA" --json "$OUT/bench-$c.json" "$@"
}

multirank_cases() {  # one distributed-equals-serial case per axis, ranks sharing the GPU over gloo
    # -n 0 (here and in every pytest below): one test process, whose ranks alone share the GPU;
    # the suite's own `-n auto` would start a worker, and ranks, per two of its cores
    step multirank "$1" env EXATRAIN_SHARE_GPU=1 EXATRAIN_TEST_RANK_TIMEOUT_S="${RANK_TIMEOUT_S:-40}" \
        python3 -m pytest -q -n 0 -p no:cacheprovider -rf --durations=0 \
        tests/test_data_parallel.py::test_data_parallel_equals_serial \
        tests/test_shard.py::test_zero_stages_equal_serial \
        tests/test_spatial_training.py::test_cosmoflow_space_times_data_equals_serial \
        tests/test_pipe.py::test_sequential_cnn_every_schedule_equals_serial \
        tests/test_tensor_training.py::test_tensor_plans_train_like_serial
}

finish() {  # on every exit, also after the watchdog: the table, one archive of the logs
    trap - EXIT TERM
    (( WATCHDOG > 0 )) && kill "$WATCHDOG" 2>/dev/null   # never `kill 0`: the whole group
    (( DRY )) && return
    table > "$OUT/table.txt" 2>&1
    # the device tool brings back at most 8 files: logs and profile tables travel as one archive
    (cd "$OUT" && ls ./*.log >/dev/null 2>&1 && tar czf logs.tgz ./*.log \
        $(ls ./*-profile-*.txt 2>/dev/null) && rm -f ./*.log ./*-profile-*.txt)
    cat "$OUT/table.txt" "$OUT/summary.txt" 2>/dev/null
}
trap finish EXIT
trap 'echo "$PART: stopped by the watchdog at ${SECONDS}s of ${BUDGET}s" >> "$OUT/summary.txt"; kill $(jobs -p) 2>/dev/null; exit 124' TERM
WATCHDOG=0
if (( ! DRY )); then
    ( sleep $(( BUDGET + 5 )); kill -TERM $$ 2>/dev/null ) & WATCHDOG=$!
fi

case "$PART" in
once)  # one call: the figures never taken on a GPU first, cheapest data first
    if (( ! DRY )); then  # ViT's and DeepCAM's data on the CPU cores while GPT trains
        timeout -k 10 240 python3 -m exatrain.cli bench device --sizes "$SIZES" --cases vit,deepcam --prepare-only \
            --data-dir "$DATA" > "$OUT/prepare.log" 2>&1 & PREPARE=$!
    fi
    step binding 60 python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_gpu_binding.py
    bench_case gpt_125m 220 --alt-set parallel.cuda_graphs=true
    multirank_cases 150
    # the writer alone: a bare `wait` would also wait for the watchdog, until the budget ends
    (( DRY )) || wait "$PREPARE"
    bench_case vit 130
    bench_case deepcam 90   # what is left; else a second call: CASES=deepcam:90 ... bench
    ;;
lease)  # the axes first, then fp8 beside bf16 with what is left (no plain loop: its 1.3b
        # figure is the bench part's). One launch trains up to 10 cases (the tensor test): 40 s
        # cut them while they still ran (a first step took 4 s there), so each launch gets 100 s
    RANK_TIMEOUT_S=${RANK_TIMEOUT_S:-100} multirank_cases 200
    bench_case gpt_1b 310 --steps 200 --no-baseline --alt-set 'parallel.precision="fp8"' ;;
planner)  # the planner's one-GPU check: 4 models at 2 batch sizes, exatrain's path alone
    # (step time and peak memory), then `exatrain plan --calibrate-from` on what came back
    for run in ${RUNS:-gpt_1b:4:gpt_1b:80 gpt_1b:8:gpt_1b:80 gpt_125m:8:gpt_125m:55 \
               gpt_125m:16:gpt_125m:55 gpt_125m:4:gpt_350m:55 gpt_125m:8:gpt_350m:55 \
               cosmoflow:16:cosmoflow:55 cosmoflow:32:cosmoflow:55}; do  # case:batch:name:limit
        IFS=: read -r c b name limit <<< "$run"
        extra=(); [[ $name == gpt_350m ]] && extra=(--set 'model.preset="350m"')
        step "plan-$name-b$b" "$limit" python3 -m exatrain.cli bench device --sizes "$SIZES" \
            --cases "$c" --no-baseline --warmup 3 --steps 10 --data-dir "$DATA" \
            --set "train.batch_size=$b" "${extra[@]}" --json "$OUT/plan-$name-b$b.json"
    done
    (( DRY )) || (cd "$OUT" && mkdir -p plan && mv plan-*.json plan/ 2>/dev/null; \
        sheet=h100-infiniband; grep -q H200 device.txt && sheet=h200-infiniband; \
        timeout 60 python3 -m exatrain.cli plan --calibrate-from plan/*.json \
        --system $sheet --calibrate-out "$sheet-measured.toml" > calibrate.log 2>&1; \
        tar czf plan.tgz plan && rm -rf plan) ;;
graphs)  # the whole step recorded (alt) beside the compiled step without graphs (exatrain)
    for pair in ${CASES:-gpt_125m:150 cosmoflow:150}; do
        # --warmup 4: the 3 eager steps and the recording stay out of the timed steps; the
        # plain loop is not what this part compares (the bench part times it)
        bench_case "${pair%%:*}" "${pair#*:}" --warmup 4 --no-baseline \
            --alt-set parallel.cuda_graphs=true --alt-set 'parallel.cuda_graphs_scope="step"'
    done ;;
fp8)  # GPT 1.3b in bf16 and with float8 Linears, 200 steps each: tokens/s and the two loss
      # curves (carry torchao: pip download --no-deps torchao==0.18.0 -d .whl, see the header)
    (( DRY )) || [[ -d .whl ]] || echo "fp8: no .whl/ here (run with carry [\".whl\"]): torchao" \
        "may be missing" | tee -a "$OUT/summary.txt"
    bench_case gpt_1b 420 --steps 200 --no-baseline --alt-set 'parallel.precision="fp8"' ;;
step)   # the step's figures, each path profiled after its timed steps
    for pair in ${CASES:-cosmoflow:150 deepcam:90 gpt_125m:90}; do
        c=${pair%%:*}
        step "bench-$c" "${pair#*:}" python3 -m exatrain.cli bench device --sizes "$SIZES" --cases "$c" \
            --warmup 3 --steps 12 --profile --data-dir "$DATA" --json "$OUT/bench-$c.json"
    done
    # exatrain's step as CUDA graphs (parallel.cuda_graphs), beside the same baseline
    for pair in ${GRAPHS:-gpt_125m:90}; do
        c=${pair%%:*}
        step "bench-$c-graphs" "${pair#*:}" python3 -m exatrain.cli bench device --sizes "$SIZES" \
            --cases "$c" --warmup 3 --steps 12 --set parallel.cuda_graphs=true \
            --data-dir "$DATA" --json "$OUT/bench-$c-graphs.json"
    done
    ;;
bench)  # baseline and exatrain per workload, the two with the issue's targets first
    for pair in ${CASES:-cosmoflow:180 gpt_1b:200 gpt_125m:120 deepcam:120 vit:120}; do
        c=${pair%%:*}
        step "bench-$c" "${pair#*:}" python3 -m exatrain.cli bench device --sizes "$SIZES" --cases "$c" \
            --warmup 3 --steps 12 --data-dir "$DATA" --json "$OUT/bench-$c.json"
    done ;;
levers)  # plain and each lever alone (compile and CUDA graphs compile once more each)
    for c in gpt_125m cosmoflow vit; do
        step "levers-$c" 180 python3 -m exatrain.cli bench device --sizes "$SIZES" --cases "$c" \
            --levers all --warmup 3 --steps 10 --data-dir "$DATA" --json "$OUT/levers-$c.json"
    done ;;
multirank)  # the distributed-equals-serial cases of every axis, ranks sharing the one GPU
    for pair in ${AXES:-data:tests/test_data_parallel.py shard:tests/test_shard.py \
                space:tests/test_spatial_training.py tensor:tests/test_tensor_training.py \
                pipe:tests/test_pipe.py graph:tests/test_graph_parallel.py \
                trainer:tests/test_population.py}; do
        # a case stuck longer than RANK_TIMEOUT_S fails with every rank's stacks in its log
        step "multirank-${pair%%:*}" 80 env EXATRAIN_SHARE_GPU=1 \
            EXATRAIN_TEST_RANK_TIMEOUT_S="${RANK_TIMEOUT_S:-45}" \
            python3 -m pytest -q -n 0 -p no:cacheprovider -rf "${pair#*:}"
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/multirank-${pair%%:*}.log" \
            | cut -c1-300 >> "$OUT/summary.txt"
    done ;;
*) echo "usage: $0 once|lease|planner|graphs|fp8|step|bench|levers|multirank [--dry-run]" >&2; exit 2 ;;
esac
