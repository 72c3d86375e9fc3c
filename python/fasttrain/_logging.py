"""One logger for the package, "say it once" for fallbacks (a fallback is logged, never silent), and the level
the Trainer asks for.

fasttrain's messages go to the ``fasttrain`` logger. An application that configures logging (a handler on that
logger or on the root) decides where they go and at which level. Otherwise they are shown as transformers shows
the Trainer's own messages: on stderr, at the level the Trainer uses for this process
(``TrainingArguments.log_level`` / ``log_level_replica``, through :func:`follow_trainer_log_level`), not propagated
to the root logger (as transformers' ``transformers`` logger).
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("fasttrain")

_said: set[str] = set()
_lock = threading.Lock()
_own_handler: logging.Handler | None = None


def log_once(key: str, message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    logger.log(level, message)


def follow_trainer_log_level(level: int) -> None:
    """Show fasttrain's messages at ``level`` (a Trainer's ``args.get_process_log_level()``), unless the application
    configured logging itself."""
    global _own_handler
    with _lock:
        if _own_handler is None:
            if logger.handlers or logging.getLogger().handlers:
                return
            _own_handler = logging.StreamHandler()  # stderr, like transformers' own handler
            logger.addHandler(_own_handler)
            logger.propagate = False
        elif _own_handler not in logger.handlers:
            return  # the application took the logger over since
        logger.setLevel(level)


def show_status_line() -> None:
    """fasttrain's status line (INFO) shown whatever level the Trainer runs at: a framework's plugin asks for it,
    as the line is the user's only view of what ran. A level the application set on the logger stays."""
    ours = _own_handler is not None and _own_handler in logger.handlers  # the level follows the Trainer's
    if logger.level == logging.NOTSET or (ours and logger.level > logging.INFO):
        logger.setLevel(logging.INFO)
