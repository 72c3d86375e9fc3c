"""``FASTTRAIN_PATCH=1``: fasttrain on for a program you do not edit (``llamafactory-cli train``, ``axolotl train``,
``accelerate launch script.py``, ``torchrun ...``).

fasttrain's wheel puts ``fasttrain-autopatch.pth`` at the root of site-packages. Python runs its one line at every
interpreter start; with ``FASTTRAIN_PATCH`` set (and not ``0``) it imports this module, which does almost nothing
yet: it waits for ``transformers.trainer`` to be imported and calls ``fasttrain.patch()`` right after, so a process
that never builds a Trainer (the launcher itself, a data worker, pip) never imports torch for fasttrain. Launchers
pass the environment on, so every rank of ``torchrun`` or ``accelerate launch`` is patched too.
``FASTTRAIN_DISABLE`` still switches single paths off.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

_TRIGGER = "transformers.trainer"


class _PatchAfterTrainerImport(importlib.abc.MetaPathFinder):
    """Finds ``transformers.trainer`` as the path finder does, and runs ``fasttrain.patch()`` once it has loaded."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _TRIGGER:
            return None
        sys.meta_path.remove(self)  # once, and out of the way of the real lookup
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenPatch(spec.loader)
        return spec


class _ThenPatch(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _patch()

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... as the real loader has them
        return getattr(self._loader, name)


def _patch() -> None:
    try:
        from .patching import patch

        patch()
    except Exception as err:  # never break the user's program over fasttrain
        print(f"fasttrain: FASTTRAIN_PATCH is set but fasttrain.patch() failed: {err!r}", file=sys.stderr)


def install() -> None:
    """Patch at once if transformers' Trainer is already imported, else right after it is."""
    if _TRIGGER in sys.modules:
        _patch()
    elif not any(isinstance(finder, _PatchAfterTrainerImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterTrainerImport())


install()
