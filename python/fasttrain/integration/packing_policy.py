"""When a padded training batch may become one padding-free row, and when it is worth it.

Packing is exact only where the collator's batch can be the start of a packed row (``collator_problem``), the model
keeps packed examples apart (``model_problem``: a family verified by its test in ``families.py``, an attention that
builds the block-diagonal mask from ``position_ids``), and nothing in the trainer reads the padded shape
(``trainer_problem``). The packer then still checks every batch (``data.packing``). ``PackingCost`` decides per batch
whether the packed row costs no more than the padded batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import transformers
from transformers.data import data_collator as hf

from ..data.packing import collator_kind
from ..families import packing_model_types
from .trainer_api import is_trl_trainer, overriding_class

FLASH_ATTENTION = frozenset({"flash_attention_2", "flash_attention_3"})
# the attention implementations tests have run on packed rows (tests/test_packing_models.py, test_packing_flex.py);
# flash attention takes the same row with cu_seq_lens (the kwargs are built and tested against transformers'
# DataCollatorWithFlattening), but no GPU has run a packed forward through it yet, so it stays padded
EXACT_ATTENTION = frozenset({"sdpa", "eager", "flex_attention"})
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def collator_problem(collator: object) -> str | None:
    """Why the Trainer's collator cannot be the start of a packed batch (None: it can)."""
    kind = collator_kind(collator)
    named = (
        collator if callable(collator) and hasattr(collator, "__qualname__") else type(collator)
    )  # a function
    name = f"{named.__module__}.{named.__qualname__}"
    if isinstance(collator, hf.DataCollatorWithFlattening):
        return f"{name} already makes padding-free batches"
    framework = _llamafactory_class(collator)
    if framework is not None:  # LLaMA-Factory's own, or fasttrain's twin of it (data.llamafactory_collators)
        twin = " (padded in Rust by fasttrain)" if type(collator) is not framework else ""
        return (
            f"LLaMA-Factory's {framework.__qualname__}{twin} finishes its batches itself after the padding "
            "(they are kept as they are)"
        )
    if kind is None:
        return f"the collator {name} is not a padding collator fasttrain knows (its batches are kept as they are)"
    if kind == "lm" and collator.mlm:
        return f"{name} with mlm=True (masked LM)"
    if kind != "trl" and getattr(collator, "return_tensors", "pt") != "pt":
        return f"{name} with return_tensors={collator.return_tensors!r}"
    if kind == "trl" and not collator.padding_free and collator.pad_to_multiple_of is not None:
        # TRL's padding-free row is padded to the multiple, and TRL counts those pads in its num_tokens metric
        return (
            f"{name} with pad_to_multiple_of={collator.pad_to_multiple_of} (TRL would log other num_tokens)"
        )
    return None


def _llamafactory_class(collator: object) -> type | None:
    """The LLaMA-Factory class ``collator`` is or is the fasttrain twin of: its code adds 4D masks, rope position ids
    or paired rows after the padding, which a packed row would not carry."""
    return next((c for c in type(collator).__mro__ if c.__module__.startswith("llamafactory.")), None)


def _rope_types(config: Any) -> set[str]:
    found = set()
    for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        stack = [params]
        while stack:
            p = stack.pop()
            if isinstance(p, dict):
                kind = p.get("rope_type", p.get("type"))
                if isinstance(kind, str):
                    found.add(kind)
                stack.extend(v for v in p.values() if isinstance(v, dict))
    return found


