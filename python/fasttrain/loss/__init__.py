"""Chunked fused-linear cross-entropy (``fused_linear_cross_entropy``) and its causal-LM integration
(``fasttrain.loss.model_patch``)."""

from .function import default_chunk_rows, fused_linear_cross_entropy

__all__ = ["default_chunk_rows", "fused_linear_cross_entropy"]
