"""benchmarks/gpu/run.sh: its time budget, and --only / --skip (no GPU needed: nothing runs a benchmark here).
The run is designed to take under 10 minutes on one H200: the step caps plus each step's kill grace must stay
within the 570 s limit that `run.sh --budget` enforces."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "gpu" / "run.sh"
GPU_STEPS = [
    "install", "environment", "hardware", "kernels", "parity", "adamw", "loss", "loss-trl", "loss-speculation", "e2e",
    "packing", "trl-sft", "trl-dpo", "grpo", "summary",
]  # fmt: skip


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(RUN), *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def listed(stdout: str) -> tuple[list[str], int]:
    steps = re.findall(r"^(\S+)\s+\d+ s \+ \d+ s grace$", stdout, re.M)
    total = int(re.search(r"^total\s+(\d+) s", stdout, re.M).group(1))
    return steps, total


def test_gpu_caps_plus_kill_grace_fit_the_run_budget():
    proc = run("--budget")
    assert proc.returncode == 0, proc.stderr
    steps, total = listed(proc.stdout)
    assert steps == GPU_STEPS  # every step of the GPU run has a cap and is counted
    caps = [int(c) + int(g) for c, g in re.findall(r"(\d+) s \+ (\d+) s grace", proc.stdout)]
    assert total == sum(caps) <= 570


def test_only_and_skip_select_steps():
    steps, _ = listed(run("--budget", "--only", "kernels,parity").stdout)
    assert steps == ["install", "kernels", "parity", "summary"]  # install and summary always run
    steps, _ = listed(run("--budget", "--skip=e2e,trl-sft,install").stdout)
    assert steps == [s for s in GPU_STEPS if s not in ("e2e", "trl-sft", "install")]
    # compile (every kernel for sm_90 with this Python's Triton) is a CPU-only step
    steps, _ = listed(run("--smoke", "--budget", "--only", "compile").stdout)
    assert steps == ["install", "compile", "summary"]


def test_unknown_step_fails_at_once_naming_the_valid_ones(tmp_path):
    for args in (["--only", "kernels,kernals"], ["--skip", "compile"], ["--skip", ""], ["--only"]):
        proc = run("--out", str(tmp_path / "out"), *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "valid steps: " + ",".join(GPU_STEPS) in proc.stderr, proc.stderr
        assert not (tmp_path / "out").exists()  # nothing ran
    assert "unknown step 'kernals'" in run("--only", "kernels,kernals").stderr


def test_a_rerun_keeps_the_lines_of_the_steps_it_does_not_run(tmp_path):
    out = tmp_path / "gpu"
    out.mkdir()
    (out / "steps.tsv").write_text(
        "install\tok\t3\t10\nkernels\tok\t80\t85\nparity\tTIMEOUT after 35s\t40\t35\nsummary\tok\t0\t5\n"
    )
    proc = run(
        "--out", str(out), "--wheels", str(tmp_path / "none"), "--only", "summary", PYTHON=sys.executable
    )
    assert proc.returncode == 0, proc.stderr
    lines = (out / "steps.tsv").read_text().splitlines()
    # no wheels this time: install did not run, and its earlier line stays
    assert lines[:3] == ["install\tok\t3\t10", "kernels\tok\t80\t85", "parity\tTIMEOUT after 35s\t40\t35"]
    assert [line.split("\t")[0] for line in lines] == ["install", "kernels", "parity", "summary"]
    assert "| parity | TIMEOUT after 35s |" in (out / "summary.md").read_text()


def test_summary_shows_the_roofline_and_a_crashed_contender(tmp_path):
    """The table printed last (the end of run.sh's output) shows the kernels' % of the roofline, which limits
    were used, and a contender that crashed or a bench cut short."""
    (tmp_path / "steps.tsv").write_text(
        "hardware\tok\t3\t10\nadamw\tok\t30\t45\nloss\tok\t20\t40\ne2e\tTIMEOUT after 80s\t85\t80\n"
    )
    limits = {
        "copy_bytes_per_s": 4.8e12,
        "matmul_flops_per_s": 9.89e14,
        "source": "quoted NVIDIA H200 SXM datasheet peaks, not measured (x)",
    }
    (tmp_path / "hardware.json").write_text(json.dumps({"limits": limits}))
    lim = {"percent_of_limit": 61.6}
    (tmp_path / "adamw_gpu.json").write_text(json.dumps({
        "results": [{
            "model": "gpt2-124M", "dtype": "float32", "reference_ms": {"ref_step": 1.0, "ref_clip_step": 1.5},
            "reference_roofline": {"step": lim, "clip_step": {"percent_of_limit": 40.0}},
            "variants": [{"variant": "default (triton)", "median_ms": {"step": 0.8, "clip_step": 0.9},
                          "roofline": {"step": lim, "clip_step": {"percent_of_limit": 80.4}}}],
        }],
        "default_backend_decision": {"verdict": "triton"},
    }))  # fmt: skip
    (tmp_path / "loss_gpu.json").write_text(json.dumps({
        "results": [{"case": "cross_entropy", "tokens": 8192, "vocab": 151936, "impls": {
            "torch": {"time_ms": 40.0, "roofline": {"percent_of_limit": 22.0}},
            "fasttrain": {"time_ms": 20.0, "roofline": {"percent_of_limit": 44.0}},
            "liger": {"error": "RuntimeError: x"},
        }}],
    }))  # fmt: skip
    (tmp_path / "bench_e2e_gpu.json").write_text(json.dumps({
        "complete": False, "runs_done": 5, "runs_planned": 6,
        "comparison": {"fasttrain_vs_reference": {"tokens_per_s_ratio": 1.5, "peak_memory_ratio": 0.5}},
        "reference": {"tokens_per_s": 1e4, "train_flops_per_token": 7.9e9},
        "fasttrain": {"tokens_per_s": 1.5e4, "train_flops_per_token": 7.9e9},
        "failed": {"liger": "the liger run exited with code 1; last lines of its log:\nImportError: no sm_90"},
    }))  # fmt: skip
    summarize = ROOT / "benchmarks" / "gpu" / "summarize.py"
    proc = subprocess.run([sys.executable, str(summarize), str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "summary.md").read_text()
    assert "| hardware | ok | 3 / 10 | copy 4,800 GB/s, matmul 989 TFLOP/s: quoted NVIDIA H200 SXM" in text
    assert "torch 1.50 ms (40% lim), triton 0.90 ms (80% lim); backend verdict triton" in text
    assert "cross_entropy 8192x151936: torch 40.0 ms (22%), fasttrain 20.0 ms (44%)" in text
    assert "PARTIAL (5 of 6 runs)" in text and "liger FAILED: ImportError: no sm_90" in text
    # 1e4 tokens/s x 7.9e9 FLOPs = 8% of 989 TFLOP/s
    assert "model FLOPs reference 8%, fasttrain 12% of the matmul limit" in text
