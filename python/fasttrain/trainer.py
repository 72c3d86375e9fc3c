"""``fasttrain.Trainer``: the transformers Trainer with fasttrain's hot paths switched on."""

from __future__ import annotations

from typing import Any

import transformers
from transformers import TrainingArguments

from ._logging import logger
from .hot_paths import HotPaths

__all__ = ["HotPaths", "Trainer", "TrainingArguments"]


class Trainer(transformers.Trainer):
    """Same constructor as ``transformers.Trainer``, plus ``hot_paths`` (keyword only) to switch paths off."""

    def __init__(self, *args: Any, hot_paths: HotPaths | None = None, **kwargs: Any) -> None:
        self.hot_paths = HotPaths.from_env(hot_paths)
        super().__init__(*args, **kwargs)
        self.fasttrain_status: dict[str, str] = {}
        logger.info("fasttrain hot paths requested: %s", self.hot_paths)
