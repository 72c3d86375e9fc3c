"""How far a training step is from its matmul limit: the model's FLOPs at this machine's measured GEMM rate.

The limit of a step is the time its matmuls would take alone at the rate a large GEMM reaches on this machine,
with the bench's threads (fp32 on CPU, bf16 on CUDA): ``train_flops_per_token`` (6 x parameters + causal
attention, from the shapes) x tokens / rate. A contender at 100% would spend its whole step in GEMMs at full speed;
the rest is what the step spends elsewhere (elementwise work, the optimizer, the kernel, Python).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

# GEMM sizes: large enough to reach the GEMM's plateau, small enough to measure in about a second
_CPU_SIZE, _CUDA_SIZE = 2048, 8192


def measure_matmul_rate(device: str, threads: int | None = None, seconds: float = 1.0) -> dict[str, Any]:
    """The median FLOP/s of square GEMMs on ``device`` (fp32 on CPU, bf16 on CUDA), with ``threads`` CPU threads."""
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        cuda = device == "cuda"
        n = _CUDA_SIZE if cuda else _CPU_SIZE
        dtype = torch.bfloat16 if cuda else torch.float32
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        times: list[float] = []
        deadline = time.perf_counter() + seconds
        while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rate = 2.0 * n**3 / statistics.median(times[1:])
    finally:
        torch.set_num_threads(previous)
    what = f"{'bf16' if cuda else 'fp32'} {n}x{n}x{n} GEMM, {threads or previous} thread(s), median of {len(times) - 1}"
    return {"matmul_flops_per_s": rate, "measured": what}


def percent_of_limit(summary: dict[str, Any], rate: float | None) -> float | None:
    """tokens/s x model FLOPs per token, as a % of the measured GEMM rate (None where a figure is missing)."""
    flops, tokens_per_s = summary.get("train_flops_per_token"), summary.get("tokens_per_s")
    if not rate or not flops or not tokens_per_s:
        return None
    return 100.0 * flops * tokens_per_s / rate
