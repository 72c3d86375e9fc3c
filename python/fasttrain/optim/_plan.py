"""FusedAdamW's step plans: what ``step()`` and ``defer_clip_grad_norm_`` decide per parameter, kept across steps.

Deciding is Python work per parameter on every step (the state's layout, the backend, whether the Triton kernel
takes its tensors, the buckets, the launch tables' addresses): about 10 us a parameter, 1.5 ms for GPT-2's 148
tensors, while the kernels it launches take about 1 ms on an H200. A plan keeps those decisions; the next step
checks in a few C-level passes over the group (``map`` over ``data_ptr``, ``dtype``, ``is_contiguous``, ids) that
nothing they were made from changed, and launches the same kernels with the same arguments. Anything else
falls back to deciding again, as before.

What a group's plan is made from, and how the check sees a change:

- the group dict, the identity of every tensor in its ``params`` (ids of tensors the plan holds), and the salt
  base (the number of parameters in the earlier groups: stochastic rounding's salts);
- the group options that pick layouts, backends and tables (``backend``, ``state_dtype``, ``min_8bit_size``,
  ``amsgrad``, ``bf16_stochastic_rounding``, ``sr_seed``), and whether Triton interprets (``TRITON_INTERPRET``);
  lr, betas, eps, weight_decay and maximize are read at every step, never planned;
- which parameters have a gradient (a gradient that appears or disappears, ``requires_grad`` changes);
- each stepped parameter's storage address (``p.data = ...``, a move or a cast);
- each gradient's address, dtype and contiguity. A sparse gradient has no address (``data_ptr`` raises): it
  falls back, where ``step()`` refuses it. An address also tells the device: host and device memory share one
  virtual address space (CUDA's UVA). A gradient at a new address only rewrites the gradient row of the launch
  tables (``TensorTable.with_row``): HF's ``zero_grad(set_to_none=True)`` reallocates every gradient each step;
- each stepped parameter's state dict and the tensors in it, by identity (state created or replaced).

``FusedAdamW`` also drops every plan on ``add_param_group``, ``load_state_dict`` and ``__setstate__``.

Not planned (decided every step, as before): groups with a DTensor parameter or gradient (FSDP2), whose local
shards and placements are not worth proving unchanged; the per-parameter steps of ``step_in_backward``.

A plan holds its parameters, their state tensors and the group (all owned by the optimizer anyway), never a
gradient: a gradient set to None must be freed. It keeps their addresses only.
"""

from __future__ import annotations

import dataclasses
import operator
from itertools import chain
from typing import Any

import torch

from .._backend import triton_interpreting

_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_MAX_VARIANTS = 4  # gradient rows kept per bucket: allocators that alternate between a few address sets


def options(group: dict[str, Any]) -> tuple:
    """The group's settings that a plan's decisions depend on."""
    return (
        group["backend"],
        group["state_dtype"],
        group["min_8bit_size"],
        group["amsgrad"],
        group["bf16_stochastic_rounding"],
        group["sr_seed"],
        triton_interpreting(),
    )


def _grad_signature(live: list[torch.Tensor]) -> tuple[list[int], list[Any], list[bool]] | None:
    try:
        ptrs = list(map(_DATA_PTR, live))
    except RuntimeError:  # no storage: sparse (refused by step) or a wrapper subclass
        return None
    return ptrs, list(map(_DTYPE, live)), list(map(_IS_CONTIGUOUS, live))


@dataclasses.dataclass(eq=False)
class Bucket:
    """One launch: the parameters of one (device, dtype, gradient dtype, layout) and backend, in step order.

    ``index``: their positions in the plan's gradients. Triton: ``table`` (rows: params, grads, moments, steps).
    torch: local ``params`` and shallow copies of the ``states`` (local tensors), ``offsets`` for the rounding."""

    triton: bool
    device: torch.device
    p_dtype: torch.dtype
    g_dtype: torch.dtype | None
    lay: Any
    index: list[int]
    steps: list[torch.Tensor]
    salts: list[int]
    sr_seed: int | None
    offsets: list[int] | None = None
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)
    states: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    table: Any = None
    grad_row: int = 1
    grad_ptrs: tuple[int, ...] = ()
    variants: dict[tuple[int, ...], Any] = dataclasses.field(default_factory=dict)

    def regrad(self, ptrs: list[int]) -> None:
        """Point the table's gradient row at the gradients now at ``ptrs`` (the plan's, all of them)."""
        mine = tuple(map(ptrs.__getitem__, self.index))
        if self.table is None or mine == self.grad_ptrs:
            return
        self.variants.setdefault(self.grad_ptrs, self.table)
        table = self.variants.get(mine)
        if table is None:
            if len(self.variants) >= _MAX_VARIANTS:
                self.variants.clear()
            table = self.table.with_row(self.grad_row, mine)
        self.table, self.grad_ptrs = table, mine


