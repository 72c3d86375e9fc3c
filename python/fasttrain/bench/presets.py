"""Every default of ``fasttrain bench``, in one table: the built-in presets and the GPU kit's. How the layers
combine (built-in preset, ``--preset``, the options given; ``--smoke``'s twins; "warmup_steps" capped at
``steps - 1``; "liger" None): ``cli.settings`` and ``cli.resolve``. "seq_len" may be a mapping per ``--lengths``
kind: the built-in limit differs for drawn and natural lengths."""

from __future__ import annotations

import dataclasses
from typing import Any

from . import models
from .config import FASTTRAIN, REFERENCE, Contender

# What every built-in preset shares; the entries below say only where they differ.
_COMMON: dict[str, Any] = {"dataset": "default", "grad_accum": 1, "warmup_steps": 2, "repeats": 2, "seed": 0,
                          "lr": 1e-3, "group_by_length": False, "liger": None}  # fmt: skip
# GRPO and RLOO generate before they train: --seq-len limits the prompts, --batch-size counts completions
_GENERATION = {"num_generations": 8, "max_completion_length": 512, "completions": "sampled",
               "warmup_steps": 1}  # fmt: skip
_TINY_CPU = {"device": "cpu", "model": "tiny", "repeats": 1}
# The tiny-CPU twins (--smoke): a run of seconds that goes through the same code as its preset
_TWIN = {**_TINY_CPU, "steps": 3, "warmup_steps": 1, "seq_len": 64, "batch_size": 2}
_TRL_TWIN = {**_TINY_CPU, "steps": 2, "seq_len": 48, "batch_size": 2}
_RL_TWIN = {**_TINY_CPU, "lengths": "lognormal", "steps": 2, "warmup_steps": 1, "seq_len": 48,
            "batch_size": 4, "num_generations": 4, "max_completion_length": 16}  # fmt: skip
_CUDA_SHAPE = {"device": "cuda", "model": "qwen3-0.6b", "bf16": True}
_FRONTIER = {**_COMMON, "model": "qwen3-0.6b", "lengths": "full", "batch_size": 1, "steps": 1,
             "warmup_steps": 0, "repeats": 1, "gradient_checkpointing": True, "frontier": True}  # fmt: skip
_FRONTIER_TWIN = {**_FRONTIER, **_TINY_CPU, "seq_len": 512, "max_length": 1024}  # 4 probes in a smoke run


@dataclasses.dataclass(frozen=True)
class Preset:
    summary: str
    options: dict[str, Any]
    smoke: dict[str, Any]  # the tiny-CPU twin (--smoke)


def _share(name: str) -> str:
    return f"{models.builtin_summary(name)['lm_head_matmul_share']:.0%}"


# fmt: off
# The CPU default, and what TRL's trainers change of it
_CPU = {**_COMMON, "model": "qwen3-0.6b", "lengths": "lognormal",
        "seq_len": {"lognormal": 512, "natural": 256}, "batch_size": 2, "steps": 4, "bf16": False}
