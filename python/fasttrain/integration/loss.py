"""The loss path for transformers models: the fused-linear cross-entropy inside the model's forward.

The model's forward is wrapped per instance (``loss.model_patch``; ``model_init`` wrapped so that a model rebuilt by
hyperparameter search gets it too), and ``prediction_step`` so that a loss-only evaluation takes the fused path.
``LOSS_MAPPING`` is not touched: the Trainer checks it by identity to count ``num_items_in_batch``. A trainer of
TRL's gets its fused LM head served instead (``loss_trl``); a subclass with a ``compute_loss`` of its own keeps its
path, since it may read the logits the fused path never makes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from . import liger, loss_trl
from .ledger import NOT_RUN, Seam
from .trainer_api import is_trl_trainer, override, overriding_class


def arm(trainer: Any, seam: Seam) -> None:
    if is_trl_trainer(trainer):
        loss_trl.arm(trainer, seam)
        return
    owner = overriding_class(trainer, "compute_loss")
    if owner is not None:
        seam.off("loss", f"{owner.__name__}.compute_loss is overridden and may need the logits")
        return
    enabled = False
    if trainer.model_init is not None:
        model_init = trainer.model_init
        trainer.model_init = functools.wraps(model_init)(
            lambda *a: _enable(seam, model_init(*a))  # hyperparameter search rebuilds the model
        )
        enabled = True
    if trainer.model is not None:
        enabled = _enable(seam, trainer.model) is not None or enabled
    if enabled:
        override(trainer, "prediction_step", _prediction_step)
        liger.arm(trainer)


def _enable(seam: Seam, model: Any) -> Any:
    """``model`` with the fused loss switched on, or None (the reason in the status)."""
    from ..loss.model_patch import enable_fused_loss

    reason = enable_fused_loss(model)
    if reason is not None:
        seam.off("loss", reason)
        return None
    if seam.status["loss"] != "on":
        seam.not_run_yet("loss")
    return model


def _prediction_step(
    trainer: Any,
    original: Callable[..., Any],
    model: Any,
    inputs: Any,
    prediction_loss_only: bool,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """A loss-only evaluation takes the fused path too; otherwise the logits are made as before."""
    from ..loss.model_patch import set_eval_fused

    if not prediction_loss_only:
        return original(model, inputs, prediction_loss_only, *args, **kwargs)
    set_eval_fused(trainer.model, True)
    try:
        return original(model, inputs, prediction_loss_only, *args, **kwargs)
    finally:
        set_eval_fused(trainer.model, False)


def verdict(seam: Seam, trainer: Any, optimizer: Any) -> None:
    _verdict(seam, trainer)
    if not is_trl_trainer(trainer):
        liger.say_who_serves_what(seam, trainer)


def _verdict(seam: Seam, trainer: Any) -> None:
    if seam.status["loss"] != NOT_RUN:
        return
    if is_trl_trainer(trainer):
        calls = loss_trl.fused_calls(trainer)
    else:
        from ..loss.model_patch import fused_loss_calls

        calls = fused_loss_calls(trainer.model) if trainer.model is not None else 0
    if calls:
        seam.status["loss"] = "on"
    elif getattr(trainer, "label_smoother", None) is not None:
        # the Trainer takes the labels out of the inputs and smooths the loss from the logits itself
        smoothing = trainer.args.label_smoothing_factor
        seam.off(
            "loss",
            f"label_smoothing_factor={smoothing}: the Trainer computes the smoothed loss from the logits",
        )
    else:
        seam.off("loss", "no training forward took the fused path (no labels?)")
