"""Everything fasttrain does to a ``transformers.Trainer``, and nothing else of fasttrain touches one.

``apply(trainer, hot_paths)`` runs once, right after the Trainer's own ``__init__`` (``fasttrain.Trainer`` and the
``__init__`` that ``fasttrain.patch()`` wraps both call it). One module per hot path's contact with the Trainer:

- ``collator``: ``trainer.data_collator`` becomes the Rust equivalent of a transformers or TRL collator;
- ``packing`` (policy in ``packing_policy``): the training loader's batches packed into padding-free rows;
- ``sampler``: the Rust length-grouped sampler (private ``_get_train_sampler``, signature-checked);
- ``optimizer``: ``FusedAdamW`` through ``create_optimizer`` and ``optimizer_cls_and_kwargs``, DeepSpeed's client;
- ``in_backward``: with ``optim_args="step_in_backward=true"``, that FusedAdamW steps inside backward;
- ``clip``: the norm in one pass, the clip applied inside the next step (private ``_clip_grad_norm``);
- ``loss`` / ``loss_trl``: the fused loss in the model's forward, or TRL's fused LM head served by our kernel;
- ``budget``: token-budget batches (``fasttrain.Trainer(max_tokens_per_batch=...)``; a batching choice, not a hot
  path);
- ``tiling``: the decoder MLPs tiled over the tokens (opt-in, ``FASTTRAIN_TILED_MLP``; not a hot path: it costs time);

(the hot paths' installers are listed once, in ``fasttrain.hot_paths.REGISTRY``, which ``apply`` and ``settle`` read)

and ``trainer_api`` (the instance-override helper, the private-hook check, the questions several paths ask),
``ledger`` (the status of each path) and ``settle`` (the status line after the first optimizer step).

Overrides are instance attributes, installed only where their path may run; they call the class's method as it is
at call time (a method patched or mocked on the class after construction is still called) and hold the trainer
weakly. The Trainer's callbacks, arguments, logs and checkpoints are not touched.
"""

from __future__ import annotations

import importlib
import weakref
from types import ModuleType
from typing import Any

from .._logging import follow_trainer_log_level, log_once, show_status_line
from ..hot_paths import REGISTRY, HotPath, HotPaths
from . import budget, loss, settle, tiling
from .ledger import Seam, attach, find_seam, seam_of
from .trainer_api import deepspeed_config, launched_alone_problem

__all__ = ["Seam", "apply", "apply_from_plugin", "detach_patched", "seam_of"]


_patched: weakref.WeakSet[Any] = weakref.WeakSet()  # live trainers fasttrain.patch() applied the seam to


def apply(
    trainer: Any,
    hot_paths: HotPaths | None = None,
    *,
    max_tokens_per_batch: int | None = None,
    patched: bool = False,
) -> None:
    """Switch fasttrain's hot paths on for ``trainer`` (once, right after ``Trainer.__init__``). ``patched``: by
    ``fasttrain.patch()``, whose ``unpatch()`` takes them off again (``detach_patched``)."""
    if patched:
        _patched.add(trainer)
    seam = attach(trainer, HotPaths.from_env(hot_paths))
    trainer.hot_paths = seam.paths
    trainer.fasttrain_status = seam.status
    follow_trainer_log_level(trainer.args.get_process_log_level())
    seam.deepspeed = deepspeed_config(trainer)
    alone = launched_alone_problem(trainer)
    if alone is not None:
        seam.notes.append(alone)
        log_once(f"launched-alone:{alone}", f"fasttrain: {alone}")
    if max_tokens_per_batch is not None:
        budget.arm(trainer, max_tokens_per_batch)
    settle.arm(trainer)
    for path in REGISTRY:
        if path.always_armed or getattr(seam.paths, path.name):
            installer(path).arm(trainer, seam)
    tiling.arm(trainer, seam)  # opt-in (FASTTRAIN_TILED_MLP), not a hot path: see integration/tiling.py


def installer(path: HotPath) -> ModuleType:
    """The module of this package that arms ``path`` and settles its status."""
    return importlib.import_module(f"{__name__}.{path.installer}")


def apply_from_plugin(trainer: Any, hot_paths: HotPaths) -> None:
    """A framework's plugin hands over the trainer it built (``fasttrain.integrations``): the seam, unless
    ``patch()`` (``FASTTRAIN_PATCH=1``) already applied it in that trainer's ``__init__``; and the status line
    shown at INFO, which the framework's logging might otherwise hide."""
    if find_seam(trainer) is None:
        apply(trainer, hot_paths)
    if trainer.args.process_index == 0:  # one line per run, not one per rank
        show_status_line()


def detach_patched(reason: str) -> None:
    """Take off what fasttrain put on the models of every live trainer ``patch()`` reached (the fused forward, TRL
    heads served by fasttrain) and keep it off: ``fasttrain.unpatch()``. The optimizer a run already built stays:
    it is the trainer's own from then on."""
    trainers = list(_patched)
    _patched.clear()
    for trainer in trainers:
        seam = find_seam(trainer)
        if seam is not None and seam.paths.loss:
            loss.detach(trainer, seam, reason)
