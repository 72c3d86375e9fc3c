"""benchmarks/gpu/run.sh: the time budget of the one GPU call, and --only / --skip (no GPU needed: nothing runs
a benchmark here). The GPU is lent for 15 minutes of device time, start-up included: the caps plus each step's
kill grace must stay under 8 minutes so that a rerun of the failed steps still fits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "gpu" / "run.sh"
GPU_STEPS = [
    "install", "environment", "hardware", "kernels", "parity", "adamw", "loss", "loss-trl", "e2e", "trl-sft",
    "trl-dpo", "summary",
]  # fmt: skip


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(RUN), *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )


def listed(stdout: str) -> tuple[list[str], int]:
    steps = re.findall(r"^(\S+)\s+\d+ s \+ \d+ s grace$", stdout, re.M)
    total = int(re.search(r"^total\s+(\d+) s", stdout, re.M).group(1))
    return steps, total


def test_gpu_caps_plus_kill_grace_fit_in_8_minutes():
    proc = run("--budget")
    assert proc.returncode == 0, proc.stderr
    steps, total = listed(proc.stdout)
    assert steps == GPU_STEPS  # every step of the GPU run has a cap and is counted
    caps = [int(c) + int(g) for c, g in re.findall(r"(\d+) s \+ (\d+) s grace", proc.stdout)]
    assert total == sum(caps) <= 480


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
        "kernels\tok\t80\t85\nparity\tTIMEOUT after 35s\t40\t35\nsummary\tok\t0\t5\n"
    )
    proc = run(
        "--out", str(out), "--wheels", str(tmp_path / "none"), "--only", "summary", PYTHON=sys.executable
    )
    assert proc.returncode == 0, proc.stderr
    lines = (out / "steps.tsv").read_text().splitlines()
    assert lines[:2] == ["kernels\tok\t80\t85", "parity\tTIMEOUT after 35s\t40\t35"]
    assert [line.split("\t")[0] for line in lines] == ["kernels", "parity", "summary"]
    assert "| parity | TIMEOUT after 35s |" in (out / "summary.md").read_text()
