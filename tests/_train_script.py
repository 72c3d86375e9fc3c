"""A training run in its own process, for tests that kill it or launch it distributed.

usage: python tests/_train_script.py OUT_DIR [--trainer fasttrain|reference] [--kill-at-save STEP]
       [--max-steps N] [--save-steps N] [--resume CKPT] [--group-by-length] [--record] [--float64]
       [--max-tokens-per-batch N]

Writes OUT_DIR/result-rank{R}.json: per-step loss and grad_norm, the rows each rank trained on per epoch
(--record), a checksum of the final weights, and the hot-path status. ``--float64`` trains the float64 twin of
the same model (the truth the parity tests compare against; use it with ``--trainer reference``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
import transformers

import _tiny as tiny  # beside this file: a script's own directory is on sys.path
import _truth
import fasttrain


class KillAtSave(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--trainer", default="fasttrain", choices=["fasttrain", "reference"])
    p.add_argument("--kill-at-save", type=int)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--epochs", type=float)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--resume")
    p.add_argument("--group-by-length", action="store_true")
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--float64", action="store_true")
    p.add_argument("--max-tokens-per-batch", type=int)
    a = p.parse_args()

    base = fasttrain.Trainer if a.trainer == "fasttrain" else transformers.Trainer
    # a token budget is checked with packing on: the rows are read at the model's forward (a training_step of the
    # test's own would keep fasttrain's batches padded)
    cls = base if a.max_tokens_per_batch else tiny.recording(base)
    tok = tiny.tokenizer()
    overrides = dict(
        max_steps=a.max_steps if a.epochs is None else -1,
        num_train_epochs=a.epochs or 1,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )
    if a.group_by_length:
        overrides["train_sampling_strategy"] = "group_by_length"
    model = tiny.model("llama")
    budget = {"max_tokens_per_batch": a.max_tokens_per_batch} if a.max_tokens_per_batch else {}
    trainer = cls(
        model=_truth.float64_twin(model) if a.float64 else model,
        args=tiny.training_args(a.out, **overrides),
        train_dataset=tiny.dataset(n=a.rows, with_length=True),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
        callbacks=[KillAtSave(a.kill_at_save)] if a.kill_at_save else None,
        **budget,
    )
    if a.max_tokens_per_batch:
        tiny.record_forwards(trainer)
    else:
        trainer.rows_by_epoch = {}
    trainer.train(resume_from_checkpoint=a.resume)
    rank = trainer.args.process_index
    weights = {n: p.detach().double().sum().item() for n, p in trainer.model.named_parameters()}
    result = {
        "logs": tiny.step_logs(trainer),
        "rows_by_epoch": trainer.rows_by_epoch,
        "batch_tokens": getattr(trainer, "batch_tokens", []),
        "weights": weights,
        "status": getattr(trainer, "fasttrain_status", {}),
        "world_size": trainer.args.world_size,
        "distributed_type": str(trainer.accelerator.distributed_type),
    }
    Path(a.out, f"result-rank{rank}.json").write_text(json.dumps(result))
    torch.save(trainer.model.state_dict(), Path(a.out, f"final-rank{rank}.pt"))
    if torch.distributed.is_initialized():
        # Without this, gloo's worker threads can still hold work when the interpreter shuts down, and a rank
        # aborts at exit ("terminate called without an active exception", SIGABRT) after training succeeded.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        # Even then a rank has aborted in the C++ static destructors (seen in CI, on the plain transformers run
        # as on ours): every result is written and the group is gone, so leave without interpreter teardown,
        # as the job workers do (_gloo_ranks.run_jobs).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
