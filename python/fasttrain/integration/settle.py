"""After the first optimizer step every path has had its chance to run: read each path's evidence, write the status
line once (INFO, or WARNING when a path the user wanted fell back or the run itself deserves a warning)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._logging import logger
from ..hot_paths import REGISTRY
from .ledger import Seam, seam_of
from .trainer_api import override, private_hook_missing


def arm(trainer: Any) -> None:
    """Loading a sharded optimizer checkpoint (FSDP2 resume: ``set_optimizer_state_dict``, inside the Trainer's
    ``_load_optimizer_and_scheduler``) first steps the optimizer once with zero gradients and lr 0 to create its
    state. That step is no training step: settling there would declare the clip and loss off before they could
    run. The Trainer's loader says so while it runs (``seam.loading_checkpoint``)."""
    if private_hook_missing("_load_optimizer_and_scheduler", ("checkpoint",)) is None:
        override(trainer, "_load_optimizer_and_scheduler", _loading_checkpoint)


def _loading_checkpoint(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    seam = seam_of(trainer)
    seam.loading_checkpoint = True
    try:
        return original(*args, **kwargs)
    finally:
        seam.loading_checkpoint = False


def after_first_step(seam: Seam, optimizer: torch.optim.Optimizer) -> None:
    """Settle ``seam`` after ``optimizer``'s first step.

    One hook per optimizer (under DeepSpeed the Trainer calls create_optimizer twice and gets the same one back).
    It stays registered and does nothing once settled: removing itself would mutate the optimizer's hook dict
    while torch iterates it ("OrderedDict mutated during iteration" as soon as any post-hook follows ours)."""
    hooked = seam.settle_hooked
    if hooked is not None and hooked() is optimizer:
        return

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not seam.logged and not seam.loading_checkpoint:
            settle(seam, opt)

    optimizer.register_step_post_hook(hook)
    seam.settle_hooked = weakref.ref(optimizer)


def settle(seam: Seam, optimizer: Any) -> None:
    trainer = seam.trainer()
    if trainer is None or seam.logged:
        return
    from . import installer

    for path in REGISTRY:
        installer(path).verdict(seam, trainer, optimizer)
    seam.logged = True
    line = ", ".join(f"{name}={value}" for name, value in seam.status.items())
    if seam.others:
        line += "; " + "; ".join(seam.others)
    if seam.notes:
        line += "; " + "; ".join(f"WARNING: {note}" for note in seam.notes)
    level = logging.WARNING if seam.fallbacks or seam.notes else logging.INFO
    logger.log(level, "fasttrain hot paths: %s", line)
