"""``fasttrain.Trainer``: the transformers Trainer with fasttrain's hot paths switched on.

It only adds ``hot_paths`` to the constructor and calls ``fasttrain.integration.apply`` (the same seam
``fasttrain.patch()`` uses) after the Trainer's own ``__init__``. Arguments, callbacks, evaluation, checkpoints,
logging and the Accelerate integration are the transformers ones.
"""

from __future__ import annotations

from typing import Any

import transformers
from transformers import TrainingArguments

from . import integration
from .hot_paths import HotPaths

__all__ = ["HotPaths", "Trainer", "TrainingArguments"]


class Trainer(transformers.Trainer):
    """Same constructor as ``transformers.Trainer``, plus ``hot_paths`` (keyword only) to switch paths off.

    ``trainer.fasttrain_status`` maps each hot path (optimizer, clip, loss, collator, sampler) to ``"on"`` once it
    has run, or ``"off: <reason>"``; it is settled, and logged in one line, after the first optimizer step.
    """

    def __init__(self, *args: Any, hot_paths: HotPaths | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        integration.apply(self, hot_paths)
