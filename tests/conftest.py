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


def _cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            return "avx512_bf16" in handle.read()
    except OSError:
        return False


# torch's CPU flash attention in bf16 may ask oneDNN whether to pack its operands (yes on a CPU with AVX512-BF16)
# and then call pack_vnni2, which exists only in the AVX-512 build of its kernels: under ATEN_CPU_CAPABILITY=default
# (.ci/isa) it raises "pack_vnni2 is only supported when avx512 is supported", for the reference Trainer as for
# fasttrain. That stage exists for the rounding of the non-vector kernels, so there a call that raises this is
# run again on torch's math kernel; every other call, and every other stage and machine, keeps the flash kernel.
if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default" and _cpu_has_avx512_bf16():
    import torch.nn.functional as functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _flash_or_any = functional.scaled_dot_product_attention

    def _math_where_pack_vnni2_raises(*args, **kwargs):
        try:
            return _flash_or_any(*args, **kwargs)
        except RuntimeError as err:
            if "pack_vnni2" not in str(err):
                raise
        with sdpa_kernel(SDPBackend.MATH):
            return _flash_or_any(*args, **kwargs)

    functional.scaled_dot_product_attention = _math_where_pack_vnni2_raises


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test starts from the same environment variables. transformers < 5 records a run's mixed precision
    in ACCELERATE_MIXED_PRECISION and never clears it, so a bf16 test would put every later Trainer under bf16
    autocast (an fp32 comparison would silently become a bf16 one)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_runtest_logreport(report):
    """With FASTTRAIN_TEST_LOG=FILE, each test's outcome, seconds and (where it failed) its error are appended to
    FILE the moment it finishes, so a run stopped by a time cap (the GPU kit's) still says what failed and why.
    Under xdist the controller receives every worker's reports: it alone writes."""
    path = os.environ.get("FASTTRAIN_TEST_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or (report.when != "call" and not report.failed):
        return
    error = ""
    if report.failed:
        text = report.longreprtext
        error = " | ".join(text.splitlines()[-12:])[-1500:]  # the assertion and the lines leading to it
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"{report.outcome}\t{report.when}\t{report.duration:.2f}\t{report.nodeid}\t{error}\n")
