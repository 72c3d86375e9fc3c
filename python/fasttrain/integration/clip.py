"""The clip path: the gradient norm in one pass, the clip applied inside the next FusedAdamW step.

The Trainer calls ``_clip_grad_norm`` (a norm pass, then a pass rescaling every gradient) and then the optimizer.
Here ``_clip_grad_norm`` computes the norm in one pass and hands the clip coefficient to the next step as a device
scalar (no host sync, no pass over the gradients); the norm the Trainer logs is the same. Without clipping
(``max_grad_norm`` 0 or None) the Trainer still logs the norm through ``_get_grad_norm``: that pass is the one-pass
kernel too. Both are private Trainer methods, hooked only after a signature check. Whether the clip can be ours is
decided here once at construction (the optimizer path, DeepSpeed, the hooks) and, for what can change between
steps (the optimizer, callbacks, the accelerator's state), at each call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import transformers

from .ledger import NOT_RUN, Seam, seam_of
from .trainer_api import override, private_hook_problem

DEEPSPEED_CLIPS = "DeepSpeed clips inside its engine"  # its gradient_clipping setting


def clipping_asked(args: Any) -> bool:
    return bool(args.max_grad_norm and args.max_grad_norm > 0)


def arm(trainer: Any, seam: Seam) -> None:
    clipping = clipping_asked(trainer.args)
    if not seam.paths.optimizer:
        seam.off("clip", "the optimizer hot path is switched off", fallback=False)
        return
    if seam.deepspeed is not None:
        # the engine clips the partitions before its optimizer steps: a fused clip would clip twice
        seam.off("clip", DEEPSPEED_CLIPS, fallback=False)
        return
    if clipping:
        problem = private_hook_problem(trainer, "_clip_grad_norm", ("model",))
        if problem is not None:
            seam.off("clip", problem)
            return
        override(trainer, "_clip_grad_norm", _clip_grad_norm, replaces=True)
        return
    seam.off("clip", f"max_grad_norm={trainer.args.max_grad_norm}: no clipping", fallback=False)
    if private_hook_problem(trainer, "_get_grad_norm", ("model", "grad_norm")) is None:
        override(trainer, "_get_grad_norm", _get_grad_norm, replaces=True)


def _clip_grad_norm(trainer: Any, original: Callable[..., Any], model: Any) -> Any:
    fused = _fused_clip_target(trainer, model, clipping=True)
    if fused is None:
        return original(model)
    return fused.defer_clip_grad_norm_(trainer.args.max_grad_norm)


def _get_grad_norm(trainer: Any, original: Callable[..., Any], model: Any, grad_norm: Any = None) -> Any:
    if grad_norm is None:
        fused = _fused_clip_target(trainer, model, clipping=False)
        if fused is not None:
            grad_norm = fused.defer_clip_grad_norm_(float("inf"))
    return original(model, grad_norm=grad_norm)


def _fused_clip_target(trainer: Any, model: Any, clipping: bool) -> Any:
    """The FusedAdamW whose next step can apply the clip, or None (when clipping, the reason goes to the status)."""
    from accelerate.utils import DistributedType

    from ..optim import FusedAdamW

    seam = seam_of(trainer)
    optimizer = trainer.optimizer
    while optimizer is not None and not isinstance(optimizer, FusedAdamW):
        optimizer = getattr(optimizer, "optimizer", None)  # Accelerate's (and others') wrappers
    accelerator = trainer.accelerator
    kind = accelerator.distributed_type
    reader = _gradient_reading_callback(trainer)
    reason, fallback = None, True
    if optimizer is None:
        reason, fallback = "the optimizer is not fasttrain's FusedAdamW", seam.paths.optimizer
    elif reader is not None:
        reason = f"callback {reader} reads gradients between the clip and the step"
    elif kind == DistributedType.FSDP and not getattr(accelerator, "is_fsdp2", False):
        reason = "FSDP1 clips through its own wrapper"
    elif kind not in (
        DistributedType.NO,
        DistributedType.MULTI_CPU,
        DistributedType.MULTI_GPU,
        DistributedType.FSDP,
    ):
        reason = f"distributed type {getattr(kind, 'value', kind)} is not supported by the fused clip"
    elif getattr(accelerator, "scaler", None) is not None:
        reason = "fp16 GradScaler: Accelerate unscales the gradients before clipping"
    elif callable(getattr(trainer, "_has_mixed_mesh_grads", None)) and trainer._has_mixed_mesh_grads(model):
        reason = "gradients on several device meshes"
    elif not _optimizer_covers_all_grads(optimizer, model):
        reason = "the model has gradients the optimizer does not update"
    if reason is not None:
        if clipping:
            seam.off("clip", reason, fallback)
        return None
    return optimizer


def _gradient_reading_callback(trainer: Any) -> str | None:
    """A callback that may look at the gradients after the clip (they stay unclipped until the step)."""
    base = transformers.TrainerCallback
    for callback in trainer.callback_handler.callbacks:
        cls = type(callback)
        for event in ("on_pre_optimizer_step", "on_optimizer_step"):
            if getattr(cls, event, None) is not getattr(base, event):
                return f"{cls.__name__}.{event}"
    return None


def _optimizer_covers_all_grads(optimizer: Any, model: Any) -> bool:
    # The Trainer clips model.parameters(); the fused norm runs over the optimizer's parameters. They agree
    # when every trainable parameter is one the optimizer updates (checked once: the sets are static).
    cached = optimizer.__dict__.get("_fasttrain_covers_model")
    if cached is None:
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        cached = all(id(p) in owned for p in model.parameters() if p.requires_grad)
        optimizer.__dict__["_fasttrain_covers_model"] = cached
    return cached


def verdict(seam: Seam, trainer: Any, optimizer: Any) -> None:
    from ..optim import FusedAdamW

    if seam.status["clip"] != NOT_RUN:
        return
    if isinstance(optimizer, FusedAdamW) and optimizer.deferred_clips_applied:
        seam.status["clip"] = "on"
    else:
        seam.off("clip", "the Trainer did not clip through _clip_grad_norm")