PRESETS: dict[str, Preset] = {
    # A released model's shape whose LM head is a realistic share of the FLOPs; log-normal lengths like
    # instruction data, ungrouped, batches of 2: about 6 minutes on 2 cores (a step is ~15-20 s there).
    "cpu": Preset(
        f"qwen3-0.6b (LM head {_share('qwen3-0.6b')} of the matmul FLOPs), fp32, log-normal lengths up to "
        "512 (natural: 256), batch 2, 4 steps",
        _CPU,
        _TWIN,
    ),
    # DPO and KTO run a reference model beside the policy: at Qwen3-0.6B's shape a CPU run would take an hour
    "cpu-trl": Preset(
        f"TRL sft/dpo/kto on cpu: qwen3-cpu (LM head {_share('qwen3-cpu')} of the matmul FLOPs), fp32, "
        "log-normal lengths up to 1024 (natural: 256), batch 4, 12 steps",
        {**_CPU, "model": "qwen3-cpu", "seq_len": {"lognormal": 1024, "natural": 256}, "batch_size": 4,
         "steps": 12},
        _TRL_TWIN,
    ),
    # one prompt a step, 8 completions of up to 512 tokens: a few minutes on 2 cores, most of it sampling
    "cpu-rl": Preset(
        "TRL grpo/rloo on cpu: qwen3-cpu, fp32, one prompt (log-normal, up to 512 tokens) x 8 completions a "
        "step, 4 steps",
        {**_CPU, **_GENERATION, "model": "qwen3-cpu", "seq_len": 512, "batch_size": 8},
        _RL_TWIN,
    ),
    "cuda": Preset(
        "qwen3-0.6b, bf16, the corpus's natural lengths up to 4096, batch 2, 12 steps (+ Liger if installed)",
        {**_COMMON, **_CUDA_SHAPE, "lengths": "natural", "seq_len": 4096, "batch_size": 2, "steps": 12},
        _TWIN,
    ),
    # 4 prompts a step: 2 micro-batches of 16 completions
    "cuda-rl": Preset(
        "TRL grpo/rloo on cuda: qwen3-0.6b, bf16, 4 prompts x 8 completions a step, 6 steps",
        {**_COMMON, **_GENERATION, **_CUDA_SHAPE, "lengths": "natural", "seq_len": 512, "batch_size": 16,
         "grad_accum": 2, "steps": 6},
        _RL_TWIN,
    ),
    # The GPU kit (benchmarks/gpu/run.sh), sized for its caps on one H200. Two warm-up steps absorb Triton's
    # compilation (fasttrain's and Liger's kernels); most of each run is process start and model set-up.
    "gpu-e2e": Preset(
        "GPU kit: qwen3-0.6b, bf16, sequences up to 4096, batch 2, 8 steps, 2 repetitions (+ Liger if "
        "installed)",
        {**_CUDA_SHAPE, "seq_len": 4096, "batch_size": 2, "steps": 8, "warmup_steps": 2, "repeats": 2},
        _TWIN,
    ),
    # Batch 16: with 2 a padded batch wastes little and packing has little to win
    "gpu-packing": Preset(
        "GPU kit: packing's share: log-normal lengths up to 4096, batch 16, ungrouped, fasttrain with and "
        "without packing",
        {**_CUDA_SHAPE, "lengths": "lognormal", "group_by_length": False, "ablate": "packing", "repeats": 1,
         "seq_len": 4096, "batch_size": 16, "steps": 8, "warmup_steps": 2},
        {**_TINY_CPU, "lengths": "lognormal", "group_by_length": False, "ablate": "packing", "steps": 3,
         "warmup_steps": 1, "seq_len": 128, "batch_size": 4},
    ),
    **{
        f"gpu-{trainer}": Preset(
            f"GPU kit: TRL's {trainer.upper()}Trainer, qwen3-0.6b, bf16, sequences up to 2048, batch 2, "
            "6 steps",
            # no Liger: a third process per trainer would not fit the kit's cap
            {**_CUDA_SHAPE, "trainer": trainer, "seq_len": 2048, "batch_size": 2, "steps": 6,
             "warmup_steps": 2, "repeats": 1, "liger": False},
            {**_TRL_TWIN, "trainer": trainer},
        )
        for trainer in ("sft", "dpo")
    },
    # 2 prompts x 8 synthetic completions a step in one micro-batch: the training phase alone
    "gpu-grpo": Preset(
        "GPU kit: TRL's GRPOTrainer's training phase, qwen3-0.6b, bf16, 2 prompts x 8 synthetic completions "
        "of up to 512 tokens a step, 5 steps",
        {**_CUDA_SHAPE, "trainer": "grpo", "lengths": "lognormal", "seq_len": 512, "batch_size": 16,
         "grad_accum": 1, "num_generations": 8, "max_completion_length": 512, "completions": "synthetic",
         "steps": 5, "warmup_steps": 2, "repeats": 1},
        {**_RL_TWIN, "trainer": "grpo", "completions": "synthetic"},
    ),
    # --frontier (docs/usage.md): a step's time grows with the square of the length, so a budget just above
    # fp32 AdamW's own ~10.7 GiB and a cap of 4,096 bound the CPU search (43 CPU-minutes, docs/measured.md)
    "cpu-frontier": Preset(
        "--frontier on cpu: qwen3-0.6b, fp32, one optimizer step at batch 1 with gradient checkpointing, "
        "lengths from 512 doubled up to 4096 then bisected to within 10%, budget 12 GiB",
        {**_FRONTIER, "device": "cpu", "bf16": False, "seq_len": 512, "max_length": 4096,
         "memory_budget": "12GiB"},
        _FRONTIER_TWIN,
    ),
    # on cuda a 24 GB card's memory: ~8 min on an H200 (its whole memory: steps of tens of minutes, docs/usage.md)
    "cuda-frontier": Preset(
        "--frontier on cuda: qwen3-0.6b, bf16, one optimizer step at batch 1 with gradient checkpointing, "
        "lengths from 4096 doubled up to 262144 then bisected to within 10%, budget 24 GiB",
        {**_FRONTIER, **_CUDA_SHAPE, "seq_len": 4096, "max_length": 262144, "memory_budget": "24GiB"},
        _FRONTIER_TWIN,
    ),
}
# fmt: on


