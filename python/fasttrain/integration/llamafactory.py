"""LLaMA-Factory's preference trainers on fasttrain's token log-prob head.

LLaMA-Factory's DPO and KTO trainers (``CustomDPOTrainer``, ``CustomKTOTrainer``, subclasses of TRL's) build their
log-probs themselves: ``concatenated_forward`` (DPO) and ``forward`` (KTO) call the model for its full logits, cast
them to fp32 and take ``get_batch_logps`` of them; the logits' mean (DPO) or sum (KTO) is logged as a metric. These
two methods are served here from ``model(..., fasttrain_token_stats=labels)`` (``loss.model_token_stats``): the same
log-probs, valid lengths and metrics without the ``[tokens, vocab]`` logits, whatever TRL LLaMA-Factory runs on.
The returned ``chosen_logits`` / ``rejected_logits`` are what LLaMA-Factory reads of them: per-position means over
the vocabulary for DPO (whose ``.mean()`` is the logits' mean), per-position sums for KTO (whose ``.nansum()`` is
the logits' sum), not ``[.., vocab]`` tensors. SFT's loss needs nothing of this module: ``CustomSeq2SeqTrainer``'s
``compute_loss`` ends in the Trainer's, which the fused loss serves. The three trainers' collators get their padding
in Rust (``native_collator``).

Served only for the LLaMA-Factory releases these methods were read against (``TESTED``) and only where the trainer
runs LLaMA-Factory's own method (a subclass that overrides it keeps its own), text-only (a batch with image or
audio inputs goes to LLaMA-Factory's method), and where the model carries fasttrain's forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._classes import mro_owner
from .trainer_api import override

# LLaMA-Factory versions (major.minor) whose concatenated_forward / forward / get_batch_logps this module follows
TESTED = ("0.9",)
# the methods served, per LLaMA-Factory trainer class
_SERVED = {"CustomDPOTrainer": "concatenated_forward", "CustomKTOTrainer": "forward"}
_TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# the model inputs a text-only batch holds (anything else -- pixel_values, image_grid_thw, ... -- is media)
_MODEL_TEXT_INPUTS = {"input_ids", "attention_mask", "token_type_ids", "position_ids"}
_KTO_MEDIA = ("pixel_values", "image_sizes", "image_grid_thw", "aspect_ratio_ids", "aspect_ratio_mask")


def _version() -> str | None:
    try:
        from importlib.metadata import version

        return version("llamafactory")
    except Exception:  # not installed (a class named like LLaMA-Factory's elsewhere)
        return None


def served_method(trainer: Any) -> str | None:
    """The LLaMA-Factory method fasttrain serves on this trainer, or None."""
    for cls in type(trainer).__mro__:
        method = _SERVED.get(cls.__name__)
        if method is not None and cls.__module__.startswith("llamafactory."):
            owner = mro_owner(type(trainer), method)
            return method if owner is cls else None
    return None


def problem(trainer: Any) -> str | None:
    """Why this LLaMA-Factory trainer's log-probs keep LLaMA-Factory's path (None: fasttrain serves them)."""
    method = served_method(trainer)
    if method is None:
        return None
    version = _version()
    if version is None or ".".join(version.split(".")[:2]) not in TESTED:
        return (
            f"LLaMA-Factory {version}: its {method} is served for LLaMA-Factory {', '.join(TESTED)} only "
            "(the versions it was checked against)"
        )
    return None


def native_collator(collator: Any) -> Any | None:
    """LLaMA-Factory's SFT, pairwise or KTO collator with its padding in Rust (``data.llamafactory_collators``), for
    the tested LLaMA-Factory releases; None for any other collator, or when the agreement probe refuses the padding
    (a transformers whose DataCollatorForSeq2Seq makes other batches: logged once)."""
    from ..data import collator_probe
    from ..data.llamafactory_collators import twin_of

    version = _version()
    if version is None or ".".join(version.split(".")[:2]) not in TESTED:
        return None
    twin = twin_of(collator)
    if twin is None or collator_probe.refusal(twin) is not None:
        return None
    return twin


def arm(trainer: Any) -> None:
    method = served_method(trainer)
    if method == "concatenated_forward":
        override(trainer, method, _dpo_concatenated_forward, replaces=True)
    elif method == "forward":
        override(trainer, method, _kto_forward, replaces=True)


def reference_model(trainer: Any) -> Any:
    """The separate reference model whose forward fasttrain serves too (None with PEFT: the policy without its
    adapter is the reference)."""
    ref = getattr(trainer, "ref_model", None)
    return ref if isinstance(ref, torch.nn.Module) else None


def _served(model: Any, batch: dict[str, Any], model_keys: set[str]) -> bool:
    """fasttrain's forward is on the model and the model's inputs are text only (``model_keys``: the batch's keys
    LLaMA-Factory hands to the model)."""
    from ..loss.model_patch import fused_loss_enabled

    return fused_loss_enabled(model) and model_keys <= _MODEL_TEXT_INPUTS


def _kto_model_keys(batch: dict[str, Any], prefix: str) -> set[str]:
    """What LLaMA-Factory's KTO ``forward`` passes to the model: the prefixed text inputs, and any media."""
    keys = {name for name in _TEXT_INPUTS if f"{prefix}{name}" in batch}
    keys |= {name for name in _KTO_MEDIA if name in batch}
    return keys | ({"cross_attention_mask"} if f"{prefix}cross_attention_mask" in batch else set())


