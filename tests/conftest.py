"""Shared test setup.

Triton kernels run on CPU through the interpreter when there is no GPU; TRITON_INTERPRET must be set
before triton is first imported, so it is set here, at collection time, before any test module loads.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") is None and os.environ.get("FASTTRAIN_TEST_NO_INTERPRET") is None:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test starts from the same environment variables. transformers < 5 records a run's mixed precision
    in ACCELERATE_MIXED_PRECISION and never clears it, so a bf16 test would put every later Trainer under bf16
    autocast (an fp32 comparison would silently become a bf16 one)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
