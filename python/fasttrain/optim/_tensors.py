"""Small helpers shared by the optimizer and the clipping code: DTensor-aware local views and grouping."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import torch

try:  # DTensor exists in every torch fasttrain supports, but a build without distributed has none
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank owns: a DTensor's local shard (a view sharing its storage), else ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def like_param(t: torch.Tensor, param: torch.Tensor, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """``t`` (this rank's part of a state of global ``shape``, whose dim 0 is the parameter's) as a DTensor on
    ``param``'s mesh with its placements. The global shape and strides are given, not inferred: FSDP2's shards
    of dim 0 may be uneven (``torch.chunk``'s split: the last ranks own fewer rows, or none)."""
    shape = tuple(shape)
    stride = []
    step = 1
    for d in reversed(shape):
        stride.append(step)
        step *= max(d, 1)
    return DTensor.from_local(
        t,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(reversed(stride)),
    )


def group_by(items: Iterable[Any], key) -> dict[Hashable, list[Any]]:
    """Items bucketed by ``key(item)``, buckets and items in first-seen order (as torch's grouping)."""
    out: dict[Hashable, list[Any]] = {}
    for item in items:
        out.setdefault(key(item), []).append(item)
    return out
