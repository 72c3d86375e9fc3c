"""LLaMA-Factory's collators with their padding in Rust.

LLaMA-Factory's SFT, pairwise (DPO) and KTO collators are dataclass subclasses of transformers'
``DataCollatorForSeq2Seq`` (through its ``MultiModalDataCollatorForSeq2Seq``): their ``__call__`` prepares the rows
(media columns popped, placeholder media for multimodal templates, chosen/rejected and KL rows laid out) and then
pads them with ``DataCollatorForSeq2Seq.__call__``, before adding rope position ids, 4D masks or casts of its own.
The twin of such a collator is the same object with fasttrain's ``DataCollatorForSeq2Seq`` placed under
LLaMA-Factory's classes in its MRO: all of LLaMA-Factory's code runs as it is, and only the padding it ends in is
Rust's, which makes transformers' batches byte for byte (or hands the batch to transformers', as the Rust collators
do, behind the same agreement probe).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import transformers

from .collators import DataCollatorForSeq2Seq

__all__ = ["KNOWN", "twin_of"]

# LLaMA-Factory 0.9's collators that end in DataCollatorForSeq2Seq.__call__
KNOWN = (
    "SFTDataCollatorWith4DAttentionMask",
    "PairwiseDataCollatorWithPadding",
    "KTODataCollatorWithPadding",
)
# set by MultiModalDataCollatorForSeq2Seq.__post_init__, read by its own code only
_SET_IN_POST_INIT = frozenset({"get_rope_func"})
_twins: dict[type, type] = {}


def _is_known(cls: type) -> bool:
    return cls.__name__ in KNOWN and cls.__module__.startswith("llamafactory.")


def _twin_class(cls: type) -> type:
    twin = _twins.get(cls)
    if twin is None:
        padding = {f.name for f in dataclasses.fields(transformers.DataCollatorForSeq2Seq)}
        own = {f.name for f in dataclasses.fields(cls)} - padding | _SET_IN_POST_INIT
        twin = _twins[cls] = type(
            cls.__name__,
            (cls, DataCollatorForSeq2Seq),
            {
                "__module__": __name__,
                "__qualname__": cls.__name__,
                "__doc__": f"LLaMA-Factory's {cls.__name__}, padded by fasttrain's DataCollatorForSeq2Seq.",
                # LLaMA-Factory's own fields: its code reads them, not the padding (collator_probe.refusal)
                "fasttrain_extra_fields": frozenset(own),
            },
        )
    return twin


def twin_of(collator: Any) -> Any | None:
    """The twin of one of LLaMA-Factory's collators (``KNOWN``, exactly that class), or None."""
    cls = type(collator)
    if not _is_known(cls) or not issubclass(cls, transformers.DataCollatorForSeq2Seq):
        return None
    twin = copy.copy(collator)
    twin.__class__ = _twin_class(cls)
    return twin
