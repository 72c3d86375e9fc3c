#!/usr/bin/env bash
# The GPU proof in one call, on a Linux machine with one NVIDIA GPU (tested target: H200) that may have no network
# and no Rust: install the wheels prepare.sh put in .whl/, record the provenance, run the tests marked `cuda`
# compiled on the GPU, the kernel benchmarks (--device cuda) and the trainings (`fasttrain bench --preset gpu-*`).
# Every step runs under its own cap (timeout); one that fails or hits its cap is recorded and the rest still run.
#
#   bash benchmarks/gpu/run.sh --out DIR [--archive FILE.tar.gz] [--smoke] [--wheels DIR] [--budget]
#
#   --smoke    the same steps on CPU at tiny sizes (Triton interpreted, the tests only collected), plus `compile`
#              (every kernel compiled for sm_90 by this Python's Triton); the kernel and training lanes side by side
#   --archive  DIR packed into FILE after every step: what finished survives an interrupted run
#   --wheels   the wheels to install (default .whl; without that folder the current environment is used as it is)
#   --budget   print the caps (each plus the kill grace) and their sum; fail if a GPU run's passes 570 s
#
# DIR gets steps.tsv (step, status, seconds, cap), logs/STEP.log, provenance.json and each step's results; the
# table of steps is printed last. Exit status 1 if a step failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
command_line="bash benchmarks/gpu/run.sh $*"

out=benchmarks/results/gpu archive= wheels=.whl smoke=0 budget=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out | --archive | --wheels)
            [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }
            declare "${1#--}=$2"
            shift 2 ;;
        --smoke) smoke=1; shift ;;
        --budget) budget=1; shift ;;
        -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "run.sh: unknown option $1 (--out DIR, --archive FILE, --smoke, --wheels DIR, --budget)" >&2; exit 2 ;;
    esac
done

# Caps in seconds: on one H200, then --smoke (2 shared CPU cores, Triton interpreted). On the GPU the caps plus a
# 5 s kill grace each add up to at most 570 s, so that a run with its start-up and archiving ends within 10 minutes.
# The benchmarks get budgets below that stop them starting new work before their cap, and `fasttrain bench` writes
# its results after every run: a step cut short keeps what it finished.
grace=5
declare -A cap=()
steps=()
while read -r name gpu_cap smoke_cap; do
    [ "$smoke" = 1 ] && cap[$name]=$smoke_cap || cap[$name]=$gpu_cap
    [ "${cap[$name]}" = - ] || steps+=("$name")
done <<'EOF'
install          10   60
provenance       20   60
tests           140  300
compile           -  300
adamw            35  300
loss             30  450
loss-trl         30  450
loss-speculation 15  300
gpu-e2e          65  400
gpu-packing      50  400
gpu-sft          30  300
gpu-dpo          30  300
gpu-grpo         50  300
EOF
# tests: Triton compiles each kernel variant once, four at a time; the tests themselves take seconds on the GPU.
# gpu-e2e: 3 contenders x 2 repetitions, each a process (start, set-up, compilation, 8 steps); gpu-packing 3 x 1.

if [ "$budget" = 1 ]; then
    total=0
    for name in "${steps[@]}"; do
        printf '%-17s %4d s + %d s grace\n' "$name" "${cap[$name]}" "$grace"
        total=$((total + cap[$name] + grace))
    done
    printf 'total             %4d s (limit 570 s)\n' "$total"
    [ "$smoke" = 1 ] || [ "$total" -le 570 ]
    exit
fi

python=${PYTHON:-python3}  # the GPU machine has python3, not python
export PYTHON=$python HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$out/logs"
: > "$out/steps.tsv"
if [ "$smoke" = 1 ]; then
    export TRITON_INTERPRET=1
    tests=(--collect-only)  # each test file imports and builds its cases at these versions
    preset=(--smoke)
    adamw=(--device cpu --models tiny --dtypes bfloat16 --grad-norms 5 --reps 1 --warmup 0)  # bf16: every mode
    loss=(--device cpu --tokens 64 --hidden 32 --vocab 1000 --rounds 1 --steps 1)
    speculation=(--device cpu --tokens 64 --hidden 32 --vocab 512 --rounds 1 --steps 1)
