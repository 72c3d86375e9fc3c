"""Small helpers shared by the optimizer and the clipping code: DTensor-aware local views and grouping."""

from __future__ import annotations

import functools
import math
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


def global_offset(t: torch.Tensor) -> int | None:
    """Where this rank's elements start in the row-major flattening of ``t``'s global tensor.

    0 for a plain tensor. For a DTensor sharded along dim 0 only (``Shard(0)`` on any mesh dimensions,
    ``Replicate`` on the others: FSDP2's full and hybrid shards) the local tensor holds the global elements
    ``offset .. offset + local numel - 1``, with ``offset`` = its first row (from the mesh coordinate and
    torch.chunk's uneven split, as DTensor computes it) times the elements of a row. None for any other placement
    (the local elements are not one range of the global ones).
    """
    if not is_dtensor(t):
        return 0
    return _dim0_offset(tuple(t.shape), t.device_mesh, tuple(t.placements))


@functools.lru_cache(maxsize=4096)
def _dim0_offset(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...]) -> int | None:
    from torch.distributed.tensor import Replicate, Shard

    if any(not (type(pl) is Replicate or (type(pl) is Shard and pl.dim == 0)) for pl in placements):
        return None
    if all(type(pl) is Replicate for pl in placements):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return int(offset[0]) * math.prod(shape[1:]) if offset else 0


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
