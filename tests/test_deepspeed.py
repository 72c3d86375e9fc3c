"""DeepSpeed ZeRO-1/2/3 through ``transformers.Trainer`` on CPU (2 processes, gloo), with and without fasttrain.

One torchrun launch per ZeRO stage (tests/_deepspeed_worker.py) trains, in the same processes: the float64 truth,
the float32 reference, and the same script under ``fasttrain.patch()`` (plus, at some stages, variants: a DeepSpeed
``optimizer`` section, 8-bit moments, stochastic rounding, save and resume, a tied lm_head, DeepSpeed's bf16 mode).
Checked:

- per-step loss and grad_norm: ``|ours - truth| <= K * |reference - truth| + floor`` against the float64 run;
- every example trained on exactly once per epoch across the two ranks;
- ``fasttrain_status`` against detectors: FusedAdamW is the optimizer ZeRO stepped (its state exists), the fused
  loss never called ``lm_head`` (the reference did), DeepSpeed's clip is the only clip (FusedAdamW applied none);
- 8-bit moments (ZeRO-1/2/3): per-step loss and grad_norm within a tenth of how far training moved them of the
  float64 truth;
- resume from the Trainer's checkpoint (ZeRO-1/2/3; ZeRO-1 also with 8-bit moments): the steps after it log what
  the run that never stopped logged.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# long multi-process runs: not in the default run (`slow`); .ci/scale runs them
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_deepspeed_worker.py"
ROWS = 32  # 2 ranks x 2 rows x 2 accumulation steps = 8 rows a step: 4 whole steps an epoch
EPOCHS = 2
LAUNCH_RUNS = {
    1: [
        "truth",
        "reference",
        "fasttrain",
        "fasttrain-8bit",
        "fasttrain-save",
        "fasttrain-resume",
        "fasttrain-8bit-save",
        "fasttrain-8bit-resume",
    ],
    2: [
        "truth",
        "reference",
        "fasttrain",
        "fasttrain-ds-optimizer",
        "fasttrain-8bit",
        "fasttrain-stochastic-rounding",
        "fasttrain-save",
        "fasttrain-resume",
        "reference-bf16",
        "fasttrain-bf16",
    ],
    3: [
        "truth",
        "reference",
        "fasttrain",
        "fasttrain-ds-optimizer",
        "fasttrain-8bit",
        "fasttrain-save",
        "fasttrain-resume",
        "truth-tied",
        "reference-tied",
        "fasttrain-tied",
    ],
}
SAVE_STEP = 4  # the worker's: X-save checkpoints at step 4, X-resume resumes from there
# fasttrain's float32 run may be a few times farther from the float64 truth than the float32 reference is:
# both round differently (another summation order in the fused loss), neither is exact
K = 4.0
# the Trainer accumulates the logged loss in a float32 tensor, the truth's too: a few float32 units in the last
# place of the value are rounding noise in every run (2**-23 relative per unit)
FLOOR_ULPS = 16
FP32_EPS = 2.0**-23
# DeepSpeed's bf16 mode rounds weights and activations to bf16 (8 significant bits: 2**-9 relative per
# rounding); the logged loss and norm average many such roundings, so 1/8 of one rounding of the value is noise
BF16_FLOOR = 2.0**-12
# run -> (its float64 truth, its reference, the floor relative to the value)
BASELINES = {
    "fasttrain": ("truth", "reference", FLOOR_ULPS * FP32_EPS),
    "fasttrain-ds-optimizer": ("truth", "reference", FLOOR_ULPS * FP32_EPS),
    "fasttrain-tied": ("truth-tied", "reference-tied", FLOOR_ULPS * FP32_EPS),
    "fasttrain-bf16": ("truth", "reference-bf16", BF16_FLOOR),
}
DEEPSPEED_CLIPS = "off: DeepSpeed clips inside its engine"


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch(out: Path, stage: int, runs: list[str]) -> dict[str, list[dict]]:
    """Run the worker once for ``runs``; returns each run's results of both ranks."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        _free_port(),
        str(WORKER),
        str(out),
        "--stage",
        str(stage),
        "--runs",
        ",".join(runs),
        "--epochs",
        str(EPOCHS),
        "--rows",
        str(ROWS),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return {run: [json.loads((out / f"{run}-rank{r}.json").read_text()) for r in range(2)] for run in runs}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """stage -> its runs, each stage launched once (on first use) for every test of the module."""
    cache: dict[int, dict[str, list[dict]]] = {}

    def runs(stage: int) -> dict[str, list[dict]]:
        if stage not in cache:
            cache[stage] = launch(tmp_path_factory.mktemp(f"zero{stage}"), stage, LAUNCH_RUNS[stage])
        return cache[stage]

    return runs