# python -m fasttrain.bench.model_frontier's settings: name -> (contender, bf16 weights, max_grad_norm, what
# it is). The step inside backward cannot wait for a global norm to clip by: max_grad_norm 0 there.
_LEAN = "state_dtype=8bit,bf16_stochastic_rounding=true,step_in_backward=true"
MODEL_FRONTIER: dict[str, tuple[Contender, bool, float | None, str]] = {
    "reference-fp32": (Contender("reference-fp32", REFERENCE), False, None,
                       "fp32 weights, adamw_torch_fused"),
    "reference-bf16": (Contender("reference-bf16", REFERENCE), True, None, "bf16 weights, adamw_torch_fused"),
    # what a reference user short of memory picks: bitsandbytes' 8-bit AdamW (it runs on CPU)
    "reference-bf16-8bit": (Contender("reference-bf16-8bit", REFERENCE, optim="adamw_bnb_8bit"), True, None,
                            "bf16 weights, bitsandbytes' 8-bit AdamW (optim adamw_bnb_8bit)"),
    "fasttrain-fp32": (Contender("fasttrain-fp32", FASTTRAIN), False, None, "fp32 weights, FusedAdamW"),
    "fasttrain-8bit": (Contender("fasttrain-8bit", FASTTRAIN, optim_args="state_dtype=8bit"), False, None,
                       "fp32 weights, 8-bit moments"),
    "fasttrain-lean": (Contender("fasttrain-lean", FASTTRAIN, optim_args=_LEAN), True, 0.0,
                       "bf16 weights + stochastic rounding, 8-bit moments, step in backward "
                       "(max_grad_norm 0)"),
}  # fmt: skip


def default_for(device: str, trainer: str, frontier: bool = False) -> str:
    """The built-in preset of a device, --trainer and --frontier: TRL's trainers keep a small CPU shape."""
    if frontier:
        return f"{device}-frontier"
    if trainer in ("grpo", "rloo"):
        return f"{device}-rl"
    return "cpu-trl" if device == "cpu" and trainer != "transformers" else device


def chosen(name: str | None, smoke: bool, trainer: str | None, frontier: bool = False) -> dict[str, Any]:
    """The options a preset sets, or its tiny-CPU twin's with ``smoke`` (the built-in preset's twin when no
    preset is named); none for no preset."""
    if smoke:
        return PRESETS[name or default_for("cpu", trainer or "transformers", frontier)].smoke
    return PRESETS[name].options if name else {}
