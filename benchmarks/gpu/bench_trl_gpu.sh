#!/usr/bin/env bash
# TRL on one GPU: `fasttrain bench --trainer sft` then `--trainer dpo` -- TRL's SFTTrainer / DPOTrainer plain
# against the same trainer under fasttrain.patch() -- on the Qwen3-0.6B shape in bf16, sequences up to 2,048
# tokens, one repetition each side (each in its own process). Sized for about a minute on one H200.
#
#   bash benchmarks/gpu/bench_trl_gpu.sh [--out DIR] [--smoke] [--trainer sft|dpo]   (default: both)
#
# Writes DIR/bench_{sft,dpo}_gpu.{json,md} (DIR defaults to benchmarks/results/): tokens/s, peak memory and
# the largest per-step difference of every metric TRL logs. --smoke: the same on CPU at a tiny size
# (bench_{sft,dpo}_gpu_smoke.*). Both trainers run even when the first fails; the exit status says if either did.
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
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) echo "bench_trl_gpu.sh: unknown option $1 (use --out DIR, --smoke, --trainer sft|dpo)" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
python=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "$smoke" = 1 ]; then
    suffix=_gpu_smoke
    args=(--device cpu --model tiny --steps 2 --seq-len 48 --batch-size 2 --repeats 1)
else
    suffix=_gpu
    "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "bench_trl_gpu.sh: no CUDA device (use --smoke to check the script on CPU)" >&2; exit 2; }
    args=(--device cuda --model qwen3-0.6b --bf16 --seq-len 2048 --batch-size 2 --steps 6 --warmup-steps 2 --repeats 1
          --no-liger)  # TRL + Liger would be a third process per trainer: past the cap
fi

status=0
for trainer in "${trainers[@]}"; do
    name=bench_$trainer$suffix
    start=$(date +%s)
    "$python" -m fasttrain bench --trainer "$trainer" "${args[@]}" --no-progress \
        --json "$out/$name.json" --markdown "$out/$name.md" || status=1
    echo "bench_trl_gpu.sh: $trainer done in $(( $(date +%s) - start )) s; results in $out/$name.*" >&2
done
exit $status
