"""fasttrain's optimizer: ``FusedAdamW`` (Triton multi-tensor AdamW with fused gradient clipping)."""

from .adamw import FusedAdamW

__all__ = ["FusedAdamW"]
