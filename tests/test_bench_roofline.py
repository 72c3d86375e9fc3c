"""fasttrain.bench.roofline: the rates it measures and the % of the roofline a kernel's time reaches."""

from __future__ import annotations

import pytest

from fasttrain.bench import roofline

LIMITS = {"matmul_flops_per_s": 1000.0, "copy_bytes_per_s": 100.0}


def test_the_slower_of_flops_and_bytes_binds():
    # 2 s to move the bytes, 1 s for the FLOPs: memory-bound, and 4 s measured is half the roofline
    assert roofline.kernel_percent(4.0, LIMITS, flops=1000.0, moved=200.0) == pytest.approx(50.0)
    # 3 s of FLOPs, 1 s of bytes: compute-bound
    assert roofline.kernel_percent(6.0, LIMITS, flops=3000.0, moved=100.0) == pytest.approx(50.0)
    assert roofline.kernel_percent(None, LIMITS, flops=1.0) is None
    assert roofline.kernel_percent(0.0, LIMITS, moved=1.0) is None


def test_the_copy_rate_counts_bytes_read_and_written(monkeypatch):
    """A copy of n fp32 values reads and writes 8 n bytes: with every call timed at 1 ms the rate is 8 n / 1e-3."""
    monkeypatch.setattr(roofline, "timed", lambda fn, device: (fn(), 1e-3)[1])
    measured = roofline.measure_copy_rate("cpu", seconds=0.0)
    assert measured["copy_bytes_per_s"] == pytest.approx(8 * roofline._CPU_COPY / 1e-3)
    assert measured["copy_measured"] == f"{4 * roofline._CPU_COPY >> 20} MiB copy, median of 3"


def test_the_median_of_at_least_three_timed_calls_after_an_untimed_one(monkeypatch):
    calls = []
    times = iter([5.0, 1.0, 2.0, 100.0])
    monkeypatch.setattr(roofline, "timed", lambda fn, device: next(times))
    median, count = roofline._median_s(lambda: calls.append(1), "cpu", seconds=0.0)
    assert calls == [1]  # the warm-up call, untimed
    assert (median, count) == (2.0, 3)  # 5.0, 1.0, 2.0 timed (no time left for a fourth): their median


def test_measured_limits_are_those_of_this_machine():
    limits = roofline.measure_limits("cpu")
    # a CPU core does at least a GFLOP/s in a GEMM and copies at least a GB/s; no CPU reaches 100 TFLOP/s
    assert 1e9 < limits["matmul_flops_per_s"] < 1e14 and 1e9 < limits["copy_bytes_per_s"] < 1e13, limits
    assert limits["measured"].startswith("fp32 2048x2048x2048 GEMM") and "MiB copy" in limits["copy_measured"]
