#!/usr/bin/env bash
# The GPU proof in one command, on a Linux machine with one NVIDIA GPU (tested target: H200) that may have no
# network and no Rust toolchain: install the wheels benchmarks/gpu/prepare.sh put in .whl/, then correctness
# first, then speed, every step under its own time cap (timeout). The caps are the script's time budget: a
# whole run is designed to take under 10 minutes on one H200 (--budget prints the sum; benchmarks/gpu/README.md
# explains each cap). A step that fails or hits its cap is recorded and the rest still run.
#
#   bash benchmarks/gpu/run.sh [--out DIR] [--smoke] [--archive FILE.tar.gz] [--wheels DIR]
#                              [--only STEP,...] [--skip STEP,...]
#   bash benchmarks/gpu/run.sh --budget [--smoke]
#
#   --out DIR        results, logs, versions and commands (default: benchmarks/results/gpu)
#   --smoke          the same steps on CPU at tiny sizes (Triton in its interpreter): proves the run goes through
#   --archive FILE   also pack DIR into FILE (.tar.gz) after every step: one file to copy back, and it holds
#                    what finished even if the run is interrupted
#   --wheels DIR     the wheels to install (default: .whl, from prepare.sh); installed with pip --no-index
#                    --no-deps into their own folder, first on PYTHONPATH. Without it, the current environment
#                    is used as it is.
#   --only STEPS     run only these steps (comma list; install, when there are wheels, and summary always run);
#                    DIR keeps the other steps' lines and results, so a rerun of failed steps completes a run
#   --skip STEPS     run every step but these. An unknown step name fails at once, listing the valid ones.
#   --budget         print the caps of the steps that would run, plus the kill grace, and their sum; fail if the
#                    sum passes 570 s (GPU caps); runs nothing
#
# Steps: install (the wheels of --wheels), environment (GPU, versions, origins; fails if fasttrain, trl, ... do not
# import), hardware (the copy bandwidth and matmul throughput the rooflines divide by), compile (--smoke only:
# every kernel compiled for sm_90 by this Python's Triton, the GPU machine's in CI's replica), kernels (pytest
# of .ci/suites' KERNEL_TESTS, compiled for the GPU; with --smoke collected only),
# parity (fasttrain.Trainer vs transformers.Trainer, fp32 and bf16), adamw and loss (the kernel benchmarks),
# loss-speculation (the chunked head's speculation vs the exact recompute), e2e (`fasttrain bench --device cuda`),
# packing (the same on log-normal lengths: packed vs padded), trl-sft and trl-dpo (`fasttrain bench --trainer
# sft|dpo`), grpo (GRPO's training phase on synthetic completions: `fasttrain bench --trainer grpo --completions
# synthetic`), summary.
# DIR/steps.tsv has one line per step; DIR/logs/STEP.log its output; DIR/commands.txt every command run;
# DIR/summary.md the table printed last. Exit status: 0 when every step passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2

out=benchmarks/results/gpu
smoke=0
archive=
wheels=.whl
only=
skip=
only_given=0
skip_given=0
budget=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --out=*) out="${1#--out=}"; shift ;;
        --smoke) smoke=1; shift ;;
        --archive) archive="$2"; shift 2 ;;
        --archive=*) archive="${1#--archive=}"; shift ;;
        --wheels) wheels="$2"; shift 2 ;;
        --wheels=*) wheels="${1#--wheels=}"; shift ;;
        --only) only="${2-}"; only_given=1; shift; [ $# -gt 0 ] && shift ;;
        --only=*) only="${1#--only=}"; only_given=1; shift ;;
        --skip) skip="${2-}"; skip_given=1; shift; [ $# -gt 0 ] && shift ;;
        --skip=*) skip="${1#--skip=}"; skip_given=1; shift ;;
        --budget) budget=1; shift ;;
        -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
        *) echo "run.sh: unknown option $1 (use --out DIR, --smoke, --archive FILE, --wheels DIR, --only STEPS," \
               "--skip STEPS, --budget)" >&2; exit 2 ;;
    esac
done

# The steps in the order they run. compile checks on CPU what the GPU's kernels step does for real.
if [ "$smoke" = 1 ]; then
    steps=(install environment hardware compile kernels parity adamw loss loss-trl loss-speculation e2e packing trl-sft
           trl-dpo grpo summary)
else
    steps=(install environment hardware kernels parity adamw loss loss-trl loss-speculation e2e packing trl-sft trl-dpo
           grpo summary)
fi
# Time caps in seconds, GPU run then --smoke (2 shared CPU cores, the interpreter). Each capped step gets
# kill_grace more seconds to exit after SIGTERM before SIGKILL. The design budget: the GPU caps plus the graces
# add up to at most max_total, 570 s (--budget checks it, and tests/test_gpu_run_options.py runs that check in
# CI), so that a whole run, interpreter start-up and archiving included, ends within 10 minutes.
# benchmarks/gpu/README.md explains each cap. The benchmark scripts get their own, shorter budgets below so
# they write their results before the cap.
kill_grace=5
max_total=570
# grpo's 50 s came from steps that keep what they measured when cut short (README: "Where grpo's time came from").
declare -A cap_gpu=([install]=10 [environment]=10 [hardware]=10 [kernels]=85 [parity]=40 [adamw]=35 [loss]=30
                    [loss-trl]=30 [loss-speculation]=15 [e2e]=65 [packing]=50 [trl-sft]=30 [trl-dpo]=30 [grpo]=50
                    [summary]=5)