def _cases(*names: str) -> list:
    return [
        pytest.param(stage, run, id=f"zero{stage}-{run}")
        for stage, runs in LAUNCH_RUNS.items()
        for run in runs
        if run in names
    ]


STAGES = [pytest.param(stage, id=f"zero{stage}") for stage in LAUNCH_RUNS]


def _trained(results: list[dict]) -> list[dict]:
    for r in results:
        assert "error" not in r, r.get("traceback", r.get("error"))
    return results


def _within_truth(name: str, ours: float, ref: float, truth: float, floor: float) -> str | None:
    bound = K * abs(ref - truth) + floor * abs(truth)
    if abs(ours - truth) <= bound:
        return None
    return f"{name}: |ours - truth| = {abs(ours - truth):.3e} > {bound:.3e} (|ref - truth| = {abs(ref - truth):.3e})"


@pytest.mark.parametrize("stage", STAGES)
def test_runs_are_zero_on_two_ranks(launched, stage):
    runs = launched(stage)
    for name in ("truth", "reference", "fasttrain"):
        # ZeRO-3 refuses float64: _deepspeed_worker.truth_stage
        expected_stage = min(stage, 2) if name == "truth" else stage
        for r in _trained(runs[name]):
            assert (r["world_size"], r["distributed_type"], r["zero_stage"]) == (
                2,
                "DistributedType.DEEPSPEED",
                expected_stage,
            )
    assert {r["weights_dtype"] for r in runs["truth"]} == {"torch.float64"}
    # every run of the launch started from the same weights (a model built under a leftover zero.Init would not)
    for tied in (False, True):
        checksums = {
            r["initial_checksum"] for results in runs.values() for r in results if r.get("tied") is tied
        }
        assert len(checksums) <= 1, checksums
    assert all(
        r["tied"] == name.endswith("-tied") for name, results in runs.items() for r in results if "tied" in r
    )
    assert {r["weights_dtype"] for r in runs["fasttrain"]} == {"torch.float32"}
    for name in (n for n in runs if n.endswith("-bf16")):  # DeepSpeed's bf16 mode put the weights in bf16
        assert {r["weights_dtype"] for r in _trained(runs[name])} == {"torch.bfloat16"}


@pytest.mark.parametrize(("stage", "run"), _cases("reference", "fasttrain", "fasttrain-ds-optimizer"))
def test_every_example_once_per_epoch(launched, stage, run):
    results = _trained(launched(stage)[run])
    for epoch in range(EPOCHS):
        seen = sorted(row for r in results for row in r["rows_by_epoch"][str(epoch)])
        assert seen == list(range(ROWS)), f"epoch {epoch}: rows seen {seen}"


@pytest.mark.parametrize(("stage", "run"), _cases(*BASELINES))
def test_loss_and_grad_norm_as_close_to_float64_as_the_reference(launched, stage, run):
    runs = launched(stage)
    truth_run, ref_run, floor = BASELINES[run]
    truth, ref, ours = (_trained(runs[name])[0]["logs"] for name in (truth_run, ref_run, run))
    assert len(ours) == len(ref) == len(truth) == EPOCHS * ROWS // 8
    off = []
    for step, (t, r, o) in enumerate(zip(truth, ref, ours, strict=True), start=1):
        for key in ("loss", "grad_norm"):
            problem = _within_truth(f"step {step} {key}", o[key], r[key], t[key], floor)
            if problem:
                off.append(problem)
    assert not off, "\n".join(off)
    # both ranks log the same values (the loss is averaged across ranks before logging)
    assert runs[run][0]["logs"] == runs[run][1]["logs"]


@pytest.mark.parametrize(("stage", "run"), _cases("fasttrain", "fasttrain-tied", "fasttrain-bf16"))
def test_status_tells_the_truth(launched, stage, run):
    runs = launched(stage)
    ref, ours = _trained(runs[run.replace("fasttrain", "reference")])[0], _trained(runs[run])[0]
    # the hot paths this test is about (the status line also reports others, e.g. packing, tested elsewhere)
    assert {path: ours["status"][path] for path in ("optimizer", "clip", "loss", "collator", "sampler")} == {
        "optimizer": "on",
        "clip": DEEPSPEED_CLIPS,
        "loss": "on",
        "collator": "on",
        "sampler": "on",
    }
    # optimizer "on": ZeRO stepped FusedAdamW (its state exists, on DeepSpeed's flat partitions)
    assert ours["inner_optimizer"] == "fasttrain.optim.adamw.FusedAdamW"
    assert ours["inner_optimizer_states"] > 0
    # clip off: DeepSpeed clipped; FusedAdamW applied no clip of its own (never twice)
    assert ours["deferred_clips_applied"] == 0
    # loss "on": the fused path never called lm_head, where the reference called it every micro-batch
    assert ours["lm_head_calls"] == 0 < ref["lm_head_calls"]
    if stage == 3:  # lm_head (or the embedding it is tied to) was partitioned: the fused loss gathered it
        assert ours["lm_head_numel_after_training"] == 0