@dataclasses.dataclass(eq=False)
class GroupPlan:
    """One param group's step: its buckets, and what they were decided from (module doc)."""

    group: dict[str, Any]
    salt_base: int
    params: list[torch.Tensor]  # held: keeps param_ids unique
    options: tuple
    none_mask: list[bool]
    stepped: list[torch.Tensor]
    param_ptrs: list[int]
    states: list[dict[str, Any]]
    values: list[Any]  # held: keeps value_ids unique
    grad_ptrs: list[int]
    grad_dtypes: list[Any]
    grad_contiguous: list[bool]
    buckets: list[Bucket]
    param_ids: list[int] = dataclasses.field(init=False)
    value_ids: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.param_ids = list(map(id, self.params))
        self.value_ids = list(map(id, self.values))

    @classmethod
    def make(
        cls,
        group: dict[str, Any],
        salt_base: int,
        stepped: list[torch.Tensor],
        states: list[dict[str, Any]],
        live: list[torch.Tensor],
        buckets: list[Bucket],
    ) -> GroupPlan | None:
        """The plan of a group just decided (``live``: the stepped parameters' gradients); None when the check
        could not see a change (module doc: a gradient without an address)."""
        signature = _grad_signature(live)
        if signature is None:
            return None
        params = list(group["params"])
        return cls(
            group=group,
            salt_base=salt_base,
            params=params,
            options=options(group),
            none_mask=[p.grad is None for p in params],
            stepped=stepped,
            param_ptrs=list(map(_DATA_PTR, stepped)),
            states=states,
            values=list(chain.from_iterable(map(dict.values, states))),
            grad_ptrs=signature[0],
            grad_dtypes=signature[1],
            grad_contiguous=signature[2],
            buckets=buckets,
        )

    def live_grads(self, group: dict[str, Any], salt_base: int, state: Any) -> list[torch.Tensor] | None:
        """The stepped parameters' gradients when this plan still holds for ``group`` (tables re-pointed at
        gradients that moved), else None."""
        if group is not self.group or salt_base != self.salt_base:
            return None
        params = group["params"]
        if list(map(id, params)) != self.param_ids or options(group) != self.options:
            return None
        grads = list(map(_GRAD, params))
        if [g is None for g in grads] != self.none_mask:
            return None
        live = [g for g in grads if g is not None]
        stepped = self.stepped
        if list(map(_DATA_PTR, stepped)) != self.param_ptrs:
            return None
        states = list(map(state.__getitem__, stepped))
        if not all(map(operator.is_, states, self.states)):
            return None
        if list(map(id, chain.from_iterable(map(dict.values, states)))) != self.value_ids:
            return None
        return live if _follow_grads(self, live) else None


@dataclasses.dataclass(eq=False)
class Unplanned:
    """A group's step decided for this step only (module doc: what is not planned)."""

    buckets: list[Bucket]


@dataclasses.dataclass(eq=False)
class ClipPlan:
    """``defer_clip_grad_norm_``'s buckets of gradients (one device and dtype each, first-seen order, as
    ``clip.total_norm`` groups them), with the Triton decision and norm table of each."""

    params: list[torch.Tensor]  # every group's, in order (held: keeps param_ids unique)
    backend: tuple  # group 0's backend (the norm's backend) and whether Triton interprets
    none_mask: list[bool]
    grad_ptrs: list[int]
    grad_dtypes: list[Any]
    grad_contiguous: list[bool]
    buckets: list[Bucket]
    param_ids: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.param_ids = list(map(id, self.params))

    @staticmethod
    def all_params(groups: list[dict[str, Any]]) -> list[torch.Tensor]:
        return list(chain.from_iterable(g["params"] for g in groups))

    @staticmethod
    def backend_key(groups: list[dict[str, Any]]) -> tuple:
        return (groups[0]["backend"] if groups else None, triton_interpreting())

    @classmethod
    def make(
        cls, groups: list[dict[str, Any]], live: list[torch.Tensor], buckets: list[Bucket]
    ) -> ClipPlan | None:
        signature = _grad_signature(live)
        if signature is None:
            return None
        params = cls.all_params(groups)
        return cls(
            params=params,
            backend=cls.backend_key(groups),
            none_mask=[p.grad is None for p in params],
            grad_ptrs=signature[0],
            grad_dtypes=signature[1],
            grad_contiguous=signature[2],
            buckets=buckets,
        )

    def live_grads(self, groups: list[dict[str, Any]]) -> list[torch.Tensor] | None:
        params = self.all_params(groups)
        if list(map(id, params)) != self.param_ids or self.backend_key(groups) != self.backend:
            return None
        grads = list(map(_GRAD, params))
        if [g is None for g in grads] != self.none_mask:
            return None
        live = [g for g in grads if g is not None]
        return live if _follow_grads(self, live) else None


def _follow_grads(plan, live: list[torch.Tensor]) -> bool:
    """Whether ``live``'s dtypes and layouts are those ``plan`` was made for; where only their addresses moved
    (``zero_grad(set_to_none=True)`` makes new gradients every step), its buckets' gradient rows follow them."""
    signature = _grad_signature(live)
    if signature is None or signature[1] != plan.grad_dtypes or signature[2] != plan.grad_contiguous:
        return False
    if signature[0] != plan.grad_ptrs:
        for bucket in plan.buckets:
            bucket.regrad(signature[0])
        plan.grad_ptrs = signature[0]
    return True
