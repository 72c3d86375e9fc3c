"""The clip path: the gradient norm in one pass, the clip applied inside the next FusedAdamW step.

The Trainer's ``_clip_grad_norm`` calls ``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)`` (a norm
pass, then a pass rescaling every gradient) and then the optimizer steps. fasttrain hooks ``_clip_grad_norm`` on the
instance and calls whatever the trainer's class runs there -- the Trainer's own, or a subclass's override -- while
``accelerator.clip_grad_norm_`` is intercepted for the duration of that call only: a call for the Trainer's norm
(2-norm, ``max_grad_norm``, parameters the optimizer covers) computes the norm in one pass and hands the clip
coefficient to the next step as a device scalar (no host sync, no pass over the gradients); the norm the Trainer
logs is the same. So an override that ends in the Trainer's clip keeps the fused clip, and one that clips some other
way keeps its own (the status says so): what runs decides, not the method's name. Without clipping
(``max_grad_norm`` 0 or None) the Trainer still logs the norm through ``_get_grad_norm``: that pass is the one-pass
kernel too, the same way. Both are private Trainer methods, hooked only after a signature check. Whether the clip
can be ours is decided here once at construction (the optimizer path, DeepSpeed) and, for what can change between
steps (the optimizer, callbacks, the accelerator's state, the parameters), at each call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import transformers

from .._classes import mro_owner
from .ledger import NOT_RUN, Seam, seam_of
from .trainer_api import override, private_hook_missing

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
        problem = private_hook_missing("_clip_grad_norm", ("model",))
        if problem is not None:
            seam.off("clip", problem)
            return
        override(trainer, "_clip_grad_norm", _clip_grad_norm)
        return
    seam.off("clip", f"max_grad_norm={trainer.args.max_grad_norm}: no clipping", fallback=False)
    if private_hook_missing("_get_grad_norm", ("model", "grad_norm")) is None:
        override(trainer, "_get_grad_norm", _get_grad_norm)


def _clip_grad_norm(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with _fused_accelerator_clip(trainer, trainer.args.max_grad_norm, clipping=True) as reached:
        norm = original(*args, **kwargs)
    if not reached:
        owner = mro_owner(type(trainer), "_clip_grad_norm")
        seam_of(trainer).clip_bypassed = (
            f"{getattr(owner, '__name__', '?')}._clip_grad_norm clipped without the Trainer's "
            "accelerator.clip_grad_norm_"
        )
    return norm


def _get_grad_norm(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with _fused_accelerator_clip(trainer, math.inf, clipping=False):
        return original(*args, **kwargs)


@contextmanager
def _fused_accelerator_clip(trainer: Any, max_norm: float, clipping: bool) -> Iterator[list[bool]]:
    """While the block runs, ``trainer.accelerator.clip_grad_norm_`` defers a clip of ``max_norm`` over the
    optimizer's parameters to FusedAdamW's next step; any other call goes to Accelerate. Yields a list that holds
    True once the block called it (whatever it then did)."""
    accelerator = trainer.accelerator
    reached: list[bool] = []
    accelerate_clip = accelerator.clip_grad_norm_
    own = accelerator.__dict__.get("clip_grad_norm_")

    def clip_grad_norm_(parameters: Any, max_norm_: float, norm_type: float = 2) -> Any:
        reached.append(True)
        parameters = list(parameters)
        if max_norm_ == max_norm and norm_type == 2:
            fused = _fused_clip_target(trainer, parameters, clipping)
            if fused is not None:
                return fused.defer_clip_grad_norm_(max_norm)
        return accelerate_clip(parameters, max_norm_, norm_type)

    accelerator.__dict__["clip_grad_norm_"] = clip_grad_norm_
    try:
        yield reached
    finally:
        if own is None:
            accelerator.__dict__.pop("clip_grad_norm_", None)
        else:
            accelerator.__dict__["clip_grad_norm_"] = own


def _fused_clip_target(trainer: Any, parameters: list[Any], clipping: bool) -> Any:
    """The FusedAdamW whose next step can apply the clip of ``parameters``' gradients, or None (when clipping, the
    reason goes to the status)."""
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
    elif not _optimizer_covers(optimizer, parameters):
        reason = "the clipped parameters are not the ones the optimizer updates"
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


def _optimizer_covers(optimizer: Any, parameters: list[Any]) -> bool:
    # The fused norm runs over the optimizer's parameters: they must be the trainable ones among those clipped.
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = {id(p) for p in parameters if p.requires_grad}
    return trainable == owned or (trainable <= owned and _untrained(optimizer, owned - trainable))


def _untrained(optimizer: Any, ids: set[int]) -> bool:
    """The optimizer's parameters outside the clipped list have no gradient (frozen since)."""
    return all(p.grad is None for group in optimizer.param_groups for p in group["params"] if id(p) in ids)


def verdict(seam: Seam, trainer: Any, optimizer: Any) -> None:
    from ..optim import FusedAdamW

    if seam.status["clip"] != NOT_RUN:
        return
    if isinstance(optimizer, FusedAdamW) and optimizer.deferred_clips_applied:
        seam.status["clip"] = "on"
    else:
        seam.off("clip", seam.clip_bypassed or "the Trainer did not clip through _clip_grad_norm")