else
    tests=(-rfE --junitxml "$out/tests.xml")
    "$python" -c "import xdist" 2> /dev/null && tests+=(-n 4)
    preset=()
    adamw=(--device cuda --models gpt2-124M,llama3.2-1B --reps 7 --time-cap 23)
    loss=(--device cuda --tokens 8192,16384 --budget-s 18)
    speculation=(--device cuda --tokens 8192 --hidden 2048 --budget-s 8)  # Qwen3-1.7B's head
fi

step() {  # step NAME COMMAND...: COMMAND under NAME's cap, logged, one line in steps.tsv; never stops the run
    local name=$1 t0=$SECONDS rc status
    shift
    echo "[run.sh] $name (cap ${cap[$name]} s): $*" >&2
    timeout -k "$grace" "${cap[$name]}" "$@" > "$out/logs/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMEOUT after ${cap[$name]} s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" "${cap[$name]}" >> "$out/steps.tsv"
    [ "$rc" = 0 ] || tail -n 15 "$out/logs/$name.log" | sed 's/^/    /' >&2
    if [ -n "$archive" ]; then
        mkdir -p "$(dirname "$archive")"
        tar -czf "$archive.partial" -C "$(dirname "$out")" "$(basename "$out")" && mv "$archive.partial" "$archive"
    fi
}

if [ -d "$wheels" ]; then
    site=${TMPDIR:-/tmp}/fasttrain-gpu-site
    step install bash benchmarks/gpu/install_wheels.sh "$python" "$wheels" "$site"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"  # every later step imports from there first
fi
step provenance "$python" -c 'import json, sys, torch  # torch first: the record names the GPU
from fasttrain.bench import provenance
record = {**provenance.record("liger-kernel"), "command": sys.argv[2]}
json.dump(record, open(sys.argv[1], "w"), indent=1)' "$out/provenance.json" "$command_line"
command -v nvidia-smi > /dev/null && timeout 20 nvidia-smi > "$out/nvidia-smi.txt" 2>&1
step tests "$python" -m pytest -p no:cacheprovider -q "${tests[@]}" -m cuda tests/

kernel_lane() {
    # the GPU machine's Triton (in CI's replica) compiles every value of every constexpr once for sm_90
    [ "$smoke" = 0 ] || step compile env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 \
        "$python" tests/_compile_kernels_sm90.py --each-value
    step adamw "$python" benchmarks/bench_adamw.py --out "$out" "${adamw[@]}"
    step loss "$python" benchmarks/bench_loss.py --out "$out" --cases loss "${loss[@]}"
    step loss-trl "$python" benchmarks/bench_loss.py --out "$out" --cases trl_sft,trl_dpo --name loss_trl "${loss[@]}"
    step loss-speculation "$python" benchmarks/bench_loss.py --out "$out" --name loss_speculation --cases speculation,trl_sft_speculation,trl_lora_speculation "${speculation[@]}"
}
training_lane() {
    for name in gpu-e2e gpu-packing gpu-sft gpu-dpo gpu-grpo; do
        step "$name" "$python" -m fasttrain bench --preset "$name" "${preset[@]}" --no-progress \
            --json "$out/$name.json" --markdown "$out/$name.md"
    done
}
if [ "$smoke" = 1 ] && [ -z "$archive" ]; then
    # on CPU each step is mostly one single-threaded process: one lane per core (the archive needs one writer)
    kernel_lane &
else
    kernel_lane
fi
training_lane
wait  # for the kernel lane, where it ran beside
awk -F'\t' 'BEGIN { printf "\n%-17s %-22s %7s %5s\n", "step", "status", "seconds", "cap" }
    { printf "%-17s %-22s %7s %5s\n", $1, $2, $3, $4; failed = failed || $2 != "ok" } END { exit failed }' \
    "$out/steps.tsv"
