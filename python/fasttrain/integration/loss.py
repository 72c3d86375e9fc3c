"""The loss path for transformers models: the fused-linear cross-entropy inside the model's forward.

The model's forward is wrapped per instance (``loss.model_patch``) only while the trainer trains: the wrapper goes on
when ``train()`` builds its training loader (``get_train_dataloader`` with ``is_in_train`` set, before Accelerate
prepares the model, so that its mixed-precision wrapper wraps ours) and comes off at ``on_train_end``; after
training the model's own forward answers every call, as without fasttrain (``model_init`` is wrapped so that a model
rebuilt by hyperparameter search gets it too). ``prediction_step`` lets a loss-only evaluation take the fused path
(putting the wrapper on for that call when the trainer is not training). ``LOSS_MAPPING`` is not touched: the Trainer
checks it by identity to count ``num_items_in_batch``. A trainer of TRL's gets its fused LM head served instead
(``loss_trl``), also only while it trains.

What runs decides, not which methods a subclass overrides: the fused forward returns logits on demand
(``loss.lazy_logits``), so a ``compute_loss`` of a subclass's own that reads them gets them exactly. If every fused
forward of the first ``DECIDING_STEPS`` training steps had its logits read (the loss needs them), or none had its
loss reach a backward (the loss is computed some other way), the fused path is switched off for this trainer:
paying for both would be slower than the reference (``_decide``). The status says ``on`` when fused forwards ran
during this trainer's training, whoever switched the fused loss on.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

from . import liger, llamafactory, loss_trl
from .ledger import NOT_RUN, Seam, seam_of
from .trainer_api import is_trl_trainer, on_train_end, override, overriding_class

# training steps with fused forwards watched before deciding whether the fused loss pays for this trainer
DECIDING_STEPS = 2


@dataclasses.dataclass
class _Watch:
    """The loss path's state on one trainer (kept on its seam)."""

    installed: list[Any] = dataclasses.field(default_factory=list)  # models this trainer put the forward on
    baseline: Any = None  # the model's fused-forward counters when this trainer started using it
    ran: Any = None  # the fused forwards of this trainer's earlier installs (FusedLossUsage)
    steps: list[Any] = dataclasses.field(default_factory=list)  # usage in each of the first deciding steps
    switched_off: str | None = None  # why the fused path stays off for the rest of this trainer's life


def watch_of(seam: Seam) -> _Watch:
    if seam.loss_watch is None:
        seam.loss_watch = _Watch()
    return seam.loss_watch


def arm(trainer: Any, seam: Seam) -> None:
    watch = watch_of(seam)
    if llamafactory.served_method(trainer) is not None:  # TRL trainers whose log-probs LLaMA-Factory computes
        reason = llamafactory.problem(trainer)
        if reason is not None:
            seam.off("loss", reason)
            return
        llamafactory.arm(trainer)
    elif is_trl_trainer(trainer):
        loss_trl.arm(trainer, seam)
        on_train_end(trainer, _trl_train_ended)
        return
    if trainer.model_init is not None:
        model_init, ref = trainer.model_init, weakref.ref(trainer)
        trainer.model_init = functools.wraps(model_init)(
            lambda *a: _on_new_model(ref(), model_init(*a))  # hyperparameter search rebuilds the model
        )
    if trainer.model is not None:
        reason = _support_problem(trainer.model)
        if reason is not None and trainer.model_init is None:
            seam.off("loss", reason)
            return
    watch.baseline = _usage(trainer.model)
    override(trainer, "get_train_dataloader", _train_starts)
    on_train_end(trainer, _train_ended)
    override(trainer, "prediction_step", _prediction_step)
    override(trainer, "training_step", _watch_step)
    liger.arm(trainer)


def _support_problem(model: Any) -> str | None:
    from ..loss.model_patch import fused_loss_problem

    return fused_loss_problem(model)


def _usage(model: Any) -> Any:
    from ..loss.model_patch import FusedLossUsage, fused_loss_usage

    return fused_loss_usage(model) if model is not None else FusedLossUsage()


def _on_new_model(trainer: Any, model: Any) -> Any:
    """A model built by ``model_init`` (inside ``train()``, before its training loader): counted from zero."""
    watch_of(seam_of(trainer)).baseline = _usage(model)
    return model


def _models(trainer: Any) -> list[Any]:
    """The models whose forward the fused loss (or token log-prob head) takes while this trainer trains."""
    models = [trainer.model] if trainer.model is not None else []
    ref = llamafactory.reference_model(trainer) if llamafactory.served_method(trainer) else None
    return models + ([ref] if ref is not None else [])


def _install(seam: Seam, trainer: Any) -> None:
    from ..loss.model_patch import enable_fused_loss, fused_loss_enabled

    watch = watch_of(seam)
    for model in _models(trainer):
        if fused_loss_enabled(model):
            continue  # on already (an outer call, or whoever enabled it keeps it)
        reason = enable_fused_loss(model)
        if reason is not None:
            seam.off("loss", reason)
            return
        watch.installed.append(model)
    watch.baseline = _usage(trainer.model)
    if seam.status["loss"] != "on":
        seam.not_run_yet("loss")


def _uninstall(seam: Seam, trainer: Any) -> None:
    from ..loss.model_patch import disable_fused_loss

    watch = watch_of(seam)
    if watch.installed:
        watch.ran = _ran(watch, trainer.model)
        watch.baseline = None
    for model in watch.installed:
        disable_fused_loss(model)
    watch.installed.clear()


