"""DDP through Accelerate as it is: two processes on gloo (CPU), launched by torchrun and by accelerate.

Under group_by_length every example is trained on exactly once per epoch across the ranks, both ranks end
on identical weights, and the per-step losses and gradient norms are as close to the truth (the reference
Trainer's DDP run of the float64 twin) as the reference Trainer's own float32 DDP run is (``_truth``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import _tiny as tiny
import _truth

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_train_script.py"
ROWS = 48  # a multiple of world size x per-device batch: no padding of the last batch across ranks
EPOCHS = 2


def _launch(launcher: list[str], out: Path, trainer: str, *extra: str) -> list[dict]:
    """``launcher`` ends with the training script's path."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        *launcher,
        str(out),
        "--trainer",
        trainer,
        "--group-by-length",
        "--epochs",
        str(EPOCHS),
        "--rows",
        str(ROWS),
        *extra,
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(2)]


def _free_port() -> str:
    # a fixed port collides with any other run on the machine (EADDRINUSE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _torchrun() -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        _free_port(),
        str(SCRIPT),
    ]


def _check(results: list[dict], reference: tuple[list[dict], list[dict]] | None) -> None:
    """``reference``: the reference Trainer's results in float32 and for the float64 twin."""
    assert [r["world_size"] for r in results] == [2, 2]
    assert results[0]["distributed_type"] == "DistributedType.MULTI_CPU"
    for epoch in range(EPOCHS):
        seen = [row for r in results for row in r["rows_by_epoch"][str(epoch)]]
        assert sorted(seen) == list(range(ROWS)), f"epoch {epoch}: rows seen {sorted(seen)}"
    assert results[0]["weights"] == results[1]["weights"], "ranks ended on different weights"
    # every path that shapes or computes the step ran under DDP (packing is decided per batch by its cost)
    for path in ("optimizer", "clip", "loss", "collator", "sampler"):
        assert results[0]["status"][path] == "on", (path, results[0]["status"])
    if reference is not None:
        ref, truth = reference
        _truth.assert_logs_near_truth(
            results[0]["logs"],
            ref[0]["logs"],
            truth[0]["logs"],
            _truth.FP32_STEP,
            keys=("loss", "grad_norm"),
            abs_floor={"loss": tiny.LOGGED_LOSS_ABS},
        )


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    ref = _launch(_torchrun(), tmp_path_factory.mktemp("ref"), "reference")
    truth = _launch(_torchrun(), tmp_path_factory.mktemp("f64"), "reference", "--float64")
    return ref, truth


def test_ddp_torchrun(tmp_path, reference_run):
    _check(_launch(_torchrun(), tmp_path, "fasttrain"), reference_run)


def test_ddp_accelerate_launch(tmp_path, reference_run):
    accelerate = shutil.which("accelerate") or str(Path(sys.executable).with_name("accelerate"))
    # `accelerate launch --cpu` starts several CPU processes only through mpirun; --multi_gpu uses
    # torch.distributed.run, and the script's use_cpu=True makes each process a gloo CPU rank.
    launcher = [
        accelerate,
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        _free_port(),
        str(SCRIPT),
    ]
    _check(_launch(launcher, tmp_path, "fasttrain"), reference_run)


BUDGET = 96  # tokens per rank per batch: 2-5 of the dataset's examples (6-40 tokens each)


def test_ddp_token_budget_batches(tmp_path):
    """fasttrain.Trainer(max_tokens_per_batch=N) on two real gloo ranks: every example once per epoch across the
    ranks, each batch within the budget, the same number of steps on both ranks (else DDP would hang or drop
    work), identical weights at the end, and the batches packed where packing pays."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [*_torchrun(), str(tmp_path), "--trainer", "fasttrain", "--epochs", str(EPOCHS), "--rows", "47",
           "--max-tokens-per-batch", str(BUDGET)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = [json.loads((tmp_path / f"result-rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(EPOCHS):
        seen = [row for r in results for row in r["rows_by_epoch"][str(epoch)]]
        assert sorted(seen) == list(range(47)), f"epoch {epoch}: rows seen {sorted(seen)}"
    assert len(results[0]["batch_tokens"]) == len(results[1]["batch_tokens"]) > 0
    for r in results:
        assert max(r["batch_tokens"]) <= BUDGET, r["batch_tokens"]
        assert len(r["logs"]) == len(results[0]["logs"])
    assert results[0]["weights"] == results[1]["weights"], "ranks ended on different weights"
    assert results[0]["status"]["packing"] == "on", results[0]["status"]
