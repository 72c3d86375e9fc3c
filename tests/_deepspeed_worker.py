"""DeepSpeed ZeRO training through ``transformers.Trainer`` on CPU, for tests/test_deepspeed.py.

usage: torchrun --nproc_per_node 2 tests/_deepspeed_worker.py OUT --stage {1,2,3} --runs truth,reference,fasttrain
       [--epochs N] [--rows N]

Runs, one after the other in the same processes (one launch, one DeepSpeed start-up):

- ``truth``: plain transformers in float64 (DeepSpeed keeps a float64 model in float64 when bf16/fp16 are off);
- ``reference``: plain transformers in float32;
- ``fasttrain``: the same float32 script under ``fasttrain.patch()``;
- ``fasttrain-ds-optimizer``: the same with an ``optimizer`` section in the DeepSpeed config (torch's AdamW);
- ``fasttrain-8bit``: ``fasttrain`` with ``optim_args="state_dtype=8bit"``;
- ``fasttrain-save`` / ``fasttrain-resume``: ``fasttrain`` saving a checkpoint at step 4, then resuming from it
  (``reference-save`` / ``reference-resume``: the same without fasttrain; ``fasttrain-8bit-save`` /
  ``fasttrain-8bit-resume``: the same with 8-bit moments);
- ``truth-tied``, ``reference-tied``, ``fasttrain-tied``: the same three with lm_head tied to the embedding.

Each writes OUT/<run>-rank<R>.json: the logged loss and grad_norm per step, the rows each rank trained on per
epoch, the hot-path status, and what detectors saw (lm_head forward calls, the optimizer DeepSpeed stepped, clips
FusedAdamW applied). Needs DS_ACCELERATOR=cpu (the launcher sets it). A run that raises writes its error instead.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import transformers
from accelerate.state import AcceleratorState, PartialState
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

import _engine_worker as engine  # beside this file
import _tiny as tiny  # beside this file: a script's own directory is on sys.path
import fasttrain

# DeepSpeed would JIT-compile its shared-memory all-reduce (a C++ build of minutes); gloo does the same job here
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def truth_stage(stage: int, dtype: torch.dtype) -> int:
    """The ZeRO stage a run uses. ZeRO-3 partitions the parameters through ``zero.Init``, which refuses float64
    (DeepSpeed 0.19.8: "Invalid data type torch.float64, allowed values are [torch.half, torch.bfloat16,
    torch.float]"), so the float64 truth of a ZeRO-3 launch runs ZeRO-2: the same data-parallel math on the same
    two ranks, sharded otherwise, which in float64 changes nothing the float32 runs could see."""
    return 2 if stage == 3 and dtype == torch.float64 else stage


def ds_config(stage: int, with_optimizer: bool) -> dict:
    config = {
        # ZeRO-3 keeps parameters under the persistence threshold (100k elements) whole on every rank: at 0
        # every weight of the tiny model is partitioned, lm_head's too (the fused loss must gather it)
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
    }
    if with_optimizer:
        # torch's AdamW (torch_adam) rather than DeepSpeed's FusedAdam, whose op would be compiled at run time
        config["optimizer"] = {
            "type": "AdamW",
            "params": {
                "lr": "auto",
                "betas": "auto",
                "eps": "auto",
                "weight_decay": "auto",
                "torch_adam": True,
            },
        }
    return config


def _distributed_state() -> PartialState:
    """Accelerate's process state, started as the Trainer will start it, with the true process count.

    Without an accelerator Accelerate finds no backend and records one process on every rank (the process group
    itself is DeepSpeed's, on gloo): each rank would then read every batch, and DeepSpeed's "auto" batch size
    would be filled for one process. Copy the truth from torch.distributed before any TrainingArguments reads it.
    """
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what TrainingArguments(deepspeed=...) sets
    state = PartialState()
    if dist.is_initialized() and state.num_processes != dist.get_world_size():
        state.num_processes = dist.get_world_size()
        state.process_index = dist.get_rank()
        state.local_process_index = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    return state


SAVE_STEP = 4  # fasttrain-save checkpoints here; fasttrain-resume resumes from it


def _run(
    patched=True,
    dtype=torch.float32,
    ds_optimizer=False,
    optim_args=None,
    save=False,
    resume=False,
    tied=False,
    bf16=False,
):
    return dict(
        patched=patched,
        dtype=dtype,
        ds_optimizer=ds_optimizer,
        optim_args=optim_args,
        save=save,
        resume=resume,
        tied=tied,
        bf16=bf16,
    )


RUNS = {
    "truth": _run(patched=False, dtype=torch.float64),
    "reference": _run(patched=False),
    "fasttrain": _run(),
    "fasttrain-ds-optimizer": _run(ds_optimizer=True),
    "fasttrain-8bit": _run(optim_args="state_dtype=8bit"),
    "fasttrain-stochastic-rounding": _run(optim_args="bf16_stochastic_rounding=true"),  # refused under ZeRO
    "fasttrain-save": _run(save=True),
    "fasttrain-resume": _run(resume=True),  # after fasttrain-save, in the same launch
    "fasttrain-8bit-save": _run(optim_args="state_dtype=8bit", save=True),
    "fasttrain-8bit-resume": _run(optim_args="state_dtype=8bit", resume=True),  # after fasttrain-8bit-save
    # lm_head tied to the input embedding: under ZeRO-3 the fused loss gathers the embedding's weight
    "truth-tied": _run(patched=False, dtype=torch.float64, tied=True),
    "reference-tied": _run(patched=False, tied=True),
    "fasttrain-tied": _run(tied=True),
    # DeepSpeed's bf16 mode: bf16 weights on the engine, fp32 master partitions in the ZeRO optimizer
    "reference-bf16": _run(patched=False, bf16=True),
    "fasttrain-bf16": _run(bf16=True),
    "reference-save": _run(patched=False, save=True),
    "reference-resume": _run(patched=False, resume=True),
}


def train_once(run: str, a: argparse.Namespace) -> dict:
    spec = RUNS[run]
    # TrainingArguments refuses bf16 without a bf16 GPU unless use_cpu, which would switch DeepSpeed off;
    # DeepSpeed's CPU accelerator runs bf16
    transformers.training_args.is_torch_bf16_gpu_available = lambda: True
    patched, dtype = spec["patched"], spec["dtype"]
    fasttrain.unpatch()
    if patched:
        fasttrain.patch()
    AcceleratorState._reset_state(reset_partial_state=False)  # each run gets its own DeepSpeed plugin
    # Built outside zero.Init: the same full weights on both ranks and in every run. A previous run's DeepSpeed
    # config may still be alive (until garbage collection) and would make from_config initialise the weights
    # partitioned, with other random values. Initialised in float32, then cast: the float64 truth starts from
    # the float32 runs' weights.
    unset_hf_deepspeed_config()
    model = tiny.model("qwen3")
    if spec["tied"]:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    model = model.to(dtype)
    initial_checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    lm_head_calls = [0]
    model.lm_head.register_forward_hook(lambda *_: lm_head_calls.__setitem__(0, lm_head_calls[0] + 1))
    args = tiny.training_args(
        str(Path(a.out) / run),
        use_cpu=False,  # use_cpu switches DeepSpeed off; DS_ACCELERATOR=cpu keeps everything on the CPU
        deepspeed=ds_config(truth_stage(a.stage, dtype), spec["ds_optimizer"]),
        max_steps=-1,
        num_train_epochs=a.epochs,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        train_sampling_strategy="group_by_length",
        optim_args=spec["optim_args"],
        save_strategy="steps" if spec["save"] else "no",
        save_steps=SAVE_STEP,
        accelerator_config={"use_configured_state": True},  # the process state _distributed_state corrected
        bf16=spec["bf16"],
    )
    trainer = engine.recorded_trainer(model, args, a.rows)
    checkpoint = Path(a.out, run.replace("-resume", "-save"), f"checkpoint-{SAVE_STEP}")
    trainer.train(resume_from_checkpoint=str(checkpoint) if spec["resume"] else None)
    return {
        **engine.shared_result(trainer, model, initial_checksum, lm_head_calls[0]),
        "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage,
        # outside the forward a ZeRO-3 weight is an empty placeholder (its ds_shape is the real one)
        "lm_head_numel_after_training": trainer.model.lm_head.weight.numel(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--runs", default="truth,reference,fasttrain")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rows", type=int, default=32)
    a = p.parse_args()
    rank = _distributed_state().process_index
    engine.run_each(a.out, a.runs.split(","), rank, lambda run: train_once(run, a))


if __name__ == "__main__":
    main()
