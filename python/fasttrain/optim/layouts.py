"""FusedAdamW's state layouts: one class per way of keeping the AdamW moments of a parameter.

A layout owns everything that differs between them: the tensors a state holds and creating them, whether a saved
state is of this layout and putting it back, reading a saved state's moments and adopting another layout's (a
load across layouts), and how a step reads and writes them (which Triton kernel, or the working copies of torch's
kernel). ``_state.layout`` picks one per parameter from its group's ``state_dtype``;
nothing else asks which layout a state has. A new layout is one class here and its case in ``_state.layout``.

- ``FullPrecision(dtype)``: ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) of the parameter's shape in that
  dtype: torch.optim.AdamW's layout; the parameter's dtype for ``state_dtype=None``, fp32 for ``"float32"``;
- ``Blockwise8()``: ``exp_avg_codes`` / ``exp_avg_absmax``, ``exp_avg_sq_codes`` / ``exp_avg_sq_absmax`` (and the
  ``max_exp_avg_sq_*`` pair), in ``fasttrain.optim.blockwise8``'s format. Different names from torch's on
  purpose: torch's AdamW given such a state fails loudly (a missing ``exp_avg``) instead of reading codes as
  moments.

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
``[0, ceil(cols / 256)]`` absmax. Placements other than ``Shard(0)`` and ``Replicate()`` (tensor parallel's
``Shard(1)``, strided shards) are refused with a ValueError.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .._logging import log_once
from . import blockwise8
from ._tensors import is_dtensor, like_param, local

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}


def moment_names(amsgrad: bool) -> tuple[str, ...]:
    return MOMENTS if amsgrad else MOMENTS[:2]


def _check_like(t: Any, param: torch.Tensor, key: str, where: str) -> None:
    """A ValueError unless ``t`` is a tensor of ``param``'s shape, a DTensor placed like it for a DTensor."""
    sharded = is_dtensor(param)
    if not (
        isinstance(t, torch.Tensor)
        and tuple(t.shape) == tuple(param.shape)
        and is_dtensor(t) == sharded
        and (not sharded or tuple(t.placements) == tuple(param.placements))
    ):
        like = f"a DTensor placed {tuple(param.placements)}" if sharded else "a plain tensor"
        raise ValueError(
            f"{where}: the state dict's {key} is {_describe(t)}; converting it needs {like} of the parameter's "
            f"shape {tuple(param.shape)}"
        )


