"""``optim_args="step_in_backward=true"`` (or ``FASTTRAIN_OPTIM_ARGS``): the Trainer's FusedAdamW updates each
parameter inside backward (``fasttrain.optim.step_in_backward``), and its gradient is freed at once.

The Trainer's loop stays as it is. ``optimizer.step()`` and ``model.zero_grad()`` find no gradient left (no-ops for
the stepped parameters); ``lr_scheduler.step()`` sets ``group["lr"]``, which the hooks read during the next
optimizer step's backward: the hooks of step k run after the scheduler's first k-1 steps and before the Trainer's
``optimizer.step()`` of step k, so they use the lr that ``optimizer.step()`` would have used.

- Gradient accumulation: the hooks step only during a backward while Accelerate's ``sync_gradients`` is True (the
  Trainer sets it before each micro-batch's ``training_step``: True on the micro-batch after which it steps); on
  the other micro-batches the gradients accumulate as they do without hooks.
- The logged ``grad_norm``: the Trainer's ``_get_grad_norm`` would find no gradient left; it returns the norm the
  hooks summed over the gradients they stepped, which is reset after each optimizer step.
- Registered on the FusedAdamW that ``create_optimizer`` builds or was given (a checkpoint's state then loads into
  that same instance, as without hooks), removed at ``on_train_end``.
- DDP (``MULTI_CPU``/``MULTI_GPU``): the model is wrapped after ``create_optimizer``, so the step moves into a
  communication hook on the wrapped model (``fasttrain.optim.in_backward_ddp``) at ``on_train_begin``, after
  Accelerate's ``prepare``; each bucket is stepped on its averaged gradient. Accumulating micro-batches run under
  DDP's ``no_sync``, where no communication hook runs. A later ``train()`` on the same wrapped model re-arms it.
- Refused at construction, each with its reason: clipping (``max_grad_norm > 0``), distributed types other than
  DDP, FSDP, DeepSpeed, ``nn.DataParallel``, fp16 (a GradScaler).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from .clip import clipping_asked
from .ledger import Seam, seam_of
from .trainer_api import after_event, on_train_end, override, private_hook_missing, private_hook_problem

WHERE = "optim_args step_in_backward=true"


class _State:
    """What one trainer's switch holds: the handle of the hooks (kept after removal: its update count is the
    evidence) and the optimizer post-step hook that resets the handle's norm."""

    def __init__(self, ddp: bool) -> None:
        self.ddp = ddp  # the step goes into a communication hook on the wrapped model (on_train_begin)
        self.optimizer: Any = None  # under DDP: the FusedAdamW create_optimizer built, until on_train_begin
        self.handle: Any = None
        self.reset_hook: Any = None


def arm(trainer: Any, seam: Seam) -> None:
    problem = refusal(trainer, seam)
    if problem is not None:
        raise ValueError(f"{WHERE}: {problem}")
    seam.in_backward = _State(ddp=_is_ddp(trainer))
    # transformers < 5 has no _get_grad_norm and logs no norm without clipping: nothing to serve there
    if private_hook_missing("_get_grad_norm", ("model", "grad_norm")) is None:
        hook_problem = private_hook_problem(trainer, "_get_grad_norm", ("model", "grad_norm"))
        if hook_problem is None:
            override(trainer, "_get_grad_norm", _get_grad_norm)
        else:  # the class's own norm would find the gradients gone
            seam.notes.append(f"step_in_backward: the logged grad_norm is not the hooks' ({hook_problem})")
    if seam.in_backward.ddp:
        after_event(trainer, "on_train_begin", _register_ddp)
    on_train_end(trainer, _remove)


def _is_ddp(trainer: Any) -> bool:
    from accelerate.utils import DistributedType

    return trainer.accelerator.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def refusal(trainer: Any, seam: Seam) -> str | None:
    """Why the Trainer's optimizer cannot step inside backward in this run (None when it can)."""
    from accelerate.utils import DistributedType

    args = trainer.args
    accelerator = trainer.accelerator
    kind = accelerator.distributed_type
    if clipping_asked(args):
        return (
            f"max_grad_norm={args.max_grad_norm} clips by the norm of all gradients together, which needs every "
            "gradient before the first parameter is updated, while a step inside backward updates each parameter as "
            "soon as its own gradient is final; set max_grad_norm=0 to train without clipping (the Trainer's "
            "default is 1.0), or drop step_in_backward to keep the clip"
        )
    if seam.deepspeed is not None:
        return "DeepSpeed owns the optimizer step (its engine steps after reducing the gradients): drop step_in_backward"
    if getattr(trainer, "is_fsdp_enabled", False) or kind == DistributedType.FSDP:
        return (
            "under FSDP (1 or 2) a parameter's sharded gradient is set after FSDP's reduce-scatter, not by autograd's "
            "accumulation, where the hook fires: drop step_in_backward"
        )
    if kind != DistributedType.NO and not _is_ddp(trainer):
        return (
            f"distributed type {getattr(kind, 'value', kind)}: only DDP (MULTI_CPU, MULTI_GPU) steps in backward, "
            "through a communication hook; train with DDP or on one process, or drop step_in_backward"
        )
    if getattr(args, "n_gpu", 1) > 1:
        return (
            f"n_gpu={args.n_gpu} trains through nn.DataParallel, which step_in_backward is not tested with; "
            "train on one device (CUDA_VISIBLE_DEVICES) or drop step_in_backward"
        )
    if args.fp16 or getattr(accelerator, "scaler", None) is not None:
        return (
            "fp16 trains with a GradScaler, which unscales the gradients and skips steps on overflow after backward, "
            "when the hooks have already stepped; use bf16 (no scaler) instead"
        )
    return None