@pytest.mark.parametrize(("stage", "run"), _cases("fasttrain-ds-optimizer"))
def test_deepspeed_optimizer_section_is_reported(launched, stage, run):
    run = _trained(launched(stage)[run])[0]
    assert (
        run["status"]["optimizer"] == "off: DeepSpeed's config chose the optimizer (its `optimizer` section)"
    )
    assert run["inner_optimizer"] == "torch.optim.adamw.AdamW"
    # the status settled at the first step of DeepSpeed's optimizer: nothing is left undecided
    assert run["status"]["loss"] == "on" and run["lm_head_calls"] == 0
    assert run["status"]["clip"] == DEEPSPEED_CLIPS


# 8-bit moments change each update by their quantization error: at worst half a gap of the dynamic maps' top
# decade, ~7% of the update (test_optim's `share`), ~1% typically. The run may leave its float64 truth by a tenth
# of how far training moved each logged value, never diverge. (Updates scaled by 1.4 fail this; an error within
# the format's worst case is test_optim's to catch, tensor by tensor.)
EIGHT_BIT_SHARE = 0.1


@pytest.mark.parametrize(("stage", "run"), _cases("fasttrain-8bit"))
def test_8bit_state_on_zero_partitions(launched, stage, run):
    runs = launched(stage)
    run, truth = _trained(runs[run])[0], _trained(runs["truth"])[0]
    assert run["status"]["optimizer"] == "on"
    assert "exp_avg_codes" in run["inner_state_keys"], run["inner_state_keys"]
    assert len(run["logs"]) == len(truth["logs"]) == EPOCHS * ROWS // 8
    off = []
    for key in ("loss", "grad_norm"):
        moved = max(abs(log[key] - truth["logs"][0][key]) for log in truth["logs"])
        for step, (t, o) in enumerate(zip(truth["logs"], run["logs"], strict=True), start=1):
            if not (math.isfinite(o[key]) and abs(o[key] - t[key]) <= EIGHT_BIT_SHARE * moved):
                off.append(
                    f"step {step} {key}: 8-bit {o[key]!r}, float64 {t[key]!r}, training moved it {moved:.3e}"
                )
    assert not off, "\n".join(off)
    assert runs["fasttrain-8bit"][0]["logs"] == runs["fasttrain-8bit"][1]["logs"]


@pytest.mark.parametrize(("stage", "run"), _cases("fasttrain-stochastic-rounding"))
def test_stochastic_rounding_is_refused_under_zero(launched, stage, run):
    for r in launched(stage)[run]:
        assert "bf16_stochastic_rounding=true has no effect under DeepSpeed ZeRO" in r.get("error", ""), r


@pytest.mark.parametrize(("stage", "run"), _cases("fasttrain-resume", "fasttrain-8bit-resume"))
def test_resume_continues_as_the_uninterrupted_run(launched, stage, run):
    runs = launched(stage)
    # the same run that never stopped (nor saved): fasttrain-8bit-resume against fasttrain-8bit
    uninterrupted = {log["step"]: log for log in _trained(runs[run.removesuffix("-resume")])[0]["logs"]}
    resumed = [log for log in _trained(runs[run])[0]["logs"] if log["step"] > SAVE_STEP]
    assert [log["step"] for log in resumed] == [s for s in uninterrupted if s > SAVE_STEP]
    for log in resumed:
        # DeepSpeed's checkpoint holds the fp32 partitions and FusedAdamW's state exactly: the same arithmetic
        # follows, so only float32 rounding noise of the logged value is allowed
        for key in ("loss", "grad_norm"):
            expected = uninterrupted[log["step"]][key]
            assert abs(log[key] - expected) <= FLOOR_ULPS * FP32_EPS * abs(expected), (log["step"], key)
    assert _trained(runs[run])[0]["status"]["optimizer"] == "on"
    if "-8bit" in run:  # the 8-bit codes came back from DeepSpeed's checkpoint as codes
        assert "exp_avg_codes" in _trained(runs[run])[0]["inner_state_keys"]
