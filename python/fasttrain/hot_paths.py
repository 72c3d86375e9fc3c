"""Which hot paths fasttrain switches on, and how a user switches each one off.

Every hot path can be turned off on its own, for ablations and for users who hit a problem:

- in code: ``fasttrain.Trainer(..., hot_paths=HotPaths(loss=False))`` or ``fasttrain.patch(hot_paths=...)``;
- from the environment, without touching the script: ``FASTTRAIN_DISABLE=loss,sampler``
  (``all`` turns every hot path off; the names are the fields below).
"""

from __future__ import annotations

import dataclasses
import os

ENV_DISABLE = "FASTTRAIN_DISABLE"


@dataclasses.dataclass(frozen=True)
class HotPaths:
    optimizer: bool = True  # Triton fused AdamW for optim="adamw_torch"/"adamw_torch_fused"
    clip: bool = True  # gradient clipping fused into the optimizer step (needs `optimizer`)
    loss: bool = True  # chunked fused-linear cross-entropy in supported causal LMs
    collator: bool = True  # Rust collators in place of the transformers ones
    sampler: bool = True  # Rust length-grouped sampler for group_by_length
    packing: bool = True  # padded causal-LM training batches packed into one padding-free row, where exact

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_env(cls, base: HotPaths | None = None) -> HotPaths:
        """``base`` (all on by default) with the paths named in FASTTRAIN_DISABLE switched off."""
        base = base or cls()
        raw = os.environ.get(ENV_DISABLE, "")
        names = {n.strip().lower() for n in raw.split(",") if n.strip()}
        if not names:
            return base
        if "all" in names:
            return cls(**dict.fromkeys(cls.names(), False))
        unknown = names - set(cls.names())
        if unknown:
            raise ValueError(
                f"{ENV_DISABLE} names unknown hot path(s) {sorted(unknown)}; "
                f"known: {', '.join(cls.names())} or 'all'"
            )
        return dataclasses.replace(base, **dict.fromkeys(names, False))