declare -A cap_smoke=([install]=60 [environment]=120 [hardware]=60 [compile]=300 [kernels]=900 [parity]=300
                      [adamw]=300 [loss]=300 [loss-trl]=300 [loss-speculation]=120 [e2e]=400 [packing]=400
                      [trl-sft]=300 [trl-dpo]=300 [grpo]=300 [summary]=60)

# --only / --skip: comma lists of step names, checked before anything runs
declare -A selected=()
check_names() {  # check_names OPTION LIST: every name in LIST is a step, else exit 2 naming the valid ones
    local option=$1 name known
    local -a names
    IFS=, read -r -a names <<< "$2"
    [ "${#names[@]}" -gt 0 ] || { echo "run.sh: $option needs STEP,...; valid steps: $(IFS=,; echo "${steps[*]}")" >&2; exit 2; }
    for name in "${names[@]}"; do
        known=0
        for step_name in "${steps[@]}"; do [ "$name" = "$step_name" ] && known=1; done
        if [ "$known" = 0 ]; then
            echo "run.sh: $option: unknown step '$name'; valid steps: $(IFS=,; echo "${steps[*]}")" >&2
            exit 2
        fi
    done
}
for name in "${steps[@]}"; do selected[$name]=1; done
if [ "$only_given" = 1 ]; then
    check_names --only "$only"
    for name in "${steps[@]}"; do selected[$name]=0; done
    IFS=, read -r -a names <<< "$only"
    for name in "${names[@]}" install summary; do selected[$name]=1; done
fi
if [ "$skip_given" = 1 ]; then
    check_names --skip "$skip"
    IFS=, read -r -a names <<< "$skip"
    for name in "${names[@]}"; do selected[$name]=0; done
fi

if [ "$budget" = 1 ]; then
    total=0
    for name in "${steps[@]}"; do
        [ "${selected[$name]}" = 1 ] || continue
        if [ "$smoke" = 1 ]; then cap=${cap_smoke[$name]-}; else cap=${cap_gpu[$name]-}; fi
        [ -n "$cap" ] || { echo "run.sh: step $name has no cap" >&2; exit 1; }
        total=$(( total + cap + kill_grace ))
        printf '%-12s %4d s + %d s grace\n' "$name" "$cap" "$kill_grace"
    done
    printf 'total        %4d s (limit %d s)\n' "$total" "$max_total"
    [ "$smoke" = 1 ] || [ "$total" -le "$max_total" ] || { echo "run.sh: the caps pass $max_total s" >&2; exit 1; }
    exit 0
fi

python=${PYTHON:-python3}
export PYTHON=$python HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
site=${FASTTRAIN_SITE:-${TMPDIR:-/tmp}/fasttrain-gpu-site}
source .ci/suites
listing=$(suite KERNEL_TESTS) || { echo "[gpu] KERNEL_TESTS names a missing file" >&2; exit 2; }
mapfile -t kernel_tests <<< "$listing"

if [ "$smoke" = 1 ]; then
    export TRITON_INTERPRET=1
    smoke_flag=(--smoke)
    kernel_markers="not slow and not distributed"
    adamw_args=()
    loss_args=()
    loss_trl_args=()
    speculation_args=(--device cpu --tokens 64 --hidden 32 --vocab 512 --reps 1 --name loss_speculation_smoke)
else
    smoke_flag=()
    # Compiled on the GPU, the slow-marked shapes (vocabulary over 65,536, ...) are quick: run them.
    kernel_markers="not distributed"
    # The kernel benchmarks' own sizes, trimmed to their caps (their scripts say what each option does).
    adamw_args=(--models "gpt2-124M,llama3.2-1B" --reps 7 --time-cap 23)
    loss_args=(--tokens "8192,16384" --budget-s 18)
    loss_trl_args=(--tokens "8192" --budget-s 18)
    # Qwen3-0.6B's head (hidden 2,048, vocabulary 151,936) on 8,192 tokens: 6 cases x 7 rounds x 2 ways.
    speculation_args=(--device cuda --tokens 8192 --hidden 2048 --vocab 151936 --reps 6 --name loss_speculation_gpu)
fi

mkdir -p "$out/logs"
[ -d "$wheels" ] || selected[install]=0  # nothing to install: its line from an earlier run stays
if [ "$only_given$skip_given" != 00 ] && [ -f "$out/steps.tsv" ]; then
    # a partial run (a rerun of failed steps, say): keep the lines of the steps it does not run
    kept=$(awk -F'\t' -v run="$(for n in "${steps[@]}"; do [ "${selected[$n]}" = 1 ] && printf '%s,' "$n"; done)" \
        'BEGIN { split(run, r, ","); for (i in r) want[r[i]] = 1 } !($1 in want)' "$out/steps.tsv")
    printf '%s' "${kept:+$kept$'\n'}" > "$out/steps.tsv"