def model_problem(model: Any) -> str | None:
    """Why a packed row would not be exact for ``model`` (None: it is, by the tests of its family)."""
    if model is None:
        return "the Trainer has no model yet"
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # PEFT
    config = getattr(base, "config", None)
    name = type(base).__name__
    model_type = getattr(config, "model_type", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return f"{name} is not a decoder-only causal LM"
    if model_type not in packing_model_types() or not name.endswith("ForCausalLM"):
        return f"{name} (model_type={model_type!r}) is not a model family verified exact on packed rows"
    attention = getattr(config, "_attn_implementation", None)
    if attention in FLASH_ATTENTION:
        return f"attn_implementation={attention!r}: packed rows are not yet verified on a GPU"
    if attention not in EXACT_ATTENTION:
        return f"attn_implementation={attention!r} is not one that keeps packed examples apart"
    length_dependent = _rope_types(config) & _LENGTH_DEPENDENT_ROPE
    if length_dependent:
        return f"rope_type {sorted(length_dependent)[0]!r} depends on the padded length"
    return None


def trainer_problem(trainer: Any) -> str | None:
    """Why this trainer's training batches must stay padded (None: they may pack, batch by batch)."""
    args = trainer.args
    trl = is_trl_trainer(trainer)
    for name in ("compute_loss", "training_step"):
        owner = overriding_class(trainer, name, trl_allowed=trl)
        if owner is not None:
            return f"{owner.__name__}.{name} is overridden and may read the padded batch"
    shifts = getattr(trainer, "_loss_shifts_labels", None)
    if shifts is None:
        # transformers 4.x counts num_items_in_batch over every label, each example's first one included: a packed
        # row ignores those, so the loss would be divided by another count than the padded batch's
        return (
            f"transformers {transformers.__version__} counts num_items_in_batch over unshifted labels "
            "(a packed row would change the loss's denominator)"
        )
    if shifts is False:
        return "the Trainer does not treat the loss as a causal LM's (it counts unshifted labels)"
    if trainer.compute_loss_func is not None:
        return "compute_loss_func is set (a loss of the user's own may read the padded shape)"
    if getattr(trainer, "label_smoother", None) is not None:
        return f"label_smoothing_factor={args.label_smoothing_factor} is not verified on packed rows"
    if getattr(args, "neftune_noise_alpha", None) is not None:
        return "neftune_noise_alpha scales its noise by the padded length"
    seen = getattr(args, "include_num_input_tokens_seen", "no")
    if seen not in ("no", False, None):
        return f"include_num_input_tokens_seen={seen!r} counts the padded batch's tokens"
    if args.n_gpu > 1:
        return f"DataParallel over {args.n_gpu} GPUs splits the batch's rows"
    for parallel in ("get_cp_size", "get_sp_size"):
        size = getattr(trainer, parallel, lambda: 1)()
        if size > 1:
            return f"{parallel[4:6]} parallelism of size {size} splits the sequence"
    return None


def problem(trainer: Any) -> str | None:
    """Why the training batches stay padded (None: they pack, each batch checked again by the packer)."""
    return collator_problem(trainer.data_collator) or model_problem(trainer.model) or trainer_problem(trainer)


class PackingCost:
    """What a token and an attention pair cost in a model's forward, in matmul flops: per token the projections,
    the MLP and the LM head; per attention pair QK^T and PV over every head and layer. Only compared with
    itself: a packed row must not cost more than the padded batch it replaces. (Memory follows the same terms;
    the bytes an attention pair keeps depend on the kernel: none per head in flash and memory-efficient sdpa.)

    sdpa and eager attend over a dense ``[T, T]`` mask, so a packed row of ``T`` tokens costs ``T**2`` pairs where
    the padded batch costs ``rows * width**2``; flash attention and flex skip the pairs between examples."""

    def __init__(self, config: Any, attention: str | None) -> None:
        text = getattr(config, "get_text_config", lambda: config)()
        hidden = int(text.hidden_size)
        layers = int(text.num_hidden_layers)
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        inner = int(getattr(text, "intermediate_size", None) or 4 * hidden)
        layer_params = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inner
        self.token_flops = 2 * (layers * layer_params + hidden * int(text.vocab_size))
        self.pair_flops = 4 * heads * head_dim * layers
        self.dense = attention not in FLASH_ATTENTION and attention != "flex_attention"

    def worth_it(self, rows: int, width: int, lengths: np.ndarray) -> bool:
        tokens = int(lengths.sum())
        pairs = tokens * tokens if self.dense else int((lengths * lengths).sum())
        padded_pairs = rows * width * width
        packed = tokens * self.token_flops + pairs * self.pair_flops
        return packed <= rows * width * self.token_flops + padded_pairs * self.pair_flops
