"""``fasttrain.Trainer``: the transformers Trainer with fasttrain's hot paths switched on.

Every override hands the decision to ``fasttrain.integration`` (shared with ``fasttrain.patch()``), passing
``super()``'s method as the path to fall back on. Nothing else of the Trainer changes: arguments,
callbacks, evaluation, checkpoints, logging and the Accelerate integration are the transformers ones.
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

    After construction ``trainer.fasttrain_status`` maps each hot path (optimizer, clip, loss, collator,
    sampler) to ``"on"`` or ``"off: <reason>"``; it is settled, and logged in one line, when training starts.
    """

    def __init__(self, *args: Any, hot_paths: HotPaths | None = None, **kwargs: Any) -> None:
        self.hot_paths = HotPaths.from_env(hot_paths)
        super().__init__(*args, **kwargs)
        integration.attach(self)

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        return integration.train_sampler(super()._get_train_sampler, self, train_dataset)

    def create_optimizer(self, model: Any = None) -> Any:
        return integration.create_optimizer(super().create_optimizer, self, model)

    def _clip_grad_norm(self, model: Any) -> Any:
        return integration.clip_grad_norm(super()._clip_grad_norm, self, model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        return integration.grad_norm(super()._get_grad_norm, self, model, grad_norm)

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return integration.compute_loss(super().compute_loss, self, model, inputs, *args, **kwargs)

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, *args: Any, **kwargs: Any) -> Any:
        return integration.prediction_step(
            super().prediction_step, self, model, inputs, prediction_loss_only, *args, **kwargs
        )
