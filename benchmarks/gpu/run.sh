#!/usr/bin/env bash
# The GPU proof in one call on one NVIDIA GPU: the tests marked `cuda`, the kernel benchmarks and the trainings,
# each step under its own cap. How it works and each option: docs/contributing.md, "The GPU proof".
#
#   bash benchmarks/gpu/run.sh --out DIR [--archive FILE.tar.gz] [--part kernels|training|frontier] [--smoke]
#                              [--wheels DIR] [--budget]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
command_line="bash benchmarks/gpu/run.sh $*"

out=benchmarks/results/gpu archive= wheels=.whl smoke=0 budget=0 part=
while [ $# -gt 0 ]; do
    case "$1" in
        --out | --archive | --wheels | --part)
            [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }
            declare "${1#--}=$2"
            shift 2 ;;
        --smoke) smoke=1; shift ;;
        --budget) budget=1; shift ;;
        -h | --help) sed -n '2,6p' "$0"; exit 0 ;;
        *) echo "run.sh: unknown option $1 (--out DIR, --archive FILE, --part P, --smoke, --wheels DIR, --budget)" >&2
            exit 2 ;;
    esac
done
case "$part" in "" | kernels | training | frontier) ;; *) echo "run.sh: --part is kernels, training or frontier, not $part" >&2; exit 2 ;; esac

# Caps in seconds: on one H200, then --smoke (2 shared CPU cores, Triton interpreted). On the GPU each half's caps
# plus grace stay within 570 s, so that a half with its start-up and archiving ends within 10 minutes. The benchmarks'
# budgets below their caps stop them starting new work; `fasttrain bench` writes after every run. Sized by the first
# H200 run (benchmarks/results/gpu/README.md): 4 workers ran ~250 of the 342 CUDA tests in 140 s (8 were no faster);
# one `fasttrain bench` process of Qwen3-0.6B takes ~18 s (gpu-e2e runs 3 contenders x 2, gpu-packing 4 x 1).
grace=5
declare -A cap=() half=()
steps=()
in_part() { [ -z "$part" ] || [ "${half[$1]}" = both ] || [ "${half[$1]}" = "$part" ]; }  # in_part STEP
while read -r name which gpu_cap smoke_cap; do
    [ "$smoke" = 1 ] && cap[$name]=$smoke_cap || cap[$name]=$gpu_cap
    half[$name]=$which
    [ "${cap[$name]}" = - ] || ! in_part "$name" || steps+=("$name")
done <<'EOF'
install          both      10  60
provenance       both      20  60
tests            kernels  260 300
compile          kernels    - 300
adamw            kernels   60 300
loss             kernels   45 450
loss-trl         kernels   45 450
loss-speculation kernels   25 300
gpu-e2e          training 110 400
gpu-packing      training  80 400
gpu-sft          training  50 300
gpu-dpo          training  50 300
gpu-grpo         training  45 300
gpu-frontier     frontier 480 400
EOF

if [ "$budget" = 1 ]; then
    declare -A total=([kernels]=0 [training]=0 [frontier]=0)
    for name in "${steps[@]}"; do
        printf '%-17s %-8s %4d s + %d s grace\n' "$name" "${half[$name]}" "${cap[$name]}" "$grace"
        for which in kernels training frontier; do
            [ "${half[$name]}" = both ] || [ "${half[$name]}" = "$which" ] && total[$which]=$((total[$which] + cap[$name] + grace))
        done
    done
    fits=1
    for which in kernels training frontier; do
        [ -z "$part" ] || [ "$part" = "$which" ] || continue
        printf 'half %-12s %4d s (limit 570 s)\n' "$which" "${total[$which]}"
        [ "${total[$which]}" -le 570 ] || fits=0
    done
    [ "$smoke" = 1 ] || [ "$fits" = 1 ]
    exit
fi

python=${PYTHON:-python3}  # the GPU machine has python3, not python
export PYTHON=$python HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$out/logs"
[ -n "$part" ] || : > "$out/steps.tsv"  # the halves, run one after the other into one DIR, share the table
[ -f "$wheels/COMMIT" ] && export FASTTRAIN_COMMIT="$(cat "$wheels/COMMIT")"  # a copy without .git names its commit
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
    adamw=(--device cuda --models gpt2-124M,llama3.2-1B --reps 7 --time-cap 48)
    loss=(--device cuda --tokens 8192,16384 --budget-s 33)
    speculation=(--device cuda --tokens 8192 --hidden 2048 --budget-s 15)  # Qwen3-1.7B's head
fi

step() {  # step NAME COMMAND...: COMMAND under NAME's cap, logged, one line in steps.tsv; never stops the run
    local name=$1 t0=$SECONDS rc status
    shift
    in_part "$name" || return 0
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
step tests env FASTTRAIN_TEST_LOG="$out/tests.tsv" "$python" -m pytest -p no:cacheprovider -q "${tests[@]}" -m cuda tests/

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
    for name in gpu-e2e gpu-packing gpu-sft gpu-dpo gpu-grpo gpu-frontier; do  # the last: --frontier's own preset
        step "$name" "$python" -m fasttrain bench --preset "${name/gpu-frontier/cuda-frontier}" "${preset[@]}" \
            --no-progress --json "$out/$name.json" --markdown "$out/$name.md"
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
