"""DDP through Accelerate as it is: two processes on gloo (CPU), launched by torchrun and by accelerate.

Under group_by_length every example is trained on exactly once per epoch across the ranks, both ranks end
on identical weights, and the per-step losses and gradient norms are as close to the truth (the reference
Trainer's DDP run of the float64 twin) as the reference Trainer's own float32 DDP run is (``_truth``).

8-bit moments (``tests/_ddp_worker.py``): DDP's per-step loss and grad_norm follow one process running the same
8-bit optimizer on the same rows, as closely as the same pair with float32 moments does. Resume from the Trainer's
checkpoint (float32 and 8-bit moments): the steps after it train on the rows and log the values of the run that
never stopped.
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
    cmd = [
        *_torchrun(),
        str(tmp_path),
        "--trainer",
        "fasttrain",
        "--epochs",
        str(EPOCHS),
        "--rows",
        "47",
        "--max-tokens-per-batch",
        str(BUDGET),
    ]
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


# -- 8-bit moments and resume under DDP (tests/_ddp_worker.py) -----------------------------------------------------

DDP_WORKER = ROOT / "tests" / "_ddp_worker.py"
DDP_RUNS = [
    "fasttrain",
    "fasttrain-save",
    "fasttrain-resume",
    "fasttrain-8bit",
    "fasttrain-8bit-save",
    "fasttrain-8bit-resume",
]
SINGLE_RUNS = ["single", "single-8bit"]  # one process, 4 accumulation steps: the same 8 rows a step
SAVE_STEP = 3  # the worker's: X-save checkpoints at step 3 of 6, X-resume resumes from there
ROWS_PER_RANK_STEP = 4  # 2 rows x 2 accumulation steps
# the engines' bound (tests/test_deepspeed.py): a float32 run may be a few times farther from its truth than the
# reference is, and a logged value is a float32 accumulation, exact to a few units in its last place
K = 4.0
FLOOR = 16 * 2.0**-23


@pytest.fixture(scope="module")
def state_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every run of the worker: the DDP ones in one torchrun launch (both ranks), then the one-process ones."""
    out = tmp_path_factory.mktemp("ddp-state")
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the one-process runs too: the ranks' arithmetic, one thread
    launches = [
        ([*_torchrun()[:-1], str(DDP_WORKER)], DDP_RUNS, 2),
        ([sys.executable, str(DDP_WORKER)], SINGLE_RUNS, 1),
    ]
    runs = {}
    for launcher, names, ranks in launches:
        done = subprocess.run(
            [*launcher, str(out), "--runs", ",".join(names)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        for name in names:
            runs[name] = [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(ranks)]
            for r in runs[name]:
                assert "error" not in r, r.get("traceback", r.get("error"))
    return runs


def _step_rows(results: list[dict], per_step: int) -> list[list[int]]:
    """The rows each optimizer step trained on, over the ranks (each rank records its micro-batches in order)."""
    rows = [r["rows_by_epoch"]["0"] for r in results]
    steps = len(rows[0]) // per_step
    return [
        sorted(row for ranked in rows for row in ranked[k * per_step : (k + 1) * per_step])
        for k in range(steps)
    ]


def test_ddp_8bit_moments_follow_one_process(state_runs):
    """8-bit moments under DDP (each rank quantizes its full copy of the moments, from the all-reduced gradient)
    against their truth: the same 8-bit optimizer in one process on the same 8 rows a step. The two differ only by
    the order the gradient is summed in (two ranks all-reduced, or four micro-batches in one process), so they
    must be as close as the same pair of runs with float32 moments is (``|ddp - single|``, its largest over the
    steps), times K, plus the float32 floor of a logged value."""
    ddp8, single8 = state_runs["fasttrain-8bit"], state_runs["single-8bit"][0]
    ddp32, single32 = state_runs["fasttrain"][0], state_runs["single"][0]
    assert [r["world_size"] for r in ddp8] == [2, 2] and single8["world_size"] == 1
    assert ddp8[0]["distributed_type"] == "DistributedType.MULTI_CPU"
    for r in (*ddp8, single8):
        assert r["status"]["optimizer"] == "on"
        assert r["inner_optimizer"] == "fasttrain.optim.adamw.FusedAdamW"
        assert "exp_avg_codes" in r["inner_state_keys"], r["inner_state_keys"]
    # the truth trained on the same rows at every step
    assert _step_rows(ddp8, ROWS_PER_RANK_STEP) == _step_rows([single8], 2 * ROWS_PER_RANK_STEP)
    assert ddp8[0]["logs"] == ddp8[1]["logs"]  # the loss is averaged across the ranks before logging
    assert len(ddp8[0]["logs"]) == len(single8["logs"]) == len(ddp32["logs"]) == len(single32["logs"]) == 6
    off, apart = [], []
    for key in ("loss", "grad_norm"):
        summed_otherwise = max(
            abs(a[key] - b[key]) for a, b in zip(ddp32["logs"], single32["logs"], strict=True)
        )
        for step, (ours, truth, full) in enumerate(
            zip(ddp8[0]["logs"], single8["logs"], ddp32["logs"], strict=True), start=1
        ):
            limit = K * summed_otherwise + FLOOR * abs(truth[key])
            if not abs(ours[key] - truth[key]) <= limit:
                off.append(
                    f"step {step} {key}: DDP {ours[key]!r}, one process {truth[key]!r}, limit {limit:.3e}"
                )
            apart.append(abs(full[key] - truth[key]) / limit)
    assert not off, "\n".join(off)
    # the bound tells 8-bit moments from float32 ones: DDP with float32 moments would fail it
    assert max(apart) > 10, max(apart)


@pytest.mark.parametrize("run", ["fasttrain", "fasttrain-8bit"])
def test_ddp_resume_continues_as_the_uninterrupted_run(state_runs, run):
    """The Trainer's checkpoint at step 3 (weights, FusedAdamW's state, the 8-bit codes as codes, the sampler's
    place), resumed in the same launch: steps 4-6 train on the rows and log the loss and grad_norm of the run that
    never stopped, on both ranks."""
    uninterrupted, resumed = state_runs[run], state_runs[f"{run}-resume"]
    for full, ours in zip(uninterrupted, resumed, strict=True):
        assert ours["status"]["optimizer"] == "on"
        assert ("exp_avg_codes" in ours["inner_state_keys"]) == run.endswith("-8bit")
        assert ours["rows_by_epoch"]["0"] == full["rows_by_epoch"]["0"][SAVE_STEP * ROWS_PER_RANK_STEP :]
        after = [log for log in ours["logs"] if log["step"] > SAVE_STEP]
        expected = {log["step"]: log for log in full["logs"]}
        assert [log["step"] for log in after] == [s for s in expected if s > SAVE_STEP]
        for log in after:
            # the same arithmetic from the same state: only float32 noise of the logged value
            for key in ("loss", "grad_norm"):
                want = expected[log["step"]][key]
                assert abs(log[key] - want) <= FLOOR * abs(want), (log["step"], key, log[key], want)


# -- the optimizer step inside backward under DDP, through the Trainer (tests/_ddp_worker.py -inbw) -------------

INBW_RUNS = ["fasttrain-noclip", "fasttrain-inbw-save", "fasttrain-inbw-resume", "fasttrain-8bit-noclip",
             "fasttrain-8bit-inbw", "fasttrain-tied-noclip", "fasttrain-tied-dense-noclip",
             "fasttrain-tied-inbw"]  # fmt: skip


@pytest.fixture(scope="module")
def inbw_runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("ddp-inbw")
    done = subprocess.run(
        [*_torchrun()[:-1], str(DDP_WORKER), str(out), "--runs", ",".join(INBW_RUNS)],
        cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    runs = {}
    for name in INBW_RUNS:
        runs[name] = [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in range(2)]
        for r in runs[name]:
            assert "error" not in r, r.get("traceback", r.get("error"))
    return runs


@pytest.mark.parametrize("layout", ["", "-8bit"])
def test_ddp_step_in_backward_equals_ordinary_ddp(inbw_runs, layout):
    """optim_args step_in_backward=true under DDP (2 gloo ranks, 2 accumulation steps: the first micro-batch
    under no_sync, no hook): every bucket stepped on its averaged gradient inside backward leaves the weights
    of ordinary DDP with the same FusedAdamW, bit for bit, on both ranks, after 6 steps of an lr schedule; the
    same losses; the grad_norm the hooks summed equals the Trainer's own within a float32 rounding."""
    ours = inbw_runs[f"fasttrain{layout}-inbw" + ("-save" if not layout else "")]
    ref = inbw_runs[f"fasttrain{layout}-noclip"]
    for o, r in zip(ours, ref, strict=True):
        assert o["distributed_type"] == "DistributedType.MULTI_CPU" and o["world_size"] == 2
        assert o["status"]["optimizer"] == "on (stepping in backward)", o["status"]
        assert r["status"]["optimizer"] == "on", r["status"]
        assert ("exp_avg_codes" in o["inner_state_keys"]) == (layout == "-8bit")
        assert o["weights_sha256"] == r["weights_sha256"]
        assert [log["loss"] for log in o["logs"]] == [log["loss"] for log in r["logs"]]
        assert len(o["logs"]) == 6
        for a, b in zip(o["logs"], r["logs"], strict=True):
            assert abs(a["grad_norm"] - b["grad_norm"]) <= FLOOR * abs(b["grad_norm"]), (a, b)
    assert ours[0]["weights_sha256"] == ours[1]["weights_sha256"]


def test_ddp_step_in_backward_resumes_as_the_uninterrupted_run(inbw_runs):
    """Resumed from the step-3 checkpoint, the hooks (re-registered on the resumed optimizer) train steps 4-6 to
    the uninterrupted run's weights, bit for bit, logging its losses."""
    full, resumed = inbw_runs["fasttrain-inbw-save"], inbw_runs["fasttrain-inbw-resume"]
    for f, r in zip(full, resumed, strict=True):
        assert r["status"]["optimizer"] == "on (stepping in backward)", r["status"]
        assert r["weights_sha256"] == f["weights_sha256"]
        expected = {log["step"]: log["loss"] for log in f["logs"]}
        after = [log for log in r["logs"] if log["step"] > SAVE_STEP]
        assert [log["step"] for log in after] == [4, 5, 6]
        assert all(log["loss"] == expected[log["step"]] for log in after)


def test_ddp_tied_embedding_rows_into_the_heads_gradient_equal_the_dense_gradient(inbw_runs):
    """A tied lm_head under DDP: the embedding's gradient rows added into the head's gradient in place (the
    reducer averages the sum autograd hands it) leave the weights of the embedding's own dense gradient bit for
    bit, with an ordinary step and with the step inside backward."""
    dense = inbw_runs["fasttrain-tied-dense-noclip"]
    for name in ("fasttrain-tied-noclip", "fasttrain-tied-inbw"):
        for ours, ref in zip(inbw_runs[name], dense, strict=True):
            assert ours["tied_rows_forwards"] > 0 and ref["tied_rows_forwards"] == 0
            assert ours["weights_sha256"] == ref["weights_sha256"], name
            assert [log["loss"] for log in ours["logs"]] == [log["loss"] for log in ref["logs"]]
    assert (
        inbw_runs["fasttrain-noclip"][0]["weights_sha256"] != dense[0]["weights_sha256"]
    )  # tying changed them
