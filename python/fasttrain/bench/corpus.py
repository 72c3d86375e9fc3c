"""The built-in offline corpus (docs/method.md, "Data"): each ``.py`` file of the Python standard library is one
document, in a fixed pseudo-random order so that a prefix of the corpus mixes packages and file sizes.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import random
import re
import sysconfig
from collections.abc import Iterator

# Third-party code can sit under the stdlib directory; it differs between machines, so it is left out.
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_ORDER_SEED = 0
# A top-level block starts at a column-0 decorator, def, async def or class; decorators stay with their def.
_BLOCK_START = re.compile(r"^(?=(?:@|def |async def |class ))", re.MULTILINE)
_DEFINITION = re.compile(r"^(?:def|async def|class) ", re.MULTILINE)


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Every stdlib ``.py`` file, in a deterministic shuffled order (sorted, then shuffled with a fixed seed)."""
    root = root or stdlib_root()
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]  # prune: never walk into site-packages
        files.extend(pathlib.Path(directory, name) for name in names if name.endswith(".py"))
    files.sort()
    if not files:
        raise FileNotFoundError(f"no Python source files found under the standard library directory {root}")
    random.Random(_ORDER_SEED).shuffle(files)
    return files


def iter_documents(root: pathlib.Path | None = None, min_chars: int = 64) -> Iterator[str]:
    """The text of each stdlib file, skipping near-empty ones (``__init__.py`` stubs) and undecodable ones."""
    texts = map(_read, stdlib_files(root))
    yield from (text for text in texts if text is not None and len(text) >= min_chars)


def leading_files(max_bytes: int, root: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Files from the start of the corpus order until ``max_bytes`` bytes are covered (sizes from ``stat``)."""
    files = stdlib_files(root)
    totals = itertools.accumulate(path.stat().st_size for path in files)
    return files[: next((i + 1 for i, total in enumerate(totals) if total >= max_bytes), len(files))]


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def read_texts(paths: list[pathlib.Path]) -> list[str]:
    return [text for text in map(_read, paths) if text is not None]


def top_level_blocks(text: str) -> list[str]:
    """``text`` cut before each top-level definition: the module header, then one piece per function or class."""
    blocks: list[str] = []
    decorators = ""
    for piece in _BLOCK_START.split(text):
        if piece.startswith("@") and not _DEFINITION.search(piece):
            decorators += piece  # a decorator line: it belongs to the definition that follows
            continue
        blocks.append(decorators + piece)
        decorators = ""
    if decorators:
        blocks.append(decorators)
    return [block for block in blocks if block.strip()]
