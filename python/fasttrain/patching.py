"""``fasttrain.patch()`` / ``fasttrain.unpatch()``: the hot paths for unmodified scripts and Trainer subclasses.

``patch()`` wraps ``transformers.Trainer.__init__`` so that every Trainer (TRL's SFTTrainer, DPOTrainer, ...)
built from then on goes through ``fasttrain.integration.apply`` once its ``__init__`` has run. Nothing else
is replaced: no optimizer registry, no ``LOSS_MAPPING`` (the Trainer checks it by identity). A second
``patch()`` only changes the hot paths; ``unpatch()`` puts back the very same ``__init__`` and takes fasttrain's
forward off the models of the trainers built while patched (``integration.detach_patched``), so their models answer every
call with their own forward again, even mid-training.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import transformers

from . import integration
from .hot_paths import HotPaths

_lock = threading.Lock()
_original_init: Any = None
_hot_paths: HotPaths | None = None


def _patched_init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        from .trainer import Trainer

        if not isinstance(self, Trainer):  # fasttrain.Trainer applies the seam itself, with its own hot_paths
            integration.apply(self, _hot_paths, patched=True)

    return __init__


def patch(hot_paths: HotPaths | None = None) -> None:
    """Switch the hot paths on for every ``transformers.Trainer`` (and subclass) created from now on.

    ``hot_paths`` selects paths (all on by default); ``FASTTRAIN_DISABLE`` still switches paths off.
    """
    global _original_init, _hot_paths
    with _lock:
        _hot_paths = hot_paths
        if _original_init is None:
            _original_init = transformers.Trainer.__dict__["__init__"]
            transformers.Trainer.__init__ = _patched_init(_original_init)


def unpatch() -> None:
    """Undo ``patch()``: ``transformers.Trainer`` gets back its own ``__init__``, and the models of trainers built
    while patched get back their own forward. Idempotent."""
    global _original_init, _hot_paths
    with _lock:
        if _original_init is not None:
            transformers.Trainer.__init__ = _original_init
        _original_init, _hot_paths = None, None
    integration.detach_patched("fasttrain.unpatch() was called")
