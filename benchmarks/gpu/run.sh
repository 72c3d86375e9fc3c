#!/usr/bin/env bash
# The GPU proof in one call, on the lent GPU machine (no network, no cargo), with .whl/ carried from
# benchmarks/gpu/prepare.sh: install the carried wheels, then correctness first, then speed, every step under
# its own time cap (timeout), so that the whole run stays under 8 minutes on one H200 (the budget is in
# benchmarks/gpu/README.md). A step that fails or hits its cap is recorded and the rest still run.
#
#   bash benchmarks/gpu/run.sh [--out DIR] [--smoke] [--archive FILE.tar.gz] [--wheels DIR]
#
#   --out DIR        results, logs, versions and commands (default: benchmarks/results/gpu)
#   --smoke          the same steps on CPU at tiny sizes (Triton in its interpreter): proves the run goes through
#   --archive FILE   also pack DIR into FILE after every step (a device call brings back at most 8 files: name
#                    one under $OUT, and what finished is there even if the call is cut short)
#   --wheels DIR     the carried wheels (default: .whl); installed with pip --no-index --no-deps into their own
#                    folder first on PYTHONPATH. Without it, the current environment is used as it is.
#
# Steps: install (the carried wheels), environment (GPU, versions, origins; fails if fasttrain, trl, ... do not
# import), kernels (pytest of .ci/suites' KERNEL_TESTS, compiled for the GPU),
# parity (fasttrain.Trainer vs transformers.Trainer, fp32 and bf16), adamw and loss (the kernel benchmarks),
# e2e (`fasttrain bench --device cuda`), trl-sft and trl-dpo (`fasttrain bench --trainer sft|dpo`), summary.
# DIR/steps.tsv has one line per step; DIR/logs/STEP.log its output; DIR/commands.txt every command run;
# DIR/summary.md the table printed last. Exit status: 0 when every step passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2

out=benchmarks/results/gpu
smoke=0
archive=
wheels=.whl
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --out=*) out="${1#--out=}"; shift ;;
        --smoke) smoke=1; shift ;;
        --archive) archive="$2"; shift 2 ;;
        --archive=*) archive="${1#--archive=}"; shift ;;
        --wheels) wheels="$2"; shift 2 ;;
        --wheels=*) wheels="${1#--wheels=}"; shift ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
        *) echo "run.sh: unknown option $1 (use --out DIR, --smoke, --archive FILE, --wheels DIR)" >&2; exit 2 ;;
    esac
done

python=${PYTHON:-python3}
export PYTHON=$python HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
site=${FASTTRAIN_SITE:-${TMPDIR:-/tmp}/fasttrain-gpu-site}
source .ci/suites
listing=$(suite KERNEL_TESTS) || { echo "[gpu] KERNEL_TESTS names a missing file" >&2; exit 2; }
mapfile -t kernel_tests <<< "$listing"

# Time caps in seconds, GPU run then --smoke (2 shared CPU cores, the interpreter). The GPU caps add up to
# 470 s; benchmarks/gpu/README.md explains each. The benchmark scripts get their own, shorter budgets below so
# they write their results before the cap.
declare -A cap_gpu=([install]=10 [environment]=10 [kernels]=100 [parity]=40 [adamw]=50 [loss]=45 [loss-trl]=40 [e2e]=95 [trl-sft]=35 [trl-dpo]=35 [summary]=10)
declare -A cap_smoke=([install]=60 [environment]=120 [kernels]=900 [parity]=300 [adamw]=300 [loss]=300 [loss-trl]=300 [e2e]=400 [trl-sft]=300 [trl-dpo]=300 [summary]=60)

if [ "$smoke" = 1 ]; then
    export TRITON_INTERPRET=1
    smoke_flag=(--smoke)
    kernel_markers="not slow and not distributed"
    adamw_args=()
    loss_args=()
    loss_trl_args=()
