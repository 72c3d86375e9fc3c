"""After the first optimizer step every path has had its chance to run: read each path's evidence, write the status
line once (INFO, or WARNING when a path the user wanted fell back or the run itself deserves a warning)."""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any

import torch

from .._logging import logger
from .ledger import Seam


def after_first_step(seam: Seam, optimizer: torch.optim.Optimizer) -> None:
    """Settle ``seam`` after ``optimizer``'s first step.

    One hook per optimizer (under DeepSpeed the Trainer calls create_optimizer twice and gets the same one back).
    It stays registered and does nothing once settled: removing itself would mutate the optimizer's hook dict
    while torch iterates it ("OrderedDict mutated during iteration" as soon as any post-hook follows ours)."""
    hooked = seam.settle_hooked
    if hooked is not None and hooked() is optimizer:
        return

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not seam.logged and not _initialising_state_for_load():
            settle(seam, opt)

    optimizer.register_step_post_hook(hook)
    seam.settle_hooked = weakref.ref(optimizer)


def _initialising_state_for_load() -> bool:
    """Inside torch's ``_init_optim_state``: loading a sharded optimizer checkpoint (FSDP2 resume, through
    ``set_optimizer_state_dict``) first steps the optimizer once with zero gradients and lr 0 to create its state.
    That step is no training step: settling there would declare the clip and loss off before they could run."""
    frame = sys._getframe(1)
    for _ in range(8):  # the hook is called a few frames below the optimizer's step
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code.co_name == "_init_optim_state" and "checkpoint" in frame.f_code.co_filename:
            return True
    return False


def settle(seam: Seam, optimizer: Any) -> None:
    trainer = seam.trainer()
    if trainer is None or seam.logged:
        return
    from . import clip, collator, loss, packing, sampler
    from . import optimizer as optimizer_path

    for path in (optimizer_path, clip, loss, collator, sampler, packing):
        path.verdict(seam, trainer, optimizer)
    seam.logged = True
    line = ", ".join(f"{name}={value}" for name, value in seam.status.items())
    if seam.others:
        line += "; " + "; ".join(seam.others)
    if seam.notes:
        line += "; " + "; ".join(f"WARNING: {note}" for note in seam.notes)
    level = logging.WARNING if seam.fallbacks or seam.notes else logging.INFO
    logger.log(level, "fasttrain hot paths: %s", line)
