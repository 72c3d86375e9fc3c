"""Handing glibc's freed heap pages back to the system after a CPU optimizer step.

The torch (CPU) step works in batches of ``STAGE_ELEMENTS`` (``_torch_step``): fp32 and int64 working tensors of
8 to 32 MB, allocated and freed per batch. glibc serves such sizes from its heap once its dynamic mmap threshold
has risen to them (it does after the first freed chunk of that size), and freed heap pages stay resident while
longer-lived tensors (new optimizer states, gradients) are placed between them: measured on the Qwen3-0.6B shape
(bf16 weights, 8-bit moments, the step in backward), the run's peak resident memory was 4.59 GiB, 3.79 GiB with
glibc's threshold pinned at 1 MB. ``malloc_trim(0)`` returns every free whole page of the heap (not only its top)
without changing how anything is allocated; a no-op where the C library has no ``malloc_trim``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_heap() -> None:
    """Return the heap's free pages to the system (glibc), else nothing."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
