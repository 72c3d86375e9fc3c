"""FusedAdamW's per-parameter state: which layout a ``state_dtype`` gives a parameter, creating it, checking a loaded one.

Layouts (the value ``layout()`` returns):

- a torch dtype: ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) of the parameter's shape in that dtype:
  torch.optim.AdamW's layout; the dtype is the parameter's for ``state_dtype=None``, fp32 for ``"float32"``;
- ``"8bit"``: ``exp_avg_codes`` / ``exp_avg_absmax``, ``exp_avg_sq_codes`` / ``exp_avg_sq_absmax`` (and the
  ``max_exp_avg_sq_*`` pair), in ``fasttrain.optim.blockwise8``'s format. Different names from torch's on
  purpose: torch's AdamW given such a state fails loudly (a missing ``exp_avg``) instead of reading codes as
  moments. Parameters below ``min_8bit_size`` elements (counted over the whole parameter, not a shard, so that
  every rank and every world size picks the same layout) get the fp32 layout.

8-bit moments of DTensor (FSDP2) parameters: each rank quantizes the shard it owns, in row blocks
(``blockwise8``): the parameter is seen as ``[rows, cols]`` (dim 0 by the product of the others) and each row is
cut into blocks of 256 on its own. ``exp_avg_codes`` is a uint8 DTensor of the parameter's shape and
``exp_avg_absmax`` an fp32 DTensor ``[rows, ceil(cols / 256)]``, both on the parameter's mesh with its placements
(``Shard(0)``, with ``Replicate()`` on the replica dimension of a hybrid mesh). FSDP2 shards dim 0, so a shard is
whole rows, a block never spans two ranks, and the codes and absmax of a row live on the rank that owns the row:
torch.distributed.checkpoint reshards them exactly like the parameter (another world size, full <-> hybrid).
When ``cols % 256 == 0`` the row blocks are the unsharded optimizer's flat blocks: the sharded step equals the
unsharded 8-bit step bit for bit; otherwise rows end in a partial block (finer than the flat layout, within the
same quantization bound). Uneven shards: FSDP2 splits dim 0 as ``torch.chunk`` does and pads the last shards to
equal size inside its all-gather buffers only; a DTensor's local tensor (what the optimizer and these states
see) is unpadded, so padding rows never enter a block, and a rank that owns no rows holds empty codes and a
``[0, ceil(cols / 256)]`` absmax. Parameters with rows of one element (1-D parameters: norms and biases, however
large, and ``[n, 1]``) keep fp32 moments (DTensors like the parameter): a block of one element would cost more
than fp32, and 256-element blocks of a 1-D tensor would straddle shards. Placements other than ``Shard(0)`` and
``Replicate()`` (tensor parallel's ``Shard(1)``, strided shards) are refused with a ValueError.

Plus ``step``: an fp32 scalar tensor on the parameter's device, as torch's fused AdamW keeps it.
"""

from __future__ import annotations

from typing import Any

import torch

from . import blockwise8
from ._tensors import is_dtensor, like_param, local

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
    # a DTensor's numel is the whole parameter's; its rows of one element keep fp32 moments (module doc)
    rows_ok = not is_dtensor(param) or blockwise8.row_shape(param.shape)[1] > 1
    if mode == "8bit" and param.numel() >= group["min_8bit_size"] and rows_ok:
        return "8bit"
    return full_precision(param)


def _check_placements(param: torch.Tensor, where: str) -> None:
    from torch.distributed.tensor import Replicate, Shard

    for placement in param.placements:
        if not (type(placement) is Replicate or (type(placement) is Shard and placement.dim == 0)):
            raise ValueError(
                f"{where}: state_dtype='8bit' on a DTensor parameter sharded as {tuple(param.placements)}: its "
                "blocks follow rows of dim 0, so only Shard(0) (FSDP2) and Replicate() placements are supported; "
                "use state_dtype=None or torch.float32 for this parameter (its own param group)"
            )


