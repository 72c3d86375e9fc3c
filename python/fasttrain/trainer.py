"""``fasttrain.Trainer``: the transformers Trainer with fasttrain's hot paths switched on.

Its ``__init__`` is the Trainer's own, then ``fasttrain.integration.apply`` (the same seam ``fasttrain.patch()``
uses). Arguments, callbacks, evaluation, checkpoints, logging and the Accelerate integration are the transformers
ones.
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

    ``trainer.fasttrain_status`` maps each hot path (optimizer, clip, loss, collator, sampler, packing) to ``"on"``
    once it has run, or ``"off: <reason>"``; it is settled, and logged in one line, after the first optimizer step.

    ``max_tokens_per_batch`` (keyword only, default None: off) trains on token-budget batches instead of
    ``per_device_train_batch_size`` examples: each batch holds whole examples whose lengths sum to at most that
    many tokens (an example longer than that is a batch of its own), so a packed row keeps a stable size.
    Every example once per epoch, in a random order from ``data_seed`` (else ``seed``) and the epoch, grouped
    by length if ``train_sampling_strategy="group_by_length"``; under data parallelism each rank gets whole
    batches, the same number on every rank (see ``fasttrain.TokenBudgetBatchSampler``). It changes which
    examples share a batch, so it is an opt-in, not a drop-in default; ``fasttrain.patch()`` does not set it.
    """

    def __init__(
        self,
        *args: Any,
        hot_paths: HotPaths | None = None,
        max_tokens_per_batch: int | None = None,
        **kwargs: Any,
    ) -> None:
        if max_tokens_per_batch is not None:
            from .data.sampler import check_max_tokens

            max_tokens_per_batch = check_max_tokens(max_tokens_per_batch)  # a ValueError before any set-up
        super().__init__(*args, **kwargs)
        integration.apply(self, hot_paths, max_tokens_per_batch=max_tokens_per_batch)
