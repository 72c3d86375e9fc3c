"""The collator path: ``trainer.data_collator`` becomes the Rust equivalent of a transformers or TRL collator.

The Trainer's loaders (their worker processes too) call ``trainer.data_collator``: the evidence that ours runs is
that it still is the trainer's collator when the status settles.
"""

from __future__ import annotations

from typing import Any

from . import llamafactory
from .ledger import NOT_RUN, Seam


def _ours(collator: Any) -> bool:
    return type(collator).__module__.startswith("fasttrain.")


def arm(trainer: Any, seam: Seam) -> None:
    from ..data.collators import native_equivalent, replaced_in_kind, why_no_native_equivalent

    current = trainer.data_collator
    if _ours(current):
        return  # already ours ("on" once the Trainer's loaders run it)
    if (
        getattr(current, "__module__", "") == "trl.trainer.utils"
        and getattr(current, "__name__", "") == "identity"
    ):
        # GRPO and RLOO collate nothing: they build their batches themselves (generation, then padding)
        seam.off(
            "collator",
            f"{type(trainer).__name__} builds its batches itself (TRL's identity collator)",
            fallback=False,
        )
        return
    native = native_equivalent(current) or llamafactory.native_collator(current)
    if native is None:
        # a masked-LM collator, or one the probe refused (this transformers makes other batches, or has a field
        # we do not know), is a class we replace in kind but not here: a fallback; a user's own function or
        # subclass is simply not ours to replace
        seam.off("collator", why_no_native_equivalent(current), fallback=replaced_in_kind(current))
        return
    trainer.data_collator = native


def verdict(seam: Seam, trainer: Any, optimizer: Any) -> None:
    if seam.status["collator"] != NOT_RUN:
        return
    if _ours(trainer.data_collator):
        seam.status["collator"] = "on"
    else:
        seam.off("collator", "trainer.data_collator was replaced after __init__", fallback=False)
