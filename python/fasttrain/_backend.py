"""The one place that decides which backend a kernel runs on: Triton or PyTorch.

Both ``FusedAdamW`` and ``fused_linear_cross_entropy`` take ``backend="auto" | "triton" | "torch"``:

- ``"auto"``: Triton for CUDA tensors when triton imports, PyTorch otherwise (the Triton kernels only run on
  CPU through the interpreter, which is for tests, not speed);
- ``"triton"``: the Triton kernel; on a non-CUDA tensor only when the interpreter is on (``TRITON_INTERPRET=1``
  set before triton is first imported), else a ValueError that says what to do;
- ``"torch"``: the PyTorch implementation.
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "triton", "torch")


def triton_interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET`` set, not ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_backend(backend: object, where: str) -> str:
    """``backend`` if it is one of BACKENDS, else a ValueError naming ``where`` it was given."""
    if backend not in BACKENDS:
        raise ValueError(f"{where}: backend must be one of {BACKENDS}, got {backend!r}")
    return str(backend)


def resolve_backend(backend: str, device: torch.device, where: str) -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device`` (see the module docstring)."""
    check_backend(backend, where)
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_importable() else "torch"
    if backend == "triton":
        if not triton_importable():
            raise ValueError(
                f"{where}: backend='triton' needs the triton package, which does not import here"
            )
        if device.type != "cuda" and not triton_interpreting():
            raise ValueError(
                f"{where}: backend='triton' on a {device.type} tensor needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before triton is first imported (or use backend='auto' or 'torch')"
            )
    return backend
