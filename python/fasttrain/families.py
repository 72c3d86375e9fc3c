"""The model families fasttrain knows: one row per family, saying which hot path is verified for it and by which
test. The fused loss reads :func:`fused_loss_classes`, packing reads :func:`packing_model_types`; the tests named
here check that what they cover is exactly this table."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str  # config.model_type
    causal_lm: (
        str  # the transformers class (transformers.models.*) whose forward is backbone -> lm_head -> loss
    )
    fused_loss: str | None  # the test that compares the fused loss and its gradients with the unpatched model
    packing: str | None  # the test that compares packed rows with padded ones (leaks and Trainer steps)


_LOSS_TEST = "tests/test_model_patch.py"
_PACKING_TEST = "tests/test_packing_models.py"

FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM", _LOSS_TEST, _PACKING_TEST),
    Family("mistral", "MistralForCausalLM", _LOSS_TEST, _PACKING_TEST),
    Family("qwen2", "Qwen2ForCausalLM", _LOSS_TEST, _PACKING_TEST),
    Family("qwen3", "Qwen3ForCausalLM", _LOSS_TEST, _PACKING_TEST),
    Family("gemma", "GemmaForCausalLM", _LOSS_TEST, None),
    Family("gemma2", "Gemma2ForCausalLM", _LOSS_TEST, _PACKING_TEST),
    Family("gemma3_text", "Gemma3ForCausalLM", _LOSS_TEST, _PACKING_TEST),
    Family("phi3", "Phi3ForCausalLM", _LOSS_TEST, _PACKING_TEST),
    Family("olmo2", "Olmo2ForCausalLM", _LOSS_TEST, _PACKING_TEST),
)


def fused_loss_classes() -> frozenset[str]:
    """Class names of the causal LMs whose loss fasttrain fuses."""
    return frozenset(f.causal_lm for f in FAMILIES if f.fused_loss)


def packing_model_types() -> frozenset[str]:
    """``model_type`` of the families whose packed rows are verified exact."""
    return frozenset(f.model_type for f in FAMILIES if f.packing)
