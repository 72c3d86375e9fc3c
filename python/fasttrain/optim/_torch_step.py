"""FusedAdamW's torch backend: torch's own fused AdamW kernel (``torch._fused_adamw_``) for every layout.

When the moments are in the parameter's dtype, the gradients too, and no stochastic rounding is asked for, the
lists go to torch's kernel as they are: exactly ``torch.optim.AdamW(fused=True)``. Otherwise each batch of tensors
is staged: parameters, gradients and moments (dequantized for 8-bit states) are copied into fp32 working tensors
(fp64 for fp64 parameters), torch's kernel steps those, and the results are written back once, rounded to their
storage (nearest, stochastic for bf16 parameters when asked, or requantized). The staging costs memory for one
batch (STAGE_ELEMENTS elements per role) and extra passes: it is the fallback where the Triton kernel, which does
all of this in one pass, does not run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from . import rounding
from ._heap import release_free_heap
from .layouts import Layout, moment_names

STAGE_ELEMENTS = 1 << 22  # elements per staged batch: 16 MB per fp32 role (its int64 rounding bits: 32 MB)


def _batches(items: list[Any], numel) -> Iterator[list[Any]]:
    batch: list[Any] = []
    size = 0
    for item in items:
        if batch and size + numel(item) > STAGE_ELEMENTS:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += numel(item)
    if batch:
        yield batch


def step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict[str, Any]],
    lay: Layout,
    *,
    amsgrad: bool,
    sr_seed: int | None,
    salts: list[int],
    offsets: list[int] | None = None,
    found_inf: torch.Tensor | None,
    **hyper: Any,
) -> None:
    """One step (steps already incremented) of local tensors of one device and parameter dtype, one layout.

    ``salts`` and ``offsets`` (the global index of each tensor's first element: a shard's offset; default 0) pick
    the stochastic rounding's bits (``fasttrain.optim.rounding``).

    ``hyper``: lr, beta1, beta2, weight_decay, eps, maximize, grad_scale (as ``torch._fused_adamw_`` takes them).
    """
    names = lay.tensor_names(amsgrad)
    steps = [s["step"] for s in states]
    native = (
        lay.torch_native(params[0].dtype)
        and sr_seed is None
        and all(g.dtype == params[0].dtype for g in grads)
    )
    if native:
        moment_lists = [[s[n] for s in states] for n in names]
        if not amsgrad:
            moment_lists.append([])
        torch._fused_adamw_(
            params, grads, *moment_lists, steps, amsgrad=amsgrad, found_inf=found_inf, **hyper
        )
        return
    work = torch.promote_types(params[0].dtype, torch.float32)
    offsets = [0] * len(params) if offsets is None else offsets
    pieces = list(_pieces(params, grads, states, lay, salts, offsets))
    for batch in _batches(pieces, lambda piece: piece[0].numel()):
        p, g, st, sa, off = (list(column) for column in zip(*batch, strict=True))
        _staged(p, g, st, lay, work, amsgrad=amsgrad, sr_seed=sr_seed, salts=sa, offsets=off, found_inf=found_inf,
                **hyper)  # fmt: skip
    if params[0].device.type == "cpu" and sum(p.numel() for p in params) > STAGE_ELEMENTS // 4:
        release_free_heap()  # the batches' freed working tensors (module _heap)


def _pieces(params, grads, states, lay: Layout, salts, offsets) -> Iterator[tuple]:
    """(param, grad, state, salt, offset) per tensor, a tensor larger than a staged batch cut into flat slices of
    STAGE_ELEMENTS (views: the step writes through them): its working copies then cost one batch, not the tensor
    (a 4B model's 389M-element embedding staged whole would want ~10 GB of fp32 and int64 temporaries). Every
    operation is per element, the 8-bit blocks are whole (a slice that would split one is not made) and the
    stochastic rounding's bits follow the global index (``offset``): the slices' step is the whole tensor's, bit
    for bit."""
    for p, g, s, salt, offset in zip(params, grads, states, salts, offsets, strict=True):
        n = p.numel()
        sliceable = n > STAGE_ELEMENTS and p.is_contiguous() and g.is_contiguous()
        starts = range(0, n, STAGE_ELEMENTS)
        slices = [lay.state_slice(s, a, min(a + STAGE_ELEMENTS, n)) for a in starts] if sliceable else [None]
        if any(part is None for part in slices):
            yield p, g, s, salt, offset
            continue
        flat_p, flat_g = p.view(-1), g.view(-1)
        for a, part in zip(starts, slices, strict=True):
            yield flat_p[a : a + STAGE_ELEMENTS], flat_g[a : a + STAGE_ELEMENTS], part, salt, offset + a


def _staged(
    params, grads, states, lay, work, *, amsgrad, sr_seed, salts, offsets, found_inf, **hyper
) -> None:
    ps = [p if p.dtype == work else p.to(work) for p in params]
    gs = [g if g.dtype == work else g.to(work) for g in grads]
    names = moment_names(amsgrad)
    ms = [lay.working(states, n, work) for n in names]
    if not amsgrad:
        ms.append([])
    steps = [s["step"] for s in states]
    torch._fused_adamw_(ps, gs, *ms, steps, amsgrad=amsgrad, found_inf=found_inf, **hyper)

    # write back; a step skipped for found_inf left the working copies as loaded: every rounding below gives
    # back the stored value, and the layout keeps what would not (requantization)
    for p, p_work, salt, offset, s in zip(params, ps, salts, offsets, states, strict=True):
        if p_work is p:
            continue
        if sr_seed is not None and p.dtype == torch.bfloat16:
            rounding.stochastic_round_to_bf16_(p, p_work, rounding.sr_key(sr_seed, salt, s["step"]), offset)
        else:
            p.copy_(p_work)
    for n, values in zip(names, ms, strict=False):
        for s, x in zip(states, values, strict=True):
            lay.store(s, n, x, found_inf)