def _describe(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(type(t).__name__)
    kind = f"a DTensor placed {tuple(t.placements)}" if is_dtensor(t) else "a plain tensor"
    return f"{kind} of shape {tuple(t.shape)}"


@dataclasses.dataclass(frozen=True)
class FullPrecision:
    """Each moment a tensor of the parameter's shape in ``dtype`` (torch.optim.AdamW's layout)."""

    dtype: torch.dtype

    def new_moment(self, state: dict[str, Any], name: str, param: torch.Tensor) -> None:
        state[name] = torch.zeros_like(param, dtype=self.dtype, memory_format=torch.preserve_format)

    def check_param(self, param: torch.Tensor, where: str) -> None:
        """Any parameter can keep full-precision moments."""

    def tensor_names(self, amsgrad: bool) -> list[str]:
        """The state's moment tensors, in kernel order."""
        return list(moment_names(amsgrad))

    @staticmethod
    def holds(saved: dict[str, Any]) -> bool:
        return "exp_avg_codes" not in saved

    def check_saved(self, saved: dict[str, Any], param: torch.Tensor, where: str) -> None:
        """torch's loader casts full-precision moments to their dtype: any shape it accepts loads."""

    def saved_moments(
        self, saved: dict[str, Any], param: torch.Tensor, where: str
    ) -> dict[str, torch.Tensor]:
        """Each saved moment as fp32 values of ``param``'s local shape, to be converted into the other layout;
        a ValueError for a moment that is not a tensor like ``param``."""
        out = {}
        for name in MOMENTS:
            if name in saved:
                _check_like(saved[name], param, name, where)
                out[name] = local(saved[name]).float()
        return out

    def adopt(self, moments: dict[str, torch.Tensor], param: torch.Tensor) -> dict[str, Any]:
        """The state of this layout holding ``moments`` (``saved_moments``' values)."""
        cast = {name: m.to(self.dtype) for name, m in moments.items()}
        return (
            {name: like_param(m, param, param.shape) for name, m in cast.items()}
            if is_dtensor(param)
            else cast
        )

    def stored_dtype(self, key: str) -> torch.dtype:
        return self.dtype

    # -- the step: the Triton kernel's table and launch, or torch's kernel on working copies ----------------

    kernel_slots = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # the Triton table's moment rows
    table_kind = "adamw"

    def triton_can_step(self, state: dict[str, Any]) -> bool:
        return True

    def triton_step(
        self, table: Any, p_dtype: torch.dtype, g_dtype: torch.dtype, device: Any, args: Any
    ) -> None:
        from fasttrain.kernels import adamw

        adamw.adamw_step(table, p_dtype, g_dtype, self.dtype, args)

    def torch_native(self, param_dtype: torch.dtype) -> bool:
        """Whether torch's fused kernel steps these moments as they are (no working copies)."""
        return self.dtype == param_dtype

    def working(self, states: list[dict[str, Any]], name: str, work: torch.dtype) -> list[torch.Tensor]:
        return [s[name] if s[name].dtype == work else s[name].to(work) for s in states]

    def store(self, state: dict[str, Any], name: str, value: torch.Tensor, found_inf: Any) -> None:
        # a step skipped for found_inf left ``value`` as loaded: rounding it back gives the stored moment
        if state[name] is not value:
            state[name].copy_(value)

    def state_slice(self, state: dict[str, Any], start: int, stop: int) -> dict[str, Any] | None:
        """The state of elements ``start:stop`` of the flattened parameter, as views (None: cannot be sliced)."""
        names = [n for n in MOMENTS if n in state]
        if not all(state[n].is_contiguous() for n in names):
            return None
        return {"step": state["step"], **{n: state[n].view(-1)[start:stop] for n in names}}


@dataclasses.dataclass(frozen=True)
class Blockwise8:
    """Each moment as uint8 codes and an fp32 absmax per block of 256 elements (``blockwise8``; module doc)."""

    def new_moment(self, state: dict[str, Any], name: str, param: torch.Tensor) -> None:
        if is_dtensor(param):
            codes, absmax = blockwise8.empty_state(local(param), SIGNED[name], rows=True)
            rows, cols = blockwise8.row_shape(param.shape)
            state[f"{name}_codes"] = like_param(codes, param, param.shape)
            state[f"{name}_absmax"] = like_param(absmax, param, (rows, blockwise8.n_blocks(cols)))
        else:
            state[f"{name}_codes"], state[f"{name}_absmax"] = blockwise8.empty_state(param, SIGNED[name])

    def check_param(self, param: torch.Tensor, where: str) -> None:
        """A ValueError for a DTensor placed other than along rows of dim 0."""
        if not is_dtensor(param):
            return
        from torch.distributed.tensor import Replicate, Shard

        for placement in param.placements:
            if not (type(placement) is Replicate or (type(placement) is Shard and placement.dim == 0)):
                raise ValueError(
                    f"{where}: state_dtype='8bit' on a DTensor parameter sharded as {tuple(param.placements)}: its "
                    "blocks follow rows of dim 0, so only Shard(0) (FSDP2) and Replicate() placements are "
                    "supported; use state_dtype=None or torch.float32 for this parameter (its own param group)"
                )

    def tensor_names(self, amsgrad: bool) -> list[str]:
        names = moment_names(amsgrad)
        return [f"{n}_codes" for n in names] + [f"{n}_absmax" for n in names]

    @staticmethod
    def holds(saved: dict[str, Any]) -> bool:
        return "exp_avg_codes" in saved

    def check_saved(self, saved: dict[str, Any], param: torch.Tensor, where: str) -> None:
        """A ValueError unless each saved (codes, absmax) pair is a block layout of ``param`` (module doc)."""
        sharded = is_dtensor(param)
        rows, cols = blockwise8.row_shape(param.shape)
        for name in MOMENTS:
            codes, absmax = saved.get(f"{name}_codes"), saved.get(f"{name}_absmax")
            if codes is None and absmax is None:
                continue
            if not isinstance(codes, torch.Tensor) or not isinstance(absmax, torch.Tensor):
                raise ValueError(
                    f"{where}: the state dict holds {name}_codes or {name}_absmax without the other"
                )
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
                            f"{tuple(param.placements)}: load FSDP2 optimizer states with "
                            "torch.distributed.checkpoint (get_optimizer_state_dict / set_optimizer_state_dict), "
                            "which reshards them"
                        )
                continue
            problem = blockwise8.check_layout(codes, absmax)
            if tuple(codes.shape) != tuple(param.shape) or problem is not None or is_dtensor(absmax):
                raise ValueError(
                    f"{where}: the state dict's {name}_codes / {name}_absmax ({_describe(codes)} / "
                    f"{_describe(absmax)}) are not 8-bit blocks of a parameter of shape {tuple(param.shape)}"
                )

    def saved_moments(
        self, saved: dict[str, Any], param: torch.Tensor, where: str
    ) -> dict[str, torch.Tensor]:
        """Each saved moment dequantized: fp32 values of ``param``'s local shape (a shard's rows hold whole row
        blocks, so each rank dequantizes its own)."""
        self.check_saved(saved, param, where)
        return {
            name: blockwise8.dequantize(
                local(saved[f"{name}_codes"]), local(saved[f"{name}_absmax"]), SIGNED[name]
            )
            for name in MOMENTS
            if f"{name}_codes" in saved
        }

    def adopt(self, moments: dict[str, torch.Tensor], param: torch.Tensor) -> dict[str, Any]:
        """The state of this layout holding ``moments`` quantized (the blocks ``new_moment`` lays out)."""
        state: dict[str, Any] = {}
        for name, m in moments.items():
            self.new_moment(state, name, param)
            codes, absmax = state[f"{name}_codes"], state[f"{name}_absmax"]
            blockwise8.quantize_(m, local(codes), local(absmax), SIGNED[name])
        return state

    def stored_dtype(self, key: str) -> torch.dtype:
        return torch.uint8 if key.endswith("_codes") else torch.float32

    # -- the step ------------------------------------------------------------------------------------------------

    kernel_slots = tuple(f"{n}_codes" for n in MOMENTS) + tuple(f"{n}_absmax" for n in MOMENTS)
    table_kind = "adamw8"

    def triton_can_step(self, state: dict[str, Any]) -> bool:
        """The Triton kernel reads flat runs of 256 elements: the unsharded layout, or row blocks of rows that
        are a multiple of 256 long."""
        codes, absmax = local(state["exp_avg_codes"]), local(state["exp_avg_absmax"])
        if absmax.dim() == 1 or blockwise8.row_shape(codes.shape)[1] % blockwise8.BLOCK == 0:
            return True
        log_once(
            "fused_adamw.triton_row_blocks",
            "FusedAdamW: 8-bit moments of a DTensor parameter whose rows are not a multiple of 256 elements "
            "(row blocks, not the Triton kernel's flat blocks): its parameter is updated by torch's fused AdamW",
        )
        return False

    def triton_step(
        self, table: Any, p_dtype: torch.dtype, g_dtype: torch.dtype, device: Any, args: Any
    ) -> None:
        from fasttrain.kernels import adamw8bit

        adamw8bit.adamw8bit_step(table, p_dtype, g_dtype, blockwise8.tables(device), args)

    def torch_native(self, param_dtype: torch.dtype) -> bool:
        return False

    def working(self, states: list[dict[str, Any]], name: str, work: torch.dtype) -> list[torch.Tensor]:
        return [
            blockwise8.dequantize(s[f"{name}_codes"], s[f"{name}_absmax"], SIGNED[name], work) for s in states
        ]

    def state_slice(self, state: dict[str, Any], start: int, stop: int) -> dict[str, Any] | None:
        """The codes and absmax of elements ``start:stop`` (``start`` a multiple of the block) of the flattened
        parameter, as views; None for row blocks (a DTensor's) or a slice that would split a block."""
        names = [n for n in MOMENTS if f"{n}_codes" in state]
        if start % blockwise8.BLOCK or any(state[f"{n}_absmax"].dim() != 1 for n in names):
            return None
        if not all(state[f"{n}_codes"].is_contiguous() for n in names):
            return None
        blocks = slice(start // blockwise8.BLOCK, blockwise8.n_blocks(stop))
        out: dict[str, Any] = {"step": state["step"]}
        for n in names:
            out[f"{n}_codes"] = state[f"{n}_codes"].view(-1)[start:stop]
            out[f"{n}_absmax"] = state[f"{n}_absmax"][blocks]
        return out

    def store(self, state: dict[str, Any], name: str, value: torch.Tensor, found_inf: Any) -> None:
        # requantizing is not idempotent: a step skipped for found_inf keeps the stored codes
        codes, absmax = state[f"{name}_codes"], state[f"{name}_absmax"]
        new_codes, new_absmax = torch.empty_like(codes), torch.empty_like(absmax)
        blockwise8.quantize_(value, new_codes, new_absmax, SIGNED[name])
        if found_inf is not None:
            skip = found_inf.to(codes.device) != 0
            new_codes = torch.where(skip, codes, new_codes)
            new_absmax = torch.where(skip, absmax, new_absmax)
        codes.copy_(new_codes)
        absmax.copy_(new_absmax)


Layout = FullPrecision | Blockwise8