else
    smoke_flag=()
    # Compiled on the GPU, the slow-marked shapes (vocabulary over 65,536, ...) are quick: run them.
    kernel_markers="not distributed"
    # The kernel benchmarks' own sizes, trimmed to their caps (their scripts say what each option does).
    adamw_args=(--models "gpt2-124M,llama3.2-1B" --reps 10 --time-cap 38)
    loss_args=(--tokens "8192,16384" --budget-s 32)
    loss_trl_args=(--tokens "8192" --budget-s 28)
fi

mkdir -p "$out/logs"
: > "$out/steps.tsv"
: > "$out/commands.txt"
started=$(date +%s)
failed=0

pack() {
    [ -n "$archive" ] || return 0
    mkdir -p "$(dirname "$archive")"
    tar -czf "$archive.partial" -C "$(dirname "$out")" "$(basename "$out")" && mv "$archive.partial" "$archive"
}

# step NAME COMMAND...: run COMMAND under NAME's cap, log it, record status and time; never stop the run.
step() {
    local name=$1; shift
    local cap
    if [ "$smoke" = 1 ]; then cap=${cap_smoke[$name]}; else cap=${cap_gpu[$name]}; fi
    local log=$out/logs/$name.log t0 rc status
    printf '%s\t%s\n' "$name" "$*" >> "$out/commands.txt"
    echo "[run.sh] $name (cap ${cap}s): $*" >&2
    t0=$(date +%s)
    timeout -k 10 "$cap" "$@" > "$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status="TIMEOUT after ${cap}s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    [ "$rc" = 0 ] || failed=1
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" "$cap" >> "$out/steps.tsv"
    echo "[run.sh] $name: $status in $(( $(date +%s) - t0 ))s (log: $log)" >&2
    [ "$rc" = 0 ] || tail -n 15 "$log" | sed 's/^/    /' >&2
    pack
    return 0
}

site_args=()
if [ -d "$wheels" ]; then
    step install bash benchmarks/gpu/install_wheels.sh "$python" "$wheels" "$site"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"  # every later step imports from there first
    site_args=(--site "$site")
else
    echo "[run.sh] no $wheels: using the current environment as it is" >&2
fi
step environment "$python" benchmarks/gpu/environment.py --out "$out" "${site_args[@]}" "${smoke_flag[@]}"
xdist=()
if [ "$smoke" = 0 ] && "$python" -c "import xdist" 2>/dev/null; then
    xdist=(-n 4)  # kernel compilation dominates: compile on four cores at once
fi
step kernels "$python" -m pytest -p no:cacheprovider -q -rfE -m "$kernel_markers" "${xdist[@]}" \
    --junitxml "$out/kernels.xml" "${kernel_tests[@]}"
step parity "$python" benchmarks/gpu/parity_gpu.py --out "$out" "${smoke_flag[@]}"
step adamw "$python" benchmarks/gpu/bench_adamw_gpu.py --out "$out" "${smoke_flag[@]}" "${adamw_args[@]}"
step loss "$python" benchmarks/gpu/bench_loss_gpu.py --out "$out" "${smoke_flag[@]}" "${loss_args[@]}"
step loss-trl "$python" benchmarks/gpu/bench_loss_gpu.py --trl --out "$out" "${smoke_flag[@]}" "${loss_trl_args[@]}"
step e2e bash benchmarks/gpu/bench_e2e_gpu.sh --out "$out" "${smoke_flag[@]}"
step trl-sft bash benchmarks/gpu/bench_trl_gpu.sh --trainer sft --out "$out" "${smoke_flag[@]}"
step trl-dpo bash benchmarks/gpu/bench_trl_gpu.sh --trainer dpo --out "$out" "${smoke_flag[@]}"
step summary "$python" benchmarks/gpu/summarize.py "$out"
cat "$out/summary.md"
echo "[run.sh] all steps in $(( $(date +%s) - started ))s; results in $out" >&2
exit $failed
