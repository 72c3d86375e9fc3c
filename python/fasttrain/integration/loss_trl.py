"""The loss path for TRL's trainers: their fused LM head served by fasttrain's kernel.

TRL (1.16) computes the losses and metrics of SFT, DPO, GRPO, RLOO and KTO through ``model(...,
fused_lm_head=True)``, a head it installs on the policy (and on the reference model) after ``Trainer.__init__``
returns. So the heads are looked for at the first ``training_step`` or ``compute_loss``, whichever comes first
(GRPO and RLOO score the old policy and the reference model inside ``training_step``, before their loss), and
served from then on (``loss.trl_support``). Reference log-probs that TRL precomputes in its constructor
(``precompute_ref_log_probs``) come before any of this and keep TRL's head. Each ``compute_loss`` hands SFT's nll
denominator (``num_items_in_batch``) to the heads, so that their forward can compute the gradients itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..loss import trl_support
from ..loss.model_patch import find_causal_lm
from .ledger import Seam, find_seam
from .trainer_api import is_trl_trainer, override

_MARK = "_fasttrain_trl_compute_loss"


def arm(trainer: Any, seam: Seam) -> None:
    # TRL installs its heads after Trainer.__init__ returns; GRPO and RLOO score completions (old policy, reference
    # model) in training_step before any compute_loss: the heads are looked for at whichever comes first
    override(trainer, "training_step", _decide_first)
    _hook_compute_loss(trainer)


def _decide(trainer: Any) -> None:
    seam = find_seam(trainer)
    if seam is not None and not seam.trl_decided:
        seam.trl_decided = True
        reason = enable(trainer)
        if reason is not None:
            seam.off("loss", reason)


def _decide_first(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    _decide(trainer)
    return original(*args, **kwargs)


def _hook_compute_loss(trainer: Any) -> None:
    if not getattr(trainer.__dict__.get("compute_loss"), _MARK, False):
        override(trainer, "compute_loss", _compute_loss)
        setattr(trainer.__dict__["compute_loss"], _MARK, True)


def _compute_loss(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    _decide(trainer)
    # compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None)
    num_items = kwargs.get("num_items_in_batch", args[3] if len(args) > 3 else None)
    with trl_support.upstream_count(_models(trainer), num_items):
        return original(*args, **kwargs)


def trainer_kind(trainer: Any) -> str | None:
    """Which of the TRL trainers fasttrain serves (``trl_support.TRAINERS``) ``trainer`` is or subclasses, by its
    kind ("sft", "dpo", ...); else None."""
    import trl

    for kind, entry in trl_support.TRAINERS.items():
        cls = getattr(trl, entry.class_name, None)
        if cls is not None and isinstance(trainer, cls):
            return kind
    return None


def _models(trainer: Any) -> list[Any]:
    # TRL adds its head to the PEFT base model (get_base_model) and to DPO's separate reference model
    models = [find_causal_lm(trainer.model)]
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        models.append(find_causal_lm(ref))
    return models


def enable(trainer: Any) -> str | None:
    """Serve this TRL trainer's fused LM heads from fasttrain's kernel; None when served, else why not. Also
    callable without the rest of fasttrain (it hooks ``compute_loss`` for the nll denominator). Idempotent."""
    problem = trl_support.trl_problem()
    if problem is not None:
        return problem
    kind = trainer_kind(trainer)
    if kind is None and not is_trl_trainer(trainer):
        return f"{type(trainer).__name__} is not a TRL trainer"
    if kind is None:
        return (
            f"{type(trainer).__name__} is a TRL trainer fasttrain has not been tested with (tested: "
            f"{', '.join(t.class_name for t in trl_support.TRAINERS.values())}): its loss keeps TRL's own path"
        )
    accelerator = trainer.accelerator

    def mixed_precision() -> Any:
        from accelerate.utils import get_mixed_precision_context_manager

        return get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)

    reason = trl_support.serve(
        _models(trainer),
        kind=kind,
        device_type=trainer.args.device.type,
        uniform_grad=kind == "sft" and getattr(trainer.args, "loss_type", "nll") in ("nll", "chunked_nll"),
        mixed_precision=mixed_precision,
    )
    if reason is None:
        _hook_compute_loss(trainer)
    return reason


def disable(trainer: Any) -> None:
    """TRL's own heads back on this trainer's models (the forwards served so far stay counted)."""
    served = trl_support.stop_serving(_models(trainer))
    seam = find_seam(trainer)
    if seam is not None:
        seam.trl_calls_done += served


def fused_calls(trainer: Any) -> int:
    """How many forwards of this trainer's models took fasttrain's kernel."""
    seam = find_seam(trainer)
    return trl_support.fused_calls(_models(trainer)) + (seam.trl_calls_done if seam is not None else 0)
