#!/usr/bin/env bash
# TRL on one GPU: `fasttrain bench --trainer sft` then `--trainer dpo` -- TRL's SFTTrainer / DPOTrainer plain
# against the same trainer under fasttrain.patch() -- on the Qwen3-0.6B shape in bf16, sequences up to 2,048
# tokens, one repetition each side (each in its own process). Sized for about a minute on one H200.
# --trainer grpo: GRPO's training phase at the same shape: `fasttrain bench --trainer grpo --completions synthetic`,
# TRL's GRPOTrainer plain against under patch(), each step on 2 prompts (log-normal lengths, median 180, up to 512
# tokens) x 8 "generated-looking" completions (random tokens of log-normal lengths up to 512; model.generate is
# replaced, so generation speed plays no part), fixed seed; the loss forward/backward and optimizer step timed.
#
#   bash benchmarks/gpu/bench_trl_gpu.sh [--out DIR] [--smoke] [--trainer sft|dpo|grpo]   (default: sft and dpo)
#
# Writes DIR/bench_{sft,dpo,grpo}_gpu.{json,md} (DIR defaults to benchmarks/results/): tokens/s, peak memory
# and the largest per-step difference of every metric TRL logs. --smoke: the same on CPU at a tiny size
# (bench_*_gpu_smoke.*). Both trainers run even when the first fails; the exit status says if either did.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2

out=benchmarks/results
smoke=0
trainers=(sft dpo)
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --out=*) out="${1#--out=}"; shift ;;
        --smoke) smoke=1; shift ;;
        --trainer) trainers=("$2"); shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "bench_trl_gpu.sh: unknown option $1 (use --out DIR, --smoke, --trainer sft|dpo|grpo)" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
python=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "$smoke" = 1 ]; then
    suffix=_gpu_smoke
    args=(--device cpu --model tiny --steps 2 --seq-len 48 --batch-size 2 --repeats 1)
    grpo_args=(--device cpu --model tiny --lengths lognormal --steps 2 --warmup-steps 1 --seq-len 48 --batch-size 4
               --num-generations 4 --max-completion-length 16 --completions synthetic --repeats 1)
else
    suffix=_gpu
    "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "bench_trl_gpu.sh: no CUDA device (use --smoke to check the script on CPU)" >&2; exit 2; }
    args=(--device cuda --model qwen3-0.6b --bf16 --seq-len 2048 --batch-size 2 --steps 6 --warmup-steps 2 --repeats 1
          --no-liger)  # TRL + Liger would be a third process per trainer: past the cap
    # 2 prompts x 8 completions a step in one micro-batch of 16; 2 warm-up steps (Triton compiles TRL's and
    # fasttrain's kernels in the first), 3 timed: most of the step's time is two processes starting
    grpo_args=(--device cuda --model qwen3-0.6b --bf16 --lengths lognormal --seq-len 512 --batch-size 16 --grad-accum 1
               --num-generations 8 --max-completion-length 512 --completions synthetic --steps 5 --warmup-steps 2
               --repeats 1)
fi

status=0
for trainer in "${trainers[@]}"; do
    name=bench_$trainer$suffix
    start=$(date +%s)
    run_args=("${args[@]}")
    [ "$trainer" = grpo ] && run_args=("${grpo_args[@]}")
    "$python" -m fasttrain bench --trainer "$trainer" "${run_args[@]}" --no-progress \
        --json "$out/$name.json" --markdown "$out/$name.md" || status=1
    echo "bench_trl_gpu.sh: $trainer done in $(( $(date +%s) - start )) s; results in $out/$name.*" >&2
done
exit $status
