"""benchmarks/gpu/run.sh: its options, its time budget, and that every step runs under its cap and is recorded
whatever the others do. No GPU and no real step: a stand-in Python records how it was called and fails or
"times out" (exits 124, as ``timeout`` does) where told to."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "gpu" / "run.sh"
KERNELS = ["tests", "adamw", "loss", "loss-trl", "loss-speculation"]
TRAINING = ["gpu-e2e", "gpu-packing", "gpu-sft", "gpu-dpo", "gpu-grpo"]
GPU_STEPS = ["install", "provenance", *KERNELS, *TRAINING, "gpu-frontier"]
# Stands in for Python: logs its parent (timeout's command line) and its arguments; the provenance step is real
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$(ps -ww -o args= -p $PPID) :: $*" >> "$FAKE_LOG"
case "$*" in
    *provenance.record*) exec "$REAL_PYTHON" "$@" ;;
    *bench_adamw.py*) exit 3 ;;
    *trl_sft,trl_dpo*) exit 124 ;;
esac
"""


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(RUN), *args], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )


def budget(*args: str) -> tuple[dict[str, int], dict[str, int], int]:
    """Each step's cap plus grace, each half's printed total, and the exit status (1: a half is over 570 s)."""
    proc = run("--budget", *args)
    caps = {
        name: int(cap) + int(grace)
        for name, _, cap, grace in re.findall(
            r"^(\S+)\s+(\S+)\s+(\d+) s \+ (\d+) s grace$", proc.stdout, re.M
        )
    }
    halves = {half: int(total) for half, total in re.findall(r"^half (\w+)\s+(\d+) s", proc.stdout, re.M)}
    return caps, halves, proc.returncode  # fmt: skip


def test_gpu_caps_plus_kill_grace_fit_ten_minutes_per_half():
    caps, halves, status = budget()
    assert list(caps) == GPU_STEPS and status == 0  # every step of the GPU run has a cap and is counted
    shared = caps["install"] + caps["provenance"]
    assert halves == {"kernels": shared + sum(caps[name] for name in KERNELS),
                      "training": shared + sum(caps[name] for name in TRAINING),
                      "frontier": shared + caps["gpu-frontier"]}  # fmt: skip
    assert (
        max(halves.values()) <= 570 < sum(caps.values())
    )  # each half fits one 10-minute call, the whole does not
    caps, halves, _ = budget("--part", "training")
    assert list(caps) == ["install", "provenance", *TRAINING] and list(halves) == ["training"]
    # the smoke run adds the sm_90 compile step and is not held to the GPU's budget
    caps, halves, status = budget("--smoke")
    assert (
        list(caps) == [*GPU_STEPS[:3], "compile", *GPU_STEPS[3:]] and halves["kernels"] > 570 and status == 0
    )


def test_an_unknown_option_or_a_missing_value_stops_at_once(tmp_path):
    for args in (["--only", "tests"], ["--out"], ["--part", "tests"]):
        proc = run(*args)
        assert proc.returncode == 2 and "run.sh:" in proc.stderr, (args, proc.stderr)


def _fake_run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    fake, log, out = tmp_path / "python", tmp_path / "calls.log", tmp_path / "out"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    proc = run("--out", str(out), "--wheels", str(tmp_path / "no-wheels"), *args,
               PYTHON=str(fake), FAKE_LOG=str(log), REAL_PYTHON=sys.executable)  # fmt: skip
    return proc, out, log.read_text().splitlines()


def test_a_failed_or_timed_out_step_is_recorded_and_the_rest_run(tmp_path):
    proc, out, calls = _fake_run(tmp_path, "--archive", str(tmp_path / "gpu.tar.gz"))
    assert proc.returncode == 1, proc.stderr  # some steps failed
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    status = {name: state for name, state, _, _ in rows}
    assert [row[0] for row in rows] == GPU_STEPS[1:]  # no wheels: nothing to install
    assert status["adamw"] == "FAILED (exit 3)" and status["loss-trl"] == "TIMEOUT after 45 s"
    assert all(state == "ok" for name, state in status.items() if name not in ("adamw", "loss-trl")), status
    caps, _, _ = budget()
    for name in GPU_STEPS[2:]:  # each step's command ran under timeout with its own cap
        parents = [line.split(" :: ")[0] for line in calls if _step_of(line) == name]
        assert parents and all(p.startswith(f"timeout -k 5 {caps[name] - 5} ") for p in parents), (
            name,
            parents,
        )
    assert "--preset gpu-grpo --no-progress --json" in "\n".join(calls)
    assert f"--preset cuda-frontier --no-progress --json {out}/gpu-frontier.json" in "\n".join(calls)
    assert "-m cuda" in "\n".join(calls) and "--collect-only" not in "\n".join(calls)
    tests_call = next(line for line in calls if _step_of(line) == "tests")  # each test logged as it finishes
    assert f"env FASTTRAIN_TEST_LOG={out}/tests.tsv " in tests_call, tests_call
    # the printed table, and the provenance the real step wrote
    assert re.search(r"^adamw\s+FAILED \(exit 3\)\s+\d+\s+60$", proc.stdout, re.M), proc.stdout
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["command"].startswith("bash benchmarks/gpu/run.sh --out ") and "commit" in provenance
    with tarfile.open(tmp_path / "gpu.tar.gz") as archive:  # packed after the last step
        assert "out/steps.tsv" in archive.getnames()


