"""Shared test setup.

Triton kernels run on CPU through the interpreter when there is no GPU; TRITON_INTERPRET must be set
before triton is first imported, so it is set here, at collection time, before any test module loads.
"""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") is None and os.environ.get("FASTTRAIN_TEST_NO_INTERPRET") is None:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
