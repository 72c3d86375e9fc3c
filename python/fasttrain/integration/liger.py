"""Composing with Liger's layer kernels (``use_liger_kernel=True``): Liger keeps the layers, fasttrain the head.

The Trainer applies Liger when training starts (in ``Trainer.train``), after fasttrain wrapped the model's forward:
Liger's kernels (RMSNorm, RoPE, SwiGLU, ... as ``liger_kernel_config`` says) go into the backbone's modules and
functions, and its fused-linear-cross-entropy forward replaces the model's forward on the instance. Before each
training step the fused forward is put back on top of it (``wrap_again_if_replaced``, a no-op once done): the
backbone keeps Liger's layer kernels, the LM head and the loss are fasttrain's. The status line says who serves what.
TRL's trainers are not handled here: they keep their own Liger integration.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .ledger import Seam
from .trainer_api import override

_HEAD_KERNELS = ("cross_entropy", "fused_linear_cross_entropy")


def asked(trainer: Any) -> bool:
    return bool(getattr(trainer.args, "use_liger_kernel", False))


def arm(trainer: Any) -> None:
    """Called by the loss path once the fused loss is enabled on a transformers model."""
    if asked(trainer):
        override(trainer, "training_step", _keep_fused_head_on_top)


def _keep_fused_head_on_top(
    trainer: Any, original: Callable[..., Any], model: Any, *args: Any, **kwargs: Any
):
    from ..loss.model_patch import wrap_again_if_replaced

    if trainer.model is not None:
        wrap_again_if_replaced(trainer.model)
    return original(model, *args, **kwargs)


def kernels(trainer: Any) -> tuple[list[str], bool]:
    """(Liger's layer kernels this model gets, whether Liger's fused-linear cross-entropy is asked for), from
    Liger's own table of model types and the defaults of that type's apply function under ``liger_kernel_config``."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return [], False
    model_type = getattr(getattr(trainer.model, "config", None), "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        return [], False
    config = trainer.args.liger_kernel_config or {}
    on = [
        name
        for name, parameter in inspect.signature(apply).parameters.items()
        if isinstance(parameter.default, bool) and config.get(name, parameter.default)
    ]
    return [n for n in on if n not in _HEAD_KERNELS], "fused_linear_cross_entropy" in on


def say_who_serves_what(seam: Seam, trainer: Any) -> None:
    """The status line's account of a run with ``use_liger_kernel=True`` (after the loss path's verdict)."""
    if not asked(trainer) or trainer.model is None:
        return
    layers, liger_head = kernels(trainer)
    served = f"Liger serves {', '.join(layers) or 'no layer kernel of this model'}"
    if seam.status["loss"] == "on":
        head = "fasttrain serves the LM head and loss" + (
            " in place of Liger's fused_linear_cross_entropy" if liger_head else ""
        )
    elif liger_head:
        head = "Liger's fused_linear_cross_entropy serves the LM head and loss"
    else:
        head = "the model's own LM head and loss run"
    seam.others.append(f"use_liger_kernel=True: {served}; {head}")
