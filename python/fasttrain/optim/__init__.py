"""fasttrain's optimizer: ``FusedAdamW`` (fused AdamW with fused gradient clipping; moments in the parameter's
dtype, fp32 or blockwise 8-bit; optional stochastic rounding of bf16 parameters), and ``step_in_backward`` (its
update run inside ``backward()``, each gradient freed as soon as it is used)."""

from .adamw import FusedAdamW
from .in_backward import StepInBackward, step_in_backward

__all__ = ["FusedAdamW", "StepInBackward", "step_in_backward"]
