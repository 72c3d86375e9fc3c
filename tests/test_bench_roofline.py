"""benchmarks/gpu/roofline.py: the bytes and FLOPs each kernel must move, the limits and the % of them reached."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "roofline.py"
_spec = importlib.util.spec_from_file_location("roofline", _PATH)
roofline = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("roofline", roofline)
_spec.loader.exec_module(roofline)

LIMITS = roofline.Limits(copy_bytes_per_s=100.0, matmul_flops_per_s=1000.0, source="test")


def test_adamw_moves_param_grad_and_both_moments():
    # fp32: read p, g, m, v and write p, m, v = 7 x 4 bytes; the 8 state bytes are both moments
    assert roofline.adamw_cost(10, 4, 4, 8, clip=False).bytes == 10 * 28
    # bf16 params and grads, fp32 moments; clipping reads the gradient once more
    assert roofline.adamw_cost(10, 2, 2, 8, clip=True).bytes == 10 * (2 * 2 + 2 + 2 * 8 + 2)
    assert roofline.adamw_cost(10, 4, 4, 8, clip=True).flops == 0


def test_linear_loss_counts_the_three_matmuls_and_never_the_logits():
    n, h, v = 3, 5, 7
    forward = roofline.linear_loss_cost(n, h, v, dtype_bytes=2, backward=False)
    assert forward.flops == 2 * n * h * v
    assert forward.bytes == (n * h + v * h) * 2 + n * 8 + n * 4
    both = roofline.linear_loss_cost(n, h, v, dtype_bytes=2)
    assert both.flops == 6 * n * h * v
    assert both.bytes == forward.bytes + (n * h + v * h) * 2


def test_percent_of_limit_takes_the_binding_limit():
    memory = roofline.Cost(bytes=200.0, flops=1000.0)  # 2 s of bytes, 1 s of FLOPs
    assert roofline.bound_s(memory, LIMITS) == 2.0
    assert roofline.percent_of_limit(4.0, memory, LIMITS) == 50.0
    entry = roofline.roofline_entry(4.0, memory, LIMITS)
    assert entry["bound"] == "memory" and entry["limit_ms"] == 2000.0 and entry["percent_of_limit"] == 50.0
    compute = roofline.Cost(bytes=100.0, flops=3000.0)
    assert roofline.roofline_entry(6.0, compute, LIMITS)["bound"] == "compute"
    assert roofline.percent_of_limit(6.0, compute, LIMITS) == 50.0
    assert roofline.percent_of_limit(None, compute, LIMITS) is None
    assert roofline.fmt_percent(None) == "n/a" and roofline.fmt_percent(49.6) == "50%"
    assert roofline.fmt_percent(0.0123) == "0.012%"


def test_smoke_measures_the_cpu_and_writes_what_it_used(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["roofline.py", "--smoke", "--out", str(tmp_path)])
    assert roofline.main() == 0
    record = json.loads((tmp_path / "hardware_smoke.json").read_text())
    assert record["device_type"] == "cpu"
    limits = record["limits"]
    assert limits["copy_bytes_per_s"] > 0 and limits["matmul_flops_per_s"] > 0
    assert limits["source"].startswith("measured on cpu")
    # the benchmarks read what the run measured instead of measuring again
    monkeypatch.setattr(roofline, "measure", lambda *a: pytest.fail("measured again"))
    assert roofline.load(tmp_path, "cpu", smoke=True) == roofline.Limits(**limits)


def test_gpu_falls_back_to_the_quoted_figures_and_says_so(tmp_path, monkeypatch):
    def fail(device, smoke):
        raise RuntimeError("no device")

    monkeypatch.setattr(roofline, "measure", fail)
    limits = roofline.load(tmp_path, "cuda", smoke=False)
    assert limits.copy_bytes_per_s == roofline.QUOTED_H200["copy_bytes_per_s"]
    assert limits.matmul_flops_per_s == roofline.QUOTED_H200["matmul_flops_per_s"]
    assert "quoted" in limits.source and "no device" in limits.source
    with pytest.raises(RuntimeError):  # on CPU there is nothing to fall back on
        roofline.load(tmp_path, "cpu", smoke=True)
