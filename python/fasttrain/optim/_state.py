"""FusedAdamW's per-parameter state: which layout (``layouts``) a ``state_dtype`` gives a parameter, creating the
state, checking and restoring a loaded one.

``state_dtype=None`` keeps the moments in the parameter's dtype, ``"float32"`` in fp32 (``layouts.FullPrecision``);
``"8bit"`` blockwise 8-bit (``layouts.Blockwise8``) for parameters of at least ``min_8bit_size`` elements (counted
over the whole parameter, not a shard, so that every rank and every world size picks the same layout), fp32 below.
Parameters with rows of one element (1-D parameters: norms and biases, however large, and ``[n, 1]``) keep fp32
moments when they are DTensors (like the parameter): a block of one element would cost more than fp32, and
256-element blocks of a 1-D tensor would straddle shards.

A saved state of the other layout is converted on load (``conform``).

Plus ``step``: an fp32 scalar tensor on the parameter's device, as torch's fused AdamW keeps it.
"""

from __future__ import annotations

from typing import Any

import torch

from . import blockwise8
from ._tensors import is_dtensor, local
from .layouts import Blockwise8, FullPrecision, Layout

STATE_DTYPES = (None, "float32", "8bit")
_LOW_PRECISION = (torch.bfloat16, torch.float16)


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
        return FullPrecision(param.dtype)
    # a DTensor's numel is the whole parameter's; its rows of one element keep fp32 moments (module doc)
    rows_ok = not is_dtensor(param) or blockwise8.row_shape(param.shape)[1] > 1
    if mode == "8bit" and param.numel() >= group["min_8bit_size"] and rows_ok:
        return Blockwise8()
    return FullPrecision(full_precision(param))


def step_tensor(param: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    # fp32 on the parameter's device, as torch's fused AdamW keeps it: the kernels read it
    return torch.tensor(value, dtype=torch.float32, device=local(param).device)


def has_moment(state: dict[str, Any], name: str) -> bool:
    return name in state or f"{name}_codes" in state


def init(state: dict[str, Any], group: dict[str, Any], param: torch.Tensor, where: str) -> Layout:
    """Create what ``state`` lacks for ``param`` (lazily, at its first step); returns its layout."""
    lay = layout(group, param)
    lay.check_param(param, where)
    if not has_moment(state, "exp_avg"):
        state["step"] = step_tensor(param)
        lay.new_moment(state, "exp_avg", param)
        lay.new_moment(state, "exp_avg_sq", param)
    if group["amsgrad"] and not has_moment(state, "max_exp_avg_sq"):
        lay.new_moment(state, "max_exp_avg_sq", param)
    step = state.get("step", 0.0)
    if (
        not isinstance(step, torch.Tensor)
        or step.device != local(param).device
        or step.dtype != torch.float32
    ):
        state["step"] = step_tensor(param, float(step))  # a state set by hand or loaded without our loader
    return lay


def conform(saved: dict[str, Any], group: dict[str, Any], param: torch.Tensor, where: str) -> dict[str, Any]:
    """A saved per-parameter state in the layout this optimizer gives ``param``: as it is when it has that layout
    (checked; a ValueError says what does not fit), else converted: full-precision moments quantized into 8-bit
    blocks, 8-bit moments dequantized (``step`` kept). A state saved under another ``state_dtype`` or
    ``min_8bit_size``, or gathered from FSDP2 shards (where 1-D parameters keep fp32 moments), loads this way."""
    if not saved:
        return saved
    lay = layout(group, param)
    if lay.holds(saved):
        lay.check_saved(saved, param, where)
        return saved
    source = Blockwise8() if Blockwise8.holds(saved) else FullPrecision(torch.float32)
    converted = lay.adopt(source.saved_moments(saved, param, where), param)
    return {**({"step": saved["step"]} if "step" in saved else {}), **converted}


def restore(state: dict[str, Any], saved: dict[str, Any], param: torch.Tensor, lay: Layout) -> None:
    """Put back what torch's loader cast to the parameter's dtype: each saved tensor in the dtype of its role."""
    device = local(param).device
    for key, value in saved.items():
        if key == "step":
            state["step"] = step_tensor(param, float(value))
        elif isinstance(value, torch.Tensor):
            state[key] = value.to(dtype=lay.stored_dtype(key), device=device, copy=True)
