#!/usr/bin/env bash
# End-to-end training throughput on one GPU: `fasttrain bench --device cuda` on the Qwen3-0.6B shape in
# bf16 at sequence length 4,096 — transformers.Trainer (default optim adamw_torch_fused), the same Trainer
# with use_liger_kernel=True when liger_kernel is installed, and fasttrain.Trainer — two alternating
# repetitions each, each run in its own process. Sized for run.sh's caps of its e2e and packing steps on one H200.
#
# --packing measures instead what variable-length data gives (issue 18): log-normal example lengths (median
# 180 tokens, up to 4,096) in batches of 16, ungrouped, sdpa attention: transformers.Trainer padded (the
# reference), fasttrain.Trainer (packed rows where they cost no more than the padded batch) and fasttrain.Trainer
# with packing switched off (--ablate packing), one repetition each; peak GPU memory beside tokens/s.
#
#   bash benchmarks/gpu/bench_e2e_gpu.sh [--packing] [--out DIR] [--smoke]
#
# Writes DIR/bench_e2e_gpu.{json,md,png} (bench_packing_gpu.* with --packing; DIR defaults to
# benchmarks/results/): GPU name, versions, date and the exact command are inside. --smoke runs the same script
# on CPU at a tiny size (no GPU needed), to check that it runs through; it writes NAME_smoke.* instead.
set -euo pipefail
cd "$(dirname "$0")/../.."

out=benchmarks/results
smoke=0
packing=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --out=*) out="${1#--out=}"; shift ;;
        --smoke) smoke=1; shift ;;
        --packing) packing=1; shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "bench_e2e_gpu.sh: unknown option $1 (use --packing, --out DIR, --smoke)" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
python=${PYTHON:-python3}  # the GPU machine has python3, not python
# The GPU machine has no network: never wait on the hub.
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ "$smoke" = 0 ]; then
    "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || { echo "bench_e2e_gpu.sh: no CUDA device (use --smoke to check the script on CPU)" >&2; exit 2; }
fi

if [ "$packing" = 1 ]; then
    name=bench_packing_gpu
    # Lengths drawn like instruction data; packing's share is the fasttrain run against its own ablation.
    # Batch 16: with 2 (the e2e default) a padded batch wastes little and packing has little to win.
    args=(--lengths lognormal --no-group-by-length --ablate packing --repeats 1)
    if [ "$smoke" = 1 ]; then
        name=${name}_smoke
        args+=(--device cpu --model tiny --steps 3 --warmup-steps 1 --seq-len 128 --batch-size 4)
    else
        args+=(--device cuda --model qwen3-0.6b --bf16 --seq-len 4096 --batch-size 16 --steps 8 --warmup-steps 2)
    fi
elif [ "$smoke" = 1 ]; then
    name=bench_e2e_gpu_smoke
    args=(--device cpu --model tiny --steps 3 --warmup-steps 1 --seq-len 64 --batch-size 2 --repeats 1)
else
    name=bench_e2e_gpu
    # Two warm-up steps absorb Triton compilation (fasttrain's and Liger's kernels) in the first repetition;
    # 8 steps keep 6 timed ones. Most of each run is process start and model set-up, not steps.
    args=(--device cuda --model qwen3-0.6b --bf16 --seq-len 4096 --batch-size 2 --steps 8 --warmup-steps 2
          --repeats 2)
    if "$python" -c "import liger_kernel" 2>/dev/null; then
        args+=(--liger)
    else
        echo "bench_e2e_gpu.sh: liger_kernel is not installed: comparing against the default Trainer only" >&2
    fi
fi

outputs=(--json "$out/$name.json" --markdown "$out/$name.md")
if "$python" -c "import matplotlib" 2>/dev/null; then
    outputs+=(--plot "$out/$name.png")
else
    echo "bench_e2e_gpu.sh: matplotlib is not installed: no plot" >&2
fi

start=$(date +%s)
"$python" -m fasttrain bench "${args[@]}" --no-progress "${outputs[@]}"
echo "bench_e2e_gpu.sh: done in $(( $(date +%s) - start )) s; results in $out/$name.*" >&2