def _logps(model: Any, inputs: dict[str, Any], labels: torch.Tensor) -> Any:
    from ..loss.model_token_stats import TOKEN_STATS_KWARG

    return model(**inputs, return_dict=True, use_cache=False, **{TOKEN_STATS_KWARG: labels})


def _sequence_logps(stats: Any, ld_alpha: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of each sequence's label log-probs, its number of labels), as ``get_batch_logps`` computes them; with
    ``ld_alpha`` (LD-DPO) the log-probs past the shorter answer of each pair are weighted by it."""
    log_probs, mask = (
        stats.log_probs[:, :-1],
        stats.label_mask[:, :-1],
    )  # the positions get_batch_logps scores
    valid_length = mask.sum(-1)
    if ld_alpha is None:
        return (log_probs * mask).sum(-1), valid_length
    half = mask.shape[0] // 2
    shared = torch.minimum(valid_length[:half], valid_length[half:])
    first = torch.argmax(mask.int(), dim=1)  # where each sequence's labels start
    public = first + torch.cat([shared, shared], dim=0)
    positions = torch.arange(mask.shape[-1], device=log_probs.device).expand_as(log_probs)
    front = positions < public.unsqueeze(1)
    front_logps = (log_probs * (front * mask).float()).sum(-1)
    rear_logps = (log_probs * (~front * mask).float()).sum(-1)
    return front_logps + ld_alpha * rear_logps, valid_length


def _dpo_concatenated_forward(
    trainer: Any, original: Callable[..., Any], model: Any, batch: dict[str, Any], is_ref_model: bool = False
) -> dict[str, torch.Tensor]:
    if not _served(model, batch, set(batch) - {"labels"}):
        return original(model, batch, is_ref_model)
    if trainer.finetuning_args.use_ref_model:
        batch = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in batch.items()}
    labels = batch.pop("labels")  # popped from the caller's batch unless copied, as LLaMA-Factory does
    stats = _logps(model, batch, labels)
    all_logps, valid_length = _sequence_logps(stats, None if is_ref_model else trainer.ld_alpha)
    if trainer.loss_type in ("ipo", "orpo", "simpo"):
        all_logps = all_logps / valid_length
    half = batch["input_ids"].size(0) // 2
    chosen_logps, rejected_logps = all_logps.split(half, dim=0)
    chosen_logits, rejected_logits = stats.mean_logits.split(half, dim=0)
    chosen_length, _ = valid_length.split(half, dim=0)
    chosen_avg = (
        chosen_logps if trainer.loss_type in ("ipo", "orpo", "simpo") else chosen_logps / chosen_length
    )
    return {
        "chosen_logps": chosen_logps,
        "rejected_logps": rejected_logps,
        "chosen_logits": chosen_logits,
        "rejected_logits": rejected_logits,
        "chosen_logps_avg": chosen_avg,
    }


def _kto_forward(
    trainer: Any, original: Callable[..., Any], model: Any, batch: dict[str, Any], prefix: str = ""
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not _served(model, batch, _kto_model_keys(batch, prefix)):
        return original(model, batch, prefix)
    inputs = {name: batch[f"{prefix}{name}"] for name in _TEXT_INPUTS if f"{prefix}{name}" in batch}
    stats = _logps(model, inputs, batch[f"{prefix}labels"])
    logps, valid_length = _sequence_logps(stats, None)
    vocab = model_vocab(model)
    return stats.mean_logits * vocab, logps, logps / valid_length


def model_vocab(model: Any) -> int:
    from ..loss.model_patch import find_causal_lm

    head = find_causal_lm(model).get_output_embeddings()
    return int(getattr(head.weight, "ds_shape", head.weight.shape)[0])