def step_tensor(param: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    # fp32 on the parameter's device, as torch's fused AdamW keeps it: the kernels read it
    return torch.tensor(value, dtype=torch.float32, device=local(param).device)


def _new_moment(state: dict[str, Any], name: str, param: torch.Tensor, lay: Layout) -> None:
    if lay == "8bit" and is_dtensor(param):
        codes, absmax = blockwise8.empty_state(local(param), SIGNED[name], rows=True)
        rows, cols = blockwise8.row_shape(param.shape)
        state[f"{name}_codes"] = like_param(codes, param, param.shape)
        state[f"{name}_absmax"] = like_param(absmax, param, (rows, blockwise8.n_blocks(cols)))
    elif lay == "8bit":
        state[f"{name}_codes"], state[f"{name}_absmax"] = blockwise8.empty_state(param, SIGNED[name])
    else:
        state[name] = torch.zeros_like(param, dtype=lay, memory_format=torch.preserve_format)


def has_moment(state: dict[str, Any], name: str) -> bool:
    return name in state or f"{name}_codes" in state


def init(state: dict[str, Any], group: dict[str, Any], param: torch.Tensor, where: str) -> Layout:
    """Create what ``state`` lacks for ``param`` (lazily, at its first step); returns its layout."""
    lay = layout(group, param)
    if lay == "8bit" and is_dtensor(param):
        _check_placements(param, where)
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


def flat_blocks(state: dict[str, Any]) -> bool:
    """Whether an 8-bit state's blocks are flat runs of 256 elements in memory (what the Triton kernel reads):
    the unsharded layout, or row blocks of rows that are a multiple of 256 long."""
    codes, absmax = local(state["exp_avg_codes"]), local(state["exp_avg_absmax"])
    return absmax.dim() == 1 or blockwise8.row_shape(codes.shape)[1] % blockwise8.BLOCK == 0


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
        if quantized:
            _check_saved_blocks(saved, param, where)
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


def _describe(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(type(t).__name__)
    kind = f"a DTensor placed {tuple(t.placements)}" if is_dtensor(t) else "a plain tensor"
    return f"{kind} of shape {tuple(t.shape)}"


def _check_saved_blocks(saved: dict[str, Any], param: torch.Tensor, where: str) -> None:
    """A ValueError unless each saved (codes, absmax) pair is a block layout of ``param`` (see the module doc)."""
    sharded = is_dtensor(param)
    rows, cols = blockwise8.row_shape(param.shape)
    for name in MOMENTS:
        codes, absmax = saved.get(f"{name}_codes"), saved.get(f"{name}_absmax")
        if codes is None and absmax is None:
            continue
        if not isinstance(codes, torch.Tensor) or not isinstance(absmax, torch.Tensor):
            raise ValueError(f"{where}: the state dict holds {name}_codes or {name}_absmax without the other")
        if sharded:
            wanted = {
                f"{name}_codes": tuple(param.shape),
                f"{name}_absmax": (rows, blockwise8.n_blocks(cols)),
            }
            for key, shape in wanted.items():
                t = saved[key]
                if not (
                    is_dtensor(t)
                    and tuple(t.shape) == shape
                    and tuple(t.placements) == tuple(param.placements)
                ):
                    raise ValueError(
                        f"{where}: the state dict's {key} is {_describe(t)}; this DTensor parameter of shape "
                        f"{tuple(param.shape)} needs a DTensor of shape {shape} placed like the parameter "
                        f"{tuple(param.placements)}: load FSDP2 optimizer states with torch.distributed.checkpoint "
                        "(get_optimizer_state_dict / set_optimizer_state_dict), which reshards them"
                    )
            continue
        problem = blockwise8.check_layout(codes, absmax)
        if tuple(codes.shape) != tuple(param.shape) or problem is not None or is_dtensor(absmax):
            raise ValueError(
                f"{where}: the state dict's {name}_codes / {name}_absmax ({_describe(codes)} / "
                f"{_describe(absmax)}) are not 8-bit blocks of a parameter of shape {tuple(param.shape)}"
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
