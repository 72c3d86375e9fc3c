"""Chunked fused-linear cross-entropy (``fused_linear_cross_entropy``) and its causal-LM integration
(``fasttrain.loss.model_patch``); per-token log-probs for TRL's fused LM head (``fused_token_log_probs``) and its
TRL integration (``fasttrain.loss.trl_support``)."""

from .function import default_chunk_rows, fused_linear_cross_entropy
from .token_logprobs import fused_token_log_probs

__all__ = ["default_chunk_rows", "fused_linear_cross_entropy", "fused_token_log_probs"]
