"""FusedAdamW's per-parameter state: which layout a ``state_dtype`` gives a parameter, creating it, checking a loaded one.

Layouts (the value ``layout()`` returns):

- a torch dtype: ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) of the parameter's shape in that dtype:
  torch.optim.AdamW's layout; the dtype is the parameter's for ``state_dtype=None``, fp32 for ``"float32"``;
- ``"8bit"``: ``exp_avg_codes`` / ``exp_avg_absmax``, ``exp_avg_sq_codes`` / ``exp_avg_sq_absmax`` (and the
  ``max_exp_avg_sq_*`` pair), in ``fasttrain.optim.blockwise8``'s format. Different names from torch's on
  purpose: torch's AdamW given such a state fails loudly (a missing ``exp_avg``) instead of reading codes as
  moments. Parameters below ``min_8bit_size`` elements get the fp32 layout.

Plus ``step``: an fp32 scalar tensor on the parameter's device, as torch's fused AdamW keeps it.
"""

from __future__ import annotations

from typing import Any

import torch

from . import blockwise8
from ._tensors import is_dtensor, local

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}
STATE_DTYPES = (None, "float32", "8bit")
_LOW_PRECISION = (torch.bfloat16, torch.float16)

Layout = Any  # torch.dtype | "8bit"


def normalize_state_dtype(value: Any, where: str) -> str | None:
    """``None``, ``"float32"`` or ``"8bit"`` from what a user may write (``torch.float32``, ``"fp32"``...)."""
    if value is None or (isinstance(value, str) and value.lower() in ("none", "param")):
        return None
    if value is torch.float32 or (
        isinstance(value, str) and value.lower() in ("float32", "fp32", "torch.float32")
    ):
        return "float32"
    if isinstance(value, str) and value.lower() in ("8bit", "8-bit", "int8"):
        return "8bit"
    raise ValueError(
        f"{where}: unknown state_dtype {value!r}: use None (moments in the parameter's dtype, as torch.optim.AdamW), "
        "torch.float32 (fp32 moments) or '8bit' (blockwise-quantized moments)"
    )


def full_precision(param: torch.Tensor) -> torch.dtype:
    return torch.float32 if param.dtype in (torch.float32, *_LOW_PRECISION) else param.dtype


def layout(group: dict[str, Any], param: torch.Tensor) -> Layout:
    mode = group["state_dtype"]
    if mode is None:
        return param.dtype
    if mode == "8bit" and local(param).numel() >= group["min_8bit_size"]:
        return "8bit"
    return full_precision(param)


def step_tensor(param: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    # fp32 on the parameter's device, as torch's fused AdamW keeps it: the kernels read it
    return torch.tensor(value, dtype=torch.float32, device=local(param).device)


def _new_moment(state: dict[str, Any], name: str, param: torch.Tensor, lay: Layout) -> None:
    if lay == "8bit":
        state[f"{name}_codes"], state[f"{name}_absmax"] = blockwise8.empty_state(param, SIGNED[name])
    else:
        state[name] = torch.zeros_like(param, dtype=lay, memory_format=torch.preserve_format)


def has_moment(state: dict[str, Any], name: str) -> bool:
    return name in state or f"{name}_codes" in state


def init(state: dict[str, Any], group: dict[str, Any], param: torch.Tensor, where: str) -> Layout:
    """Create what ``state`` lacks for ``param`` (lazily, at its first step); returns its layout."""
    lay = layout(group, param)
    if lay == "8bit" and is_dtensor(param):
        raise ValueError(
            f"{where}: state_dtype='8bit' does not support DTensor (FSDP2) parameters (quantization blocks of "
            "a shard do not survive resharding): use state_dtype=None, the reference's memory"
        )
    if not has_moment(state, "exp_avg"):
        state["step"] = step_tensor(param)
        _new_moment(state, "exp_avg", param, lay)
        _new_moment(state, "exp_avg_sq", param, lay)
    if group["amsgrad"] and not has_moment(state, "max_exp_avg_sq"):
        _new_moment(state, "max_exp_avg_sq", param, lay)
    step = state.get("step", 0.0)
    if (
        not isinstance(step, torch.Tensor)
        or step.device != local(param).device
        or step.dtype != torch.float32
    ):
        state["step"] = step_tensor(param, float(step))  # a state set by hand or loaded without our loader
    return lay


def moments(state: dict[str, Any], lay: Layout, amsgrad: bool) -> list[str]:
    """The names of the tensors holding the moments of a state of this layout, in kernel order."""
    names = MOMENTS if amsgrad else MOMENTS[:2]
    if lay == "8bit":
        return [f"{n}_codes" for n in names] + [f"{n}_absmax" for n in names]
    return list(names)


def check_saved(saved: dict[str, Any], group: dict[str, Any], param: torch.Tensor, where: str) -> None:
    """A ValueError unless a saved per-parameter state has the layout this optimizer gives ``param``."""
    if not saved:
        return
    lay = layout(group, param)
    quantized = "exp_avg_codes" in saved
    if (lay == "8bit") == quantized:
        return
    mode = group["state_dtype"]
    if quantized:
        raise ValueError(
            f"{where}: the state dict holds 8-bit moments for a parameter of {local(param).numel()} elements, this "
            f"optimizer keeps them {'in full precision' if mode == '8bit' else f'with state_dtype={mode!r}'}: "
            "construct FusedAdamW with the state_dtype (and min_8bit_size) that saved it"
        )
    raise ValueError(
        f"{where}: the state dict holds full-precision moments for a parameter this optimizer keeps in 8 bits "
        f"(state_dtype='8bit', min_8bit_size={group['min_8bit_size']}): construct FusedAdamW with the "
        "state_dtype (and min_8bit_size) that saved it"
    )


def restore(state: dict[str, Any], saved: dict[str, Any], param: torch.Tensor, lay: Layout) -> None:
    """Put back what torch's loader cast to the parameter's dtype: each saved tensor in the dtype of its role."""
    device = local(param).device
    for key, value in saved.items():
        if key == "step":
            state["step"] = step_tensor(param, float(value))
        elif isinstance(value, torch.Tensor):
            if key.endswith("_codes"):
                dtype = torch.uint8
            elif key.endswith("_absmax"):
                dtype = torch.float32
            else:
                dtype = lay
            state[key] = value.to(dtype=dtype, device=device, copy=True)
