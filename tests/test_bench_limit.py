"""fasttrain bench's matmul limit: the step's model FLOPs over this machine's measured GEMM rate."""

from __future__ import annotations

import pytest

from _bench_helpers import CONFIG
from _bench_helpers import run_result as _run
from fasttrain.bench import report, roofline, summary


def test_the_gemm_rate_is_measured_on_this_cpu():
    measured = roofline.measure_matmul_rate("cpu", threads=1, seconds=0.2)
    assert measured["matmul_flops_per_s"] > 1e8  # any CPU of this century does a fp32 GEMM above 0.1 GFLOP/s
    assert "fp32 2048x2048x2048 GEMM, 1 thread(s)" in measured["measured"]


def test_percent_of_limit_is_model_flops_at_the_measured_rate():
    side = {"train_flops_per_token": 6e8, "tokens_per_s": 50.0}
    assert roofline.percent_of_limit(side, 1e11) == pytest.approx(30.0)  # 3e10 FLOP/s of 1e11
    assert roofline.percent_of_limit({"tokens_per_s": 50.0}, 1e11) is None  # a TRL run: FLOPs unknown
    assert roofline.percent_of_limit(side, None) is None


def test_the_report_shows_each_contenders_share_of_the_limit():
    ref, ours = (
        _run("reference", "reference", 100.0, 500.0, [2.0, 1.9]),
        _run("fasttrain", "fasttrain", 150.0, 300.0, [2.0, 1.9]),
    )
    data = summary.build({"reference": [ref], "fasttrain": [ours]})
    data["matmul_limit"] = {"matmul_flops_per_s": 1e11, "measured": "fp32 2048x2048x2048 GEMM, 2 thread(s)"}
    data["reference"]["percent_of_matmul_limit"], data["fasttrain"]["percent_of_matmul_limit"] = 40.0, 60.0
    _, rows = report.rows(data)
    row = next(r for r in rows if r[0].startswith("step at % of its matmul limit"))
    assert row[1:] == ["40", "60"]
    assert any("100.0 GFLOP/s" in line for line in report.describe(CONFIG, data))
