"""How far a measurement is from what the hardware allows: this machine's matmul and copy rates, measured.

A training step's limit: ``percent_of_limit`` (docs/method.md, "The matmul limit"). A kernel's limit
(``kernel_percent``) is the slower of doing its FLOPs at the GEMM rate and moving its bytes at the rate a large
copy reads and writes them: an optimizer step is bound by bytes, a fused LM head by FLOPs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from .provenance import timed

# GEMM sizes: large enough to reach the GEMM's plateau, small enough to measure in about a second
_CPU_SIZE, _CUDA_SIZE = 2048, 8192
# Copy sizes: far beyond the caches (64 MiB on CPU; 1 GiB on a GPU, whose L2 holds tens of MiB)
_CPU_COPY, _CUDA_COPY = 2**24, 2**28


def _median_s(fn, device: str, seconds: float) -> tuple[float, int]:
    """The median time of ``fn`` over at least 3 calls and about ``seconds``, after one untimed call."""
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        times.append(timed(fn, device))
    return statistics.median(times), len(times)


def measure_matmul_rate(device: str, threads: int | None = None, seconds: float = 1.0) -> dict[str, Any]:
    """The median FLOP/s of square GEMMs on ``device`` (fp32 on CPU, bf16 on CUDA), with ``threads`` CPU threads."""
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        cuda = device == "cuda"
        n = _CUDA_SIZE if cuda else _CPU_SIZE
        kind, dtype = ("bf16", torch.bfloat16) if cuda else ("fp32", torch.float32)
        a, b, out = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(3))
        median, count = _median_s(lambda: torch.mm(a, b, out=out), device, seconds)
    finally:
        torch.set_num_threads(previous)
    what = f"{kind} {n}x{n}x{n} GEMM, {threads or previous} thread(s), median of {count}"
    return {"matmul_flops_per_s": 2.0 * n**3 / median, "measured": what}


def measure_copy_rate(device: str, seconds: float = 1.0) -> dict[str, Any]:
    """Bytes read + written per second by a large fp32 copy on ``device`` (the bandwidth an elementwise kernel
    can reach)."""
    import torch

    n = _CUDA_COPY if device == "cuda" else _CPU_COPY
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    median, count = _median_s(lambda: dst.copy_(src), device, seconds)
    return {
        "copy_bytes_per_s": 2 * 4 * n / median,
        "copy_measured": f"{4 * n >> 20} MiB copy, median of {count}",
    }


def measure_limits(device: str) -> dict[str, Any]:
    """Both rates of ``device``: what ``kernel_percent`` divides by."""
    return {**measure_matmul_rate(device), **measure_copy_rate(device)}


def kernel_percent(seconds: float | None, limits: dict[str, Any], flops: float = 0.0, moved: float = 0.0):
    """100 x the least time the hardware allows (``flops`` at the matmul rate or ``moved`` bytes at the copy
    rate, whichever takes longer) over the measured ``seconds``; None without a time."""
    if not seconds:
        return None
    least = max(flops / limits["matmul_flops_per_s"], moved / limits["copy_bytes_per_s"])
    return 100.0 * least / seconds


def percent_of_limit(summary: dict[str, Any], rate: float | None) -> float | None:
    """tokens/s x model FLOPs per token, as a % of the measured GEMM rate (None where a figure is missing)."""
    flops, tokens_per_s = summary.get("train_flops_per_token"), summary.get("tokens_per_s")
    if not rate or not flops or not tokens_per_s:
        return None
    return 100.0 * flops * tokens_per_s / rate