def _step_of(call: str) -> str | None:
    """The step a stand-in call belongs to, from its arguments."""
    marks = {"-m pytest": "tests", "bench_adamw.py": "adamw", "trl_sft,trl_dpo": "loss-trl",
             "--name loss_speculation": "loss-speculation", "bench_loss.py": "loss"}  # fmt: skip
    preset = re.search(r"--preset (\S+)", call)
    if preset:  # the frontier step runs `fasttrain bench --frontier`'s own CUDA preset
        return {"cuda-frontier": "gpu-frontier"}.get(preset.group(1), preset.group(1))
    return next((step for mark, step in marks.items() if mark in call.split(" :: ")[-1]), None)


def test_smoke_collects_the_tests_and_compiles_for_sm90(tmp_path):
    _, out, calls = _fake_run(tmp_path, "--smoke")
    steps = [line.split("\t")[0] for line in (out / "steps.tsv").read_text().splitlines()]
    assert sorted(steps) == sorted([*GPU_STEPS[1:], "compile"])  # the two lanes interleave
    joined = "\n".join(calls)
    assert (
        "--collect-only -m cuda tests/" in joined and "tests/_compile_kernels_sm90.py --each-value" in joined
    )
    assert "--preset gpu-e2e --smoke" in joined and "--device cuda" not in joined


def test_the_halves_run_their_own_steps_into_one_table(tmp_path):
    """--part kernels, training, then frontier into the same DIR: each runs its own steps, the table keeps all."""
    seen = 0
    for part, own in (("kernels", KERNELS), ("training", TRAINING), ("frontier", ["gpu-frontier"])):
        _, out, calls = _fake_run(tmp_path, "--part", part)
        assert {_step_of(line) for line in calls[seen:]} - {None} == set(own), (part, calls[seen:])  # alone
        seen = len(calls)
    steps = [line.split("\t")[0] for line in (out / "steps.tsv").read_text().splitlines()]
    assert [name for name in steps if name != "provenance"] == [*KERNELS, *TRAINING, "gpu-frontier"], steps


def test_the_commit_reaches_a_copy_without_git(tmp_path):
    """The GPU machine gets the tree without .git: prepare.sh writes .whl/COMMIT, run.sh exports it to every
    step, and provenance names it where git cannot."""
    wheels, fake, log = tmp_path / "wheels", tmp_path / "python", tmp_path / "seen.log"
    wheels.mkdir()
    (wheels / "COMMIT").write_text("0123abc+dirty\n")
    fake.write_text('#!/usr/bin/env bash\necho "commit=$FASTTRAIN_COMMIT" >> "$FAKE_LOG"\n')
    fake.chmod(0o755)
    run("--out", str(tmp_path / "out"), "--wheels", str(wheels), "--part", "training", PYTHON=str(fake),
        FAKE_LOG=str(log))  # fmt: skip
    seen = log.read_text().splitlines()
    assert len(seen) >= len(TRAINING) and set(seen) == {"commit=0123abc+dirty"}, seen
    from fasttrain.bench import provenance

    os.environ["FASTTRAIN_COMMIT"] = "0123abc+dirty"  # conftest restores the environment after the test
    assert provenance.git_commit() not in (None, "0123abc+dirty")  # a checkout: git's answer wins
    assert provenance.git_commit(tmp_path) == "0123abc+dirty"  # no checkout there


def test_each_test_is_logged_as_it_finishes_with_its_error(tmp_path):
    """tests/conftest.py with FASTTRAIN_TEST_LOG: one line per test from the xdist controller alone, a failure's
    assertion included, written before the session ends (a run killed by its cap keeps them)."""
    (tmp_path / "test_two.py").write_text(
        "def test_ok():\n    pass\n\n\ndef test_bad():\n    assert 1 == 2, 'boom'\n"
    )
    log = tmp_path / "tests.tsv"
    # this test may itself run in an xdist worker: its variables would make the inner controller look like one
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(FASTTRAIN_TEST_LOG=str(log), PYTHONPATH=str(ROOT / "tests"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-n", "2",
                           "--rootdir", str(tmp_path), str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1, proc.stdout
    rows = sorted(line.split("\t") for line in log.read_text().splitlines())
    assert [(row[0], row[1], row[3].split("::")[-1]) for row in rows] == [
        ("failed", "call", "test_bad"),
        ("passed", "call", "test_ok"),
    ]
    assert "AssertionError: boom" in rows[0][4] and rows[1][4] == ""