else
    : > "$out/steps.tsv"
    : > "$out/commands.txt"
fi
started=$(date +%s)
failed=0

pack() {
    [ -n "$archive" ] || return 0
    mkdir -p "$(dirname "$archive")"
    tar -czf "$archive.partial" -C "$(dirname "$out")" "$(basename "$out")" && mv "$archive.partial" "$archive"
}

# step NAME COMMAND...: run COMMAND under NAME's cap, log it, record status and time; never stop the run.
# A step --only/--skip leaves out is not run and leaves no line.
step() {
    local name=$1; shift
    [ "${selected[$name]}" = 1 ] || return 0
    local cap
    if [ "$smoke" = 1 ]; then cap=${cap_smoke[$name]}; else cap=${cap_gpu[$name]}; fi
    local log=$out/logs/$name.log t0 rc status
    printf '%s\t%s\n' "$name" "$*" >> "$out/commands.txt"
    echo "[run.sh] $name (cap ${cap}s): $*" >&2
    t0=$(date +%s)
    timeout -k "$kill_grace" "$cap" "$@" > "$log" 2>&1
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
step hardware "$python" benchmarks/gpu/roofline.py --out "$out" "${smoke_flag[@]}"
if [ "$smoke" = 1 ]; then
    # the GPU machine's Triton (in CI's replica) compiles every kernel for sm_90: its errors show here. Every
    # value of every constexpr once (~40 variants); CI's main stage compiles every pair with the latest Triton.
    step compile env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 "$python" tests/_compile_kernels_sm90.py \
        --each-value
fi
if [ "$smoke" = 1 ]; then
    # The smoke run collects the kernel tests: every file imports and builds its cases at these versions, with this
    # step's selection. The kernels themselves run in the adamw and loss steps below (each checks its values), the
    # whole selection runs interpreted in CI's main and isa stages, and compiled on the GPU machine.
    step kernels "$python" -m pytest -p no:cacheprovider -q --collect-only -m "$kernel_markers" "${kernel_tests[@]}"
else
    xdist=()  # kernel compilation dominates on the GPU machine: compile on four cores at once
    "$python" -c "import xdist" 2>/dev/null && xdist=(-n 4)
    step kernels "$python" -m pytest -p no:cacheprovider -q -rfE -m "$kernel_markers" "${xdist[@]}" \
        --junitxml "$out/kernels.xml" "${kernel_tests[@]}"
fi
kernel_steps() {  # the kernel checks and benchmarks; returns 1 if one failed
    step parity "$python" benchmarks/gpu/parity_gpu.py --out "$out" "${smoke_flag[@]}"
    step adamw "$python" benchmarks/gpu/bench_adamw_gpu.py --out "$out" "${smoke_flag[@]}" "${adamw_args[@]}"
    step loss "$python" benchmarks/gpu/bench_loss_gpu.py --out "$out" "${smoke_flag[@]}" "${loss_args[@]}"
    step loss-trl "$python" benchmarks/gpu/bench_loss_gpu.py --trl --out "$out" "${smoke_flag[@]}" \
        "${loss_trl_args[@]}"
    step loss-speculation "$python" benchmarks/bench_loss_speculation.py --out "$out" "${speculation_args[@]}"
    return $failed
}
trainer_steps() {  # the end-to-end trainings (fasttrain bench); returns 1 if one failed
    step e2e bash benchmarks/gpu/bench_e2e_gpu.sh --out "$out" "${smoke_flag[@]}"
    step packing bash benchmarks/gpu/bench_e2e_gpu.sh --packing --out "$out" "${smoke_flag[@]}"
    step trl-sft bash benchmarks/gpu/bench_trl_gpu.sh --trainer sft --out "$out" "${smoke_flag[@]}"
    step trl-dpo bash benchmarks/gpu/bench_trl_gpu.sh --trainer dpo --out "$out" "${smoke_flag[@]}"
    step grpo bash benchmarks/gpu/bench_trl_gpu.sh --trainer grpo --out "$out" "${smoke_flag[@]}"
    return $failed
}
if [ "$smoke" = 1 ] && [ -z "$archive" ]; then
    # On CPU each of these steps is mostly one single-threaded Python process (the Triton interpreter, tiny models,
    # process start-up): the two groups run side by side, one per core. Each step keeps its own cap and log.
    kernel_steps &
    lane=$!
    trainer_steps || failed=1
    wait "$lane" || failed=1
else
    kernel_steps
    trainer_steps
fi
step summary "$python" benchmarks/gpu/summarize.py "$out"
cat "$out/summary.md"
echo "[run.sh] all steps in $(( $(date +%s) - started ))s; results in $out" >&2
exit $failed
