"""The packing path: padded training batches moved into one padding-free row, where exact and not dearer.

``get_train_dataloader`` builds the training loader with the trainer's collator wrapped in
``data.packing.PackingCollator`` for as long as the loader is built (its ``collate_fn`` keeps the packer; evaluation
loaders read ``trainer.data_collator`` and stay padded). ``training_step`` seeing a ``PackedBatch`` arrive is the
evidence that packing ran. Both hooks are installed only where the collator and the model allow packing at all
(``packing_policy``); the rest of the policy is read each time a loader is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .ledger import NOT_RUN, Seam, seam_of
from .packing_policy import (
    FLASH_ATTENTION,
    PackingCost,
    collator_problem,
    model_problem,
    problem,
    trainer_problem,
)
from .trainer_api import override


def arm(trainer: Any, seam: Seam) -> None:
    # what is known now (a model_init's model is not built yet); each loader build asks again
    now = (
        collator_problem(trainer.data_collator)
        or (None if trainer.model_init is not None else model_problem(trainer.model))
        or trainer_problem(trainer)
    )
    if now is not None:
        seam.off("packing", now, fallback=False)
        return
    override(trainer, "get_train_dataloader", _train_dataloader)
    override(trainer, "training_step", _packing_evidence)


def _train_dataloader(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from ..data.packing import PackingCollator

    seam = seam_of(trainer)
    why = problem(trainer)
    if why is not None:
        seam.off("packing", why, fallback=False)
        return original(*args, **kwargs)
    collator = trainer.data_collator
    attention = getattr(trainer.model.config, "_attn_implementation", None)
    seam.packer = PackingCollator(
        collator, flash=attention in FLASH_ATTENTION, cost=PackingCost(trainer.model.config, attention)
    )
    seam.not_run_yet("packing")  # an earlier loader may have said off
    trainer.data_collator = seam.packer
    try:
        return original(*args, **kwargs)
    finally:
        trainer.data_collator = collator


def _packing_evidence(
    trainer: Any, original: Callable[..., Any], model: Any, inputs: Any, *args: Any, **kwargs: Any
) -> Any:
    from ..data.packing import PackedBatch

    if isinstance(inputs, PackedBatch):
        seam_of(trainer).packed_steps += 1
    return original(model, inputs, *args, **kwargs)


def verdict(seam: Seam, trainer: Any, optimizer: Any) -> None:
    if seam.status["packing"] != NOT_RUN:
        return
    if seam.packed_steps:
        seam.status["packing"] = "on"
    elif seam.packer is not None and seam.packer.last_refusal is not None:
        packer = seam.packer  # packing cheaper batches only is a choice, not a fallback
        reason = f"every batch stayed padded ({packer.last_refusal})"
        seam.off("packing", reason, fallback=not packer.last_refusal_for_cost)
    else:
        seam.off("packing", "no packed batch reached training_step")
