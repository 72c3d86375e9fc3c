"""The hot paths fasttrain switches on, in one list, and how a user switches each one off.

``REGISTRY`` is the one list of hot paths: each entry names the path (the ``HotPaths`` field, the status key and the
``FASTTRAIN_DISABLE`` name) and its installer, a module of ``fasttrain.integration`` with ``arm(trainer, seam)``
(called by ``integration.apply`` when the path is on) and ``verdict(seam, trainer, optimizer)`` (called by
``integration.settle`` after the first optimizer step: "on" only where the path's evidence shows it ran). Adding a
hot path is one entry here and its installer; the order is the status's and the arming's.

Every hot path can be turned off on its own, for ablations and for users who hit a problem:

- in code: ``fasttrain.Trainer(..., hot_paths=HotPaths(loss=False))`` or ``fasttrain.patch(hot_paths=...)``;
- from the environment, without touching the script: ``FASTTRAIN_DISABLE=loss,sampler``
  (``all`` turns every hot path off; the names are ``HotPaths.names()``).
"""

from __future__ import annotations

import dataclasses
import os

ENV_DISABLE = "FASTTRAIN_DISABLE"


@dataclasses.dataclass(frozen=True)
class HotPath:
    name: str
    what: str  # what switching it on does
    installer: str  # its module in fasttrain.integration (arm, verdict)
    always_armed: bool = False  # armed when switched off too


REGISTRY = (
    # its installer hooks create_optimizer even when the path is off: the optimizer's first step settles the status
    HotPath("optimizer", 'Triton fused AdamW for optim="adamw_torch"/"adamw_torch_fused"', "optimizer", True),
    HotPath("clip", "gradient clipping fused into the optimizer step (needs `optimizer`)", "clip"),
    HotPath("loss", "chunked fused-linear cross-entropy in supported causal LMs", "loss"),
    HotPath("collator", "Rust collators in place of the transformers ones", "collator"),
    HotPath("sampler", "Rust length-grouped sampler for group_by_length", "sampler"),
    # armed after `collator`: it starts from the collator that path chose
    HotPath(
        "packing",
        "padded causal-LM training batches packed into one padding-free row, where exact",
        "packing",
    ),
)


class _Switches:
    """What ``HotPaths`` adds to its fields (one bool per ``REGISTRY`` entry, all on by default)."""

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


HotPaths = dataclasses.make_dataclass(
    "HotPaths",
    [(path.name, bool, dataclasses.field(default=True)) for path in REGISTRY],
    bases=(_Switches,),
    frozen=True,
)
HotPaths.__module__ = __name__
HotPaths.__doc__ = "Which hot paths to switch on (all by default): " + "; ".join(
    f"``{path.name}``: {path.what}" for path in REGISTRY
)