def _ran(watch: _Watch, model: Any) -> Any:
    """The fused forwards this trainer's model ran in its training so far."""
    from ..loss.model_patch import FusedLossUsage

    usage = _usage(model)
    live = usage if watch.baseline is None else usage.since(watch.baseline)
    return live + (watch.ran or FusedLossUsage())


def fused_forwards(trainer: Any) -> int:
    """How many forwards of ``trainer``'s model took the fused loss or the token log-prob head while it trained
    (the evidence behind its status)."""
    from .ledger import find_seam

    seam = find_seam(trainer)
    if seam is None:
        return 0
    if is_trl_trainer(trainer) and llamafactory.served_method(trainer) is None:
        return loss_trl.fused_calls(trainer)
    ran = _ran(watch_of(seam), trainer.model)
    return ran.calls + ran.token_stats


def _train_starts(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``train()`` builds its training loader before Accelerate prepares the model: the fused forward goes on."""
    seam = seam_of(trainer)
    watch = watch_of(seam)
    if getattr(trainer, "is_in_train", False) and watch.switched_off is None and trainer.model is not None:
        _install(seam, trainer)
    return original(*args, **kwargs)


def _train_ended(trainer: Any) -> None:
    _uninstall(seam_of(trainer), trainer)


def _trl_train_ended(trainer: Any) -> None:
    """TRL's own heads back after training; the next ``train()`` looks for them again at its first step."""
    seam = seam_of(trainer)
    loss_trl.disable(trainer)
    seam.trl_decided = watch_of(seam).switched_off is not None


def detach(trainer: Any, seam: Seam, reason: str) -> None:
    """Take the fused forward off this trainer's model now and keep it off (``fasttrain.unpatch()``)."""
    watch = watch_of(seam)
    watch.switched_off = reason
    _uninstall(seam, trainer)
    if is_trl_trainer(trainer) and llamafactory.served_method(trainer) is None:
        loss_trl.disable(trainer)
        seam.trl_decided = True


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

    seam = seam_of(trainer)
    watch = watch_of(seam)
    if not prediction_loss_only or watch.switched_off is not None or trainer.model is None:
        return original(model, inputs, prediction_loss_only, *args, **kwargs)
    outside_training = not watch.installed
    if outside_training:  # evaluate() called on its own: the wrapper for this call only
        _install(seam, trainer)
    set_eval_fused(trainer.model, True)
    try:
        return original(model, inputs, prediction_loss_only, *args, **kwargs)
    finally:
        set_eval_fused(trainer.model, False)
        if outside_training:
            _uninstall(seam, trainer)


def _watch_step(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """One training step; over the first ``DECIDING_STEPS`` with fused forwards, whether the fused loss pays."""
    seam = seam_of(trainer)
    watch = watch_of(seam)
    if watch.switched_off is not None or len(watch.steps) >= DECIDING_STEPS:
        return original(*args, **kwargs)
    before = _usage(trainer.model)
    result = original(*args, **kwargs)
    step = _usage(trainer.model).since(before)
    if step.calls:
        watch.steps.append(step)
        if len(watch.steps) == DECIDING_STEPS:
            _decide(trainer, seam, watch)
    return result


def _decide(trainer: Any, seam: Seam, watch: _Watch) -> None:
    who = _who_computes_the_loss(trainer)
    if all(step.logits_reads >= step.calls for step in watch.steps):
        reason = (
            f"{who} read the logits of every fused forward in the first {DECIDING_STEPS} training steps: "
            "the model computes them in its own forward from now on"
        )
    elif all(step.loss_backwards == 0 and step.compiled == 0 for step in watch.steps):
        reason = (
            f"no backward went through the fused loss in the first {DECIDING_STEPS} training steps ({who} "
            "trains on another loss): the model's own forward runs from now on"
        )
    else:
        return
    watch.switched_off = reason
    _uninstall(seam, trainer)
    seam.off("loss", reason)  # said in the status line, or at once if that line was written already


def _who_computes_the_loss(trainer: Any) -> str:
    owner = overriding_class(trainer, "compute_loss")
    return f"{owner.__name__}.compute_loss" if owner is not None else "the training loop"


def verdict(seam: Seam, trainer: Any, optimizer: Any) -> None:
    _verdict(seam, trainer)
    if not is_trl_trainer(trainer):
        liger.say_who_serves_what(seam, trainer)


def _verdict(seam: Seam, trainer: Any) -> None:
    if watch_of(seam).switched_off is not None:
        return  # it ran, then stopped: the status keeps why
    if fused_forwards(trainer):
        seam.status["loss"] = "on"  # it ran, however it was switched on
        return
    if seam.status["loss"] != NOT_RUN:
        return
    if getattr(trainer, "label_smoother", None) is not None:
        # the Trainer takes the labels out of the inputs and smooths the loss from the logits itself
        smoothing = trainer.args.label_smoothing_factor
        seam.off(
            "loss",
            f"label_smoothing_factor={smoothing}: the Trainer computes the smoothed loss from the logits",
        )
    elif getattr(trainer, "compute_loss_func", None) is not None:
        # the Trainer takes the labels out of the inputs: the fused loss never runs, the user's function does
        seam.off(
            "loss",
            "the compute_loss_func given to the Trainer computes the loss from the logits, so the fused loss is off",
        )
    elif (owner := overriding_class(trainer, "compute_loss")) is not None:
        seam.off("loss", f"{owner.__name__}.compute_loss called the model without labels while training")
    else:
        seam.off("loss", "no training forward had labels")
