"""The optimizer path: ``FusedAdamW`` in place of the AdamW the Trainer would build.

The Trainer's ``create_optimizer`` (a documented override point) gets ``FusedAdamW`` through
``optimizer_cls_and_kwargs``, with the kwargs transformers itself derives from the arguments at that moment
(hyperparameter search changes them per trial); weight decay comes with the Trainer's parameter groups. Under
DeepSpeed it becomes the client optimizer that ZeRO steps on its flat fp32 partitions, unless the DeepSpeed config
has an ``optimizer`` section: then DeepSpeed builds its own inside the engine, and the first ``training_step`` finds
it, so that the status still settles at its first step. ``optim_args`` are read, and refused, at construction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..optim.options import TRAINER_OPTIONS, fused_adamw_options
from . import in_backward, settle
from .ledger import NOT_RUN, Seam, seam_of
from .trainer_api import override

ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
DEEPSPEED_OPTIMIZER = "DeepSpeed's config chose the optimizer (its `optimizer` section)"


def arm(trainer: Any, seam: Seam) -> None:
    # create_optimizer stays hooked with the path off too: the status settles at the optimizer's first step
    override(trainer, "create_optimizer", _create_optimizer)
    # a bad optim_args fails here, not after set-up at train(); so does a step_in_backward this run refuses
    wanted = seam.paths.optimizer and _optim_name(trainer.args) in ADAMW_OPTIMS
    if wanted and _options(trainer, seam).get("step_in_backward"):
        in_backward.arm(trainer, seam)
    if seam.deepspeed is not None and "optimizer" in seam.deepspeed:
        if seam.paths.optimizer:
            seam.off("optimizer", DEEPSPEED_OPTIMIZER, fallback=False)
        override(trainer, "training_step", _find_deepspeed_optimizer)


def _optim_name(args: Any) -> str:
    return str(getattr(args.optim, "value", args.optim))


def _options(trainer: Any, seam: Seam) -> dict[str, Any]:
    options = fused_adamw_options(trainer.args)
    if seam.deepspeed is not None and options.get("bf16_stochastic_rounding"):
        raise ValueError(
            "optim_args: bf16_stochastic_rounding=true has no effect under DeepSpeed ZeRO: FusedAdamW steps "
            "DeepSpeed's fp32 master partitions and DeepSpeed rounds them to bf16 itself; drop the option"
        )
    return options


def _create_optimizer(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    seam = seam_of(trainer)
    model = (args[0] if args else kwargs.get("model")) or trainer.model
    fused_kwargs = fused_adamw_kwargs(trainer, seam, model) if trainer.optimizer is None else None
    if fused_kwargs is None:
        optimizer = original(*args, **kwargs)
    else:
        from ..optim import FusedAdamW

        trainer.optimizer_cls_and_kwargs = (FusedAdamW, fused_kwargs)
        try:
            optimizer = original(*args, **kwargs)
        finally:
            trainer.optimizer_cls_and_kwargs = None
    # not Accelerate's DummyOptim (a DeepSpeed `optimizer` section): training_step finds DeepSpeed's optimizer
    if isinstance(optimizer, torch.optim.Optimizer) and not seam.logged:
        settle.after_first_step(seam, optimizer)
    in_backward.register(trainer, seam, optimizer)  # when optim_args asks for it
    return optimizer


def fused_adamw_kwargs(trainer: Any, seam: Seam, model: Any) -> dict[str, Any] | None:
    """FusedAdamW's kwargs for the AdamW the Trainer would build now, or None (the reason in the status)."""
    if not seam.paths.optimizer:
        return None
    args = trainer.args
    optim = _optim_name(args)
    reason, fallback = None, True
    if trainer.optimizer_cls_and_kwargs is not None:
        reason, fallback = "the Trainer was given optimizer_cls_and_kwargs", False
    elif optim not in ADAMW_OPTIMS:
        reason, fallback = f"optim={optim} is not an AdamW fasttrain replaces", False
    elif seam.deepspeed is not None and "optimizer" in seam.deepspeed:
        reason, fallback = DEEPSPEED_OPTIMIZER, False
    else:
        cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)
        if cls is not torch.optim.AdamW:
            reason = f"optim={optim} resolved to {cls.__module__}.{cls.__qualname__}"
    if reason is not None:
        seam.off("optimizer", reason, fallback)
        return None
    # lr, betas and eps as transformers derives them; weight decay comes with the Trainer's parameter groups
    kwargs = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach")}
    options = {k: v for k, v in _options(trainer, seam).items() if k not in TRAINER_OPTIONS}
    return {**kwargs, **options}


def _find_deepspeed_optimizer(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    seam = seam_of(trainer)
    if not seam.logged and seam.settle_hooked is None:
        optimizer = trainer.optimizer
        while getattr(optimizer, "optimizer", None) is not None:  # Accelerate's, DeepSpeed's, ZeRO's wrappers
            optimizer = optimizer.optimizer
        if isinstance(optimizer, torch.optim.Optimizer):
            settle.after_first_step(seam, optimizer)
    return original(*args, **kwargs)


def verdict(seam: Seam, trainer: Any, optimizer: Any) -> None:
    from ..optim import FusedAdamW

    if seam.status["optimizer"] != NOT_RUN:
        return
    if isinstance(optimizer, FusedAdamW):
        seam.status["optimizer"] = in_backward.optimizer_status(seam)
    else:
        seam.off(
            "optimizer", f"the Trainer's optimizer is {type(optimizer).__qualname__}, given or built by it"
        )
