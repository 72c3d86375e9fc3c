"""Activation memory at long context, one chunk of tokens at a time: the decoder MLP (``fasttrain.tiling.mlp``)."""

from .mlp import (
    DEFAULT_CHUNK_TOKENS,
    TiledMLP,
    disable_tiled_mlp,
    enable_tiled_mlp,
    tiled_mlp,
    tiled_mlp_calls,
)

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "TiledMLP",
    "disable_tiled_mlp",
    "enable_tiled_mlp",
    "tiled_mlp",
    "tiled_mlp_calls",
]
