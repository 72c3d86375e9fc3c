"""One logger for the package, and "say it once" for fallbacks (a fallback is logged, never silent)."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("fasttrain")

_said: set[str] = set()
_lock = threading.Lock()


def log_once(key: str, message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    logger.log(level, message)
