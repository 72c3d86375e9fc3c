"""fasttrain's optimizer: ``FusedAdamW`` (fused AdamW with fused gradient clipping; moments in the parameter's
dtype, fp32 or blockwise 8-bit; optional stochastic rounding of bf16 parameters)."""

from .adamw import FusedAdamW

__all__ = ["FusedAdamW"]