def register(trainer: Any, seam: Seam, optimizer: Any) -> None:
    """Step ``optimizer`` (the one ``create_optimizer`` returned) inside backward, when the switch is on."""
    state = seam.in_backward
    if state is None:
        return
    from ..optim import FusedAdamW, step_in_backward

    # a second train() gets the optimizer back as Accelerate wrapped it in the first
    while optimizer is not None and not isinstance(optimizer, FusedAdamW) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, FusedAdamW):
        raise ValueError(
            f"{WHERE} needs fasttrain's FusedAdamW, but the Trainer's optimizer is {type(optimizer).__qualname__} "
            f"(optimizer path: {seam.status['optimizer']}): drop step_in_backward or let fasttrain build the AdamW"
        )
    if state.ddp:  # the model is not wrapped yet: hooked at on_train_begin (_register_ddp)
        state.optimizer = optimizer
        return
    if state.handle is not None and not state.handle.removed:
        if state.handle.optimizer is optimizer:
            return  # hooked already (a train() that raised before on_train_end)
        _remove(trainer)
    ref = weakref.ref(trainer)
    _hooked(state, optimizer, step_in_backward(optimizer, armed=lambda: _syncing(ref)))


def _hooked(state: _State, optimizer: Any, handle: Any) -> None:
    state.handle = handle
    # once per optimizer step, after the Trainer read the norm (in _get_grad_norm, before optimizer.step())
    state.reset_hook = optimizer.register_step_post_hook(lambda *_: handle.reset_grad_norm())


def _register_ddp(trainer: Any) -> None:
    """At ``on_train_begin``: the optimizer's step into a communication hook on the DDP model Accelerate wrapped."""
    import torch

    from ..optim.in_backward_ddp import step_in_backward_ddp

    state = seam_of(trainer).in_backward
    optimizer, ddp = state.optimizer, trainer.model_wrapped
    if optimizer is None:
        return  # create_optimizer did not build a FusedAdamW: register() raised or the path is off
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"{WHERE}: under DDP the Trainer's wrapped model is {type(ddp).__qualname__}, not a "
            "DistributedDataParallel to hook; drop step_in_backward"
        )
    handle = state.handle
    if handle is not None and getattr(handle, "_ddp", None) is ddp and handle.optimizer is optimizer:
        if handle.removed:  # a later train(): the hook never left the wrapped model
            handle.rearm()
            _hooked(state, optimizer, handle)
        return
    _hooked(state, optimizer, step_in_backward_ddp(ddp, optimizer))


def _syncing(ref: Callable[[], Any]) -> bool:
    """Whether the backward now running ends the Trainer's gradient accumulation (its micro-batch syncs)."""
    trainer = ref()
    return trainer is not None and bool(trainer.accelerator.sync_gradients)


def _get_grad_norm(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    handle = seam_of(trainer).in_backward.handle
    grad_norm = kwargs.get("grad_norm", args[1] if len(args) > 1 else None)
    if handle is None or handle.removed or grad_norm is not None:
        return original(*args, **kwargs)
    return handle.grad_norm()  # the gradients are gone: the norm the hooks summed before freeing them


def _remove(trainer: Any) -> None:
    state = seam_of(trainer).in_backward
    if state.handle is not None:
        state.handle.remove()
    if state.reset_hook is not None:  # removed outside the optimizer's step, never while torch runs its hooks
        state.reset_hook.remove()
        state.reset_hook = None


def optimizer_status(seam: Seam) -> str:
    """The optimizer path's "on", saying so when it stepped in backward (evidence: the hooks' update count)."""
    state = seam.in_backward
    if state is None:
        return "on"
    if state.handle is not None and state.handle.updates > 0:
        return "on (stepping in backward)"
    seam.notes.append(
        "step_in_backward was asked but no parameter was stepped in backward before the first step"
    )
    return "on"
