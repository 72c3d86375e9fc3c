"""fasttrain's optimizer: ``FusedAdamW`` (Triton multi-tensor AdamW with fused gradient clipping).

``fasttrain.optim.handler`` holds the Trainer hook (``install_optimizer_handlers`` / ``uninstall_...``);
it is not imported here so that ``import fasttrain.optim`` does not import transformers.
"""

from .adamw import FusedAdamW

__all__ = ["FusedAdamW"]
