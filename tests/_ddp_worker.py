"""DDP (two gloo CPU processes under torchrun) or one process, through ``transformers.Trainer`` under
``fasttrain.patch()``, for the 8-bit moments and resume tests of tests/test_distributed.py.

usage: torchrun --nproc_per_node 2 tests/_ddp_worker.py OUT --runs fasttrain-save,fasttrain-resume,...
       python tests/_ddp_worker.py OUT --runs single-8bit      (one process: the 8-bit truth of the DDP runs)

Runs, one after the other in the same processes (a name is read as its parts):

- ``fasttrain``: the tiny Qwen3 under ``fasttrain.patch()``, 2 rows per device and 2 accumulation steps, 6 steps
  at a learning rate of 1e-2 (the tiny default of 3e-3 barely moves the loss in 6 steps);
- ``-8bit``: with ``optim_args="state_dtype=8bit,min_8bit_size=256"`` (every matrix's moments in 8 bits);
- ``-save``: saving the Trainer's checkpoint at step ``SAVE_STEP`` (the run itself goes on, uninterrupted);
- ``-resume``: resuming from the checkpoint its ``-save`` twin wrote, in the same launch;
- ``-noclip``: ``max_grad_norm=0``; ``-inbw``: ``step_in_backward=true`` in ``optim_args`` (which needs
  ``max_grad_norm=0`` too): under DDP the step runs in a communication hook on each bucket's averaged gradient;
- ``-tied``: lm_head tied to the input embedding (the embedding's gradient rows go into the head's gradient in
  place, ``fasttrain.loss.tied_embedding``); ``-dense``: that path off (the embedding's own dense gradient);
- ``single`` / ``single-8bit``: one process, 2 rows and 4 accumulation steps: the same 8 rows a step as two DDP
  ranks train on (the seeded random sampler, cut in consecutive batches of 2 that Accelerate deals out to the
  ranks in turn), summed in another order.

Each writes OUT/<run>-rank<R>.json: the logged loss and grad_norm per step, the rows trained on per step, the
hot-path status and the optimizer state's keys. A run that raises writes its error instead.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import torch

import _engine_worker as engine  # beside this file: a script's own directory is on sys.path
import _tiny as tiny
import fasttrain
from fasttrain.loss import tied_embedding

SAVE_STEP = 3
EIGHT_BIT = "state_dtype=8bit,min_8bit_size=256"
IN_BACKWARD = "step_in_backward=true"


def train_once(run: str, a: argparse.Namespace) -> dict:
    single = run.startswith("single")
    fasttrain.unpatch()
    fasttrain.patch()
    model = tiny.model("qwen3")
    if "-tied" in run:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    expose, rows_path = tied_embedding.expose, []

    # evidence that the path ran (-dense: the head's gradient is never handed over)
    def counted(model, weight):
        out = weight if "-dense" in run else expose(model, weight)
        rows_path.append(out is not weight)
        return out

    tied_embedding.expose = counted
    try:
        return {**_train(run, a, model, single), "tied_rows_forwards": sum(rows_path)}
    finally:
        tied_embedding.expose = expose


def _train(run: str, a: argparse.Namespace, model, single: bool) -> dict:
    initial_checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    args = tiny.training_args(
        str(Path(a.out) / run),
        max_steps=a.steps,
        learning_rate=a.lr,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4 if single else 2,
        optim_args=",".join(o for o, part in ((EIGHT_BIT, "-8bit"), (IN_BACKWARD, "-inbw")) if part in run)
        or None,
        **({"max_grad_norm": 0.0} if "-noclip" in run or "-inbw" in run else {}),
        save_strategy="steps" if run.endswith("-save") else "no",
        save_steps=SAVE_STEP,
        ddp_backend=None if single else "gloo",
    )
    trainer = engine.recorded_trainer(model, args, a.rows)
    checkpoint = Path(a.out, run.replace("-resume", "-save"), f"checkpoint-{SAVE_STEP}")
    trainer.train(resume_from_checkpoint=str(checkpoint) if run.endswith("-resume") else None)
    result = engine.shared_result(trainer, model, initial_checksum, lm_head_calls=0)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    result["weights_sha256"] = digest.hexdigest()  # bit-for-bit evidence without shipping the weights
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--runs", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-2)
    a = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    engine.run_each(a.out, a.runs.split(","), rank, lambda run: train_once(run, a))


if __name__ == "__main__":
    main()
