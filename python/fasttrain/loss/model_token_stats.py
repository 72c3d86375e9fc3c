"""Per-token log-probs of a causal LM's own labels, from the model's forward, without the logits.

Trainers that build their log-probs themselves from ``model(...).logits`` (LLaMA-Factory's DPO and KTO:
``get_batch_logps``) can ask the fused forward for them instead: ``model(**inputs, fasttrain_token_stats=labels)``.
The call goes through every wrapper of the model's forward as any other call does (DDP, Accelerate's autocast,
PEFT, FSDP2), and the forward fasttrain installed (``model_patch``) answers it: it runs the backbone and
``fused_token_log_probs`` on every position, with the labels shifted as ``get_batch_logps`` shifts them (position
``t`` scores label ``t + 1``). It returns a ``TokenStatsOutput``:

- ``log_probs`` ``[batch, seq]`` fp32, differentiable: the log-prob of the next label at each position, 0 where
  that label is ignored (-100) and at the last position;
- ``label_mask`` ``[batch, seq]`` bool: where ``log_probs`` scores a label;
- ``mean_logits`` ``[batch, seq]`` fp32, not differentiable: the mean of each position's logits over the
  vocabulary, at *every* position (the reference's logits metrics average all of them).

The head runs on every position (an ignored label is scored as token 0 and then masked), as the reference's
``log_softmax`` over the full logits does: that is what makes ``mean_logits`` complete.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from ..labels import IGNORE_INDEX, shift_labels
from .token_logprobs import fused_token_log_probs

__all__ = ["TOKEN_STATS_KWARG", "TokenStatsOutput", "token_stats"]

TOKEN_STATS_KWARG = "fasttrain_token_stats"


@dataclass
class TokenStatsOutput(ModelOutput):
    log_probs: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    softcap: float | None,
) -> TokenStatsOutput:
    """``hidden`` ``[batch, seq, H]`` from the backbone; ``labels`` ``[batch, seq]`` as the model takes them."""
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"fasttrain token stats: labels of shape {tuple(labels.shape)} do not match the input of shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    shifted = shift_labels(labels.to(hidden.device), IGNORE_INDEX)
    scored = shifted != IGNORE_INDEX
    stats = fused_token_log_probs(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        shifted.masked_fill(~scored, 0).reshape(-1),  # every position through the head, for mean_logits
        bias,
        softcap=softcap,
        outputs=("log_probs", "mean_logits"),
    )
    log_probs = stats.log_probs.view(scored.shape) * scored  # a zero upstream where nothing is scored
    return TokenStatsOutput(
        log_probs=log_probs, label_mask=scored, mean_logits=stats.mean_logits.view(scored.shape)
    )
