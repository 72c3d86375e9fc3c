"""What fasttrain did to one trainer: the paths asked for, the status of each, and where its evidence lies.

``trainer.fasttrain_status`` is this ledger's ``status`` dict: a path says ``"on"`` only once evidence shows it ran
(settled after the first optimizer step, see ``settle``); until then, or when it cannot run, ``"off: <why>"``.
"""

from __future__ import annotations

import weakref
from typing import Any

from .._logging import log_once
from ..hot_paths import HotPaths

NOT_RUN = "off: has not run yet"
_ATTR = "_fasttrain_seam"


class Seam:
    """One trainer's ledger. Held in the trainer's ``__dict__``; holds the trainer weakly."""

    def __init__(self, trainer: Any, paths: HotPaths) -> None:
        self.paths = paths
        self.status: dict[str, str] = {
            name: NOT_RUN if getattr(paths, name) else "off: switched off" for name in HotPaths.names()
        }
        self.trainer = weakref.ref(trainer)
        self.fallbacks: set[str] = set()  # paths the user wanted that could not run
        self.notes: list[str] = []  # warnings about the run itself, repeated in the status line
        self.others: list[
            str
        ] = []  # what another library serves in this run (Liger), said in the status line
        self.logged = False  # the status line was written
        self.deepspeed: dict[str, Any] | None = (
            None  # the DeepSpeed config, when the trainer runs under DeepSpeed
        )
        self.settle_hooked: weakref.ref[Any] | None = (
            None  # the optimizer whose first step settles the status
        )
        self.loading_checkpoint = (
            False  # the Trainer is loading the optimizer's state: its steps are no training
        )
        self.sampler: Any = None  # the Rust sampler built for the trainer (its iteration is the evidence)
        self.packer: Any = None  # the PackingCollator of the last training loader built
        self.packed_steps = 0  # training steps whose inputs were a packed batch
        self.trl_decided = False  # the TRL fused head was looked for (at the first compute_loss)
        self.trl_calls_done = 0  # forwards fasttrain served in earlier trainings (the heads went back after)
        self.loss_watch: Any = None  # the loss path's state (integration.loss._Watch)
        self.clip_bypassed: str | None = (
            None  # the trainer's _clip_grad_norm clipped without Accelerate's clip
        )
        self.in_backward: Any = (
            None  # integration.in_backward's state, when optim_args asks for step_in_backward
        )

    def off(self, name: str, reason: str, fallback: bool = True) -> None:
        """Record why ``name`` does not run; ``fallback`` when the user asked for it and it could apply."""
        if getattr(self.paths, name) and fallback:
            # decided after the status line: say it now, unless the status line already said this very reason
            if self.logged and self.status.get(name) != f"off: {reason}":
                log_once(f"fallback:{name}:{reason}", f"fasttrain: the {name} hot path falls back ({reason})")
            self.fallbacks.add(name)
        self.status[name] = f"off: {reason}"

    def not_run_yet(self, name: str) -> None:
        """``name`` may run after all (a new model, a new loader): back to "has not run yet" before the status line."""
        if not self.logged and getattr(self.paths, name):
            self.status[name] = NOT_RUN


def attach(trainer: Any, paths: HotPaths) -> Seam:
    seam = Seam(trainer, paths)
    trainer.__dict__[_ATTR] = seam
    return seam


def seam_of(trainer: Any) -> Seam:
    return trainer.__dict__[_ATTR]


def find_seam(trainer: Any) -> Seam | None:
    """The trainer's ledger, or None for a trainer fasttrain was not applied to."""
    return trainer.__dict__.get(_ATTR)
