"""``fasttrain.patch()`` / ``fasttrain.unpatch()``: the hot paths for unmodified scripts and Trainer subclasses.

``patch()`` replaces a few methods of ``transformers.Trainer`` itself with the hooks of
``fasttrain.integration``, so every subclass (TRL's SFTTrainer, DPOTrainer, ...) inherits them, and installs
FusedAdamW in transformers' optimizer handler table for ``adamw_torch``/``adamw_torch_fused``. It is
idempotent (a second call only updates ``hot_paths``) and ``unpatch()`` puts back the very same objects.
``LOSS_MAPPING`` is never touched: the Trainer checks it by identity.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import transformers

from . import integration
from ._logging import logger
from .hot_paths import HotPaths

_lock = threading.Lock()
_saved: dict[str, Callable[..., Any]] = {}
_handlers_installed = False


def _wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        integration.attach(self)

    return __init__


def _hook(hook: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """A method that calls ``hook(bound original, self, ...)``."""

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return hook(original.__get__(self), self, *args, **kwargs)

    return method


def _replacements() -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    return {
        "__init__": _wrap_init,
        "_get_train_sampler": functools.partial(_hook, integration.train_sampler),
        "create_optimizer": functools.partial(_hook, integration.create_optimizer),
        "_clip_grad_norm": functools.partial(_hook, integration.clip_grad_norm),
        "_get_grad_norm": functools.partial(_hook, integration.grad_norm),
        "compute_loss": functools.partial(_hook, integration.compute_loss),
        "prediction_step": functools.partial(_hook, integration.prediction_step),
    }


def patch(hot_paths: HotPaths | None = None) -> None:
    """Switch the hot paths on for every ``transformers.Trainer`` (and subclass) created from now on.

    ``hot_paths`` selects paths (all on by default); ``FASTTRAIN_DISABLE`` still switches paths off.
    """
    global _handlers_installed
    with _lock:
        integration.patched_hot_paths = HotPaths.from_env(hot_paths)
        if _saved:
            return
        cls = transformers.Trainer
        for name, make in _replacements().items():
            original = cls.__dict__.get(name)
            if original is None:
                logger.warning("fasttrain.patch: transformers.Trainer has no %s; that hook is not installed", name)
                continue
            _saved[name] = original
            setattr(cls, name, make(original))
        from .optim.handler import install_optimizer_handlers

        _handlers_installed = bool(install_optimizer_handlers())


def unpatch() -> None:
    """Undo ``patch()``: ``transformers.Trainer`` gets back its original methods. Idempotent."""
    global _handlers_installed
    with _lock:
        cls = transformers.Trainer
        for name, original in _saved.items():
            setattr(cls, name, original)
        _saved.clear()
        if _handlers_installed:
            from .optim.handler import uninstall_optimizer_handlers

            uninstall_optimizer_handlers()
            _handlers_installed = False
        integration.patched_hot_paths = None


def is_patched() -> bool:
    return bool(_saved)
