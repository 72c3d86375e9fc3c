"""The kernel benchmarks' timer (bench_adamw_gpu.py, bench_loss_gpu.py): one call of a function, timed.

On a GPU, CUDA events around the call: the GPU time of the work it queues, not the host's launch time. On
CPU (``--smoke``), ``time.perf_counter``. The scripts run as ``python benchmarks/gpu/SCRIPT.py`` (run.sh, CI's
smoke run), so this folder is first on ``sys.path`` and ``import timing`` finds this file, as ``import roofline``
finds its neighbour.
"""

from __future__ import annotations

import time

_SCALE = {"s": 1.0, "ms": 1e3}


class Timer:
    """``Timer(device, unit)(fn)``: run ``fn()`` once and return how long it took, in ``unit`` ("s" or "ms")."""

    def __init__(self, device, unit: str = "s"):
        if unit not in _SCALE:
            raise ValueError(f"unit must be one of {sorted(_SCALE)}, not {unit!r}")
        self.cuda = device.type == "cuda"
        self.scale = _SCALE[unit]

    def __call__(self, fn) -> float:
        if self.cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 * self.scale  # elapsed_time is in milliseconds
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * self.scale
