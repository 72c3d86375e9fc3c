"""What the engine workers (``_deepspeed_worker.py``, ``_fsdp_trainer_worker.py``) share: the recorded Trainer they
train, the result fields every run reports, and the loop that runs each named run in the same processes."""

from __future__ import annotations

import gc
import json
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import transformers

import _tiny as tiny
import fasttrain


def innermost_optimizer(optimizer):
    """Through every wrapper (Accelerate's, DeepSpeed's, ZeRO's) to the optimizer that steps the parameters."""
    while getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
    return optimizer


def recorded_trainer(model, args: transformers.TrainingArguments, rows: int) -> transformers.Trainer:
    """The reference Trainer (``fasttrain.patch()`` decides whether fasttrain runs), recording the rows each epoch
    trains on, over ``rows`` examples of the tiny dataset padded per batch."""
    tok = tiny.tokenizer()
    trainer = tiny.recording(transformers.Trainer)(
        model=model,
        args=args,
        train_dataset=tiny.dataset(n=rows, with_length=True),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    trainer.rows_by_epoch = {}
    return trainer


def shared_result(trainer, model, initial_checksum: float, lm_head_calls: int) -> dict:
    """The fields every engine run reports: its logs, the rows it saw, the status, and what the detectors saw."""
    inner = innermost_optimizer(trainer.optimizer)
    return {
        "initial_checksum": initial_checksum,
        "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "logs": tiny.step_logs(trainer),
        "rows_by_epoch": trainer.rows_by_epoch,
        "status": dict(getattr(trainer, "fasttrain_status", {})),
        "world_size": trainer.args.world_size,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "lm_head_calls": lm_head_calls,
        "inner_optimizer": f"{type(inner).__module__}.{type(inner).__qualname__}",
        "inner_optimizer_states": len(inner.state),
        "inner_state_keys": sorted({k for state in inner.state.values() for k in state}),
        "deferred_clips_applied": getattr(inner, "deferred_clips_applied", None),
        "weights_dtype": str(next(trainer.model.parameters()).dtype),
    }


def run_each(out: str, runs: list[str], rank: int, run_one: Callable[[str], dict]) -> None:
    """Each run in turn, writing OUT/<run>-rank<R>.json (its error, if it raised: one crash must not hide the
    other runs' results); then the process group is closed cleanly."""
    for run in runs:
        try:
            result = run_one(run)
        except Exception as err:
            result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        Path(out, f"{run}-rank{rank}.json").write_text(json.dumps(result))
        gc.collect()
    fasttrain.unpatch()
    if dist.is_initialized():
        dist.barrier()  # gloo can abort a rank at interpreter shutdown while another still communicates
        dist.destroy_process_group()
