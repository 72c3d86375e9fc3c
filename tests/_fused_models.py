"""The fused loss's test models: every family and variant it claims (``CONFIGS``), each built from the tiny registry
(``_tiny.FAMILIES``), and the (reference, fused, float64 truth) models and batch the model-level tests compare."""

from __future__ import annotations

import copy

import torch
import transformers

import _tiny as tiny
import _truth
from fasttrain.loss.model_patch import enable_fused_loss, fused_loss_enabled

VOCAB = 211  # a prime: no tile size of the loss kernels divides it
# over tiny.SHAPE: wider heads than the tiny Trainer models, and a shorter context (the batches are 13 tokens)
SHAPE = dict(vocab_size=VOCAB, hidden_size=48, max_position_embeddings=64)


def _builder(family: str, **settings):
    return lambda: transformers.AutoModelForCausalLM.from_config(tiny.config(family, **SHAPE, **settings))


CONFIGS = {
    "llama": _builder("llama"),
    "qwen3": _builder("qwen3", head_dim=16),
    "qwen3_tied": _builder("qwen3", head_dim=16, tie_word_embeddings=True),
    "gemma2_softcap": _builder("gemma2", head_dim=16, final_logit_softcapping=2.0),
    "mistral": _builder("mistral"),
    "qwen2": _builder("qwen2"),
    "phi3": _builder("phi3"),
    "gemma": _builder("gemma", head_dim=16),
    "gemma3_softcap": _builder("gemma3_text", head_dim=16, final_logit_softcapping=3.0, sliding_window=8),
    "olmo2": _builder("olmo2"),
}


def pair(name, seed=0):
    torch.manual_seed(seed)
    ref = CONFIGS[name]().float().train()
    ours = copy.deepcopy(ref)
    assert enable_fused_loss(ours) is None
    assert fused_loss_enabled(ours)
    return ref, ours


def trio(name, seed=0):
    """(reference, ours, truth): the unpatched model, the fused one, and the unpatched one in float64."""
    ref, ours = pair(name, seed)
    return ref, ours, _truth.float64_twin(ref)


def batch(seed=0, b=3, t=13):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    mask = torch.ones_like(ids)
    mask[0, -4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, :5] = -100  # a masked prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
