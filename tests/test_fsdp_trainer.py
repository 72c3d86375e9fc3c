"""FSDP2 through ``transformers.Trainer`` on CPU (gloo), with and without fasttrain.

FSDP through the Trainer does not start without an accelerator (tests/_fsdp_trainer_worker.py says where, and
``test_fsdp_needs_the_harness_on_cpu`` checks it still holds); the worker's harness relabels Accelerate's gloo
process state so that the Trainer's real FSDP2 path runs: ``Accelerator.prepare`` -> ``fsdp2_prepare_model`` ->
``fully_shard`` on a CPU mesh. Two launches: full shard on 2 processes (float64 truth, float32 reference,
fasttrain, 8-bit states, CPU offload, sharded save and resume) and hybrid shard on 4 (a 2 x 2 mesh). Checked:

- per-step loss and grad_norm: ``|ours - truth| <= K * |reference - truth| + floor`` against the float64 run;
- every example trained on exactly once per epoch across the ranks;
- ``fasttrain_status`` against detectors: FusedAdamW stepped the DTensor shards (its state exists, as DTensors),
  the fused clip ran at every step, the fused loss never called ``lm_head`` and its FSDP2 unit was all-gathered
  once per forward (as in the reference);
- a sharded checkpoint resumes to the same losses as the uninterrupted run, with 8-bit moments too (their codes
  and absmax DTensors on the shards, tests/test_optim_fsdp_8bit.py checks them against the unsharded optimizer
  and across world sizes).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# long multi-process runs: not in the default run (`slow`); .ci/scale runs them
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_fsdp_trainer_worker.py"
EPOCHS = 2
# layout -> (processes, rows, runs): ranks x 2 rows x 2 accumulation steps per optimizer step, 4 steps an epoch
LAUNCHES = {
    "full": (
        2,
        32,
        [
            "truth",
            "reference",
            "fasttrain",
            "fasttrain-8bit-save",
            "fasttrain-8bit-resume",
            "reference-offload",
            "fasttrain-offload",
            "fasttrain-save",
            "fasttrain-resume",
            "truth-tied",
            "reference-tied",
            "fasttrain-tied",
            "probe-no-cpu",
            "probe-use-cpu",
        ],
    ),
    "hybrid": (4, 64, ["truth-hybrid", "reference-hybrid", "fasttrain-hybrid"]),
}
STEPS = 4 * EPOCHS
SAVE_STEP = 4  # the worker's
# as in tests/test_deepspeed.py: fasttrain's float32 run may be a few times farther from the float64 truth than
# the float32 reference is (another summation order in the fused loss and norm); the Trainer accumulates the
# logged loss in float32 in every run, the truth's too, so a few float32 units of the value are noise
K = 4.0
FLOOR = 16 * 2.0**-23
# run -> (its float64 truth, its reference, its launch)
BASELINES = {
    "fasttrain": ("truth", "reference", "full"),
    "fasttrain-offload": ("truth", "reference-offload", "full"),
    "fasttrain-tied": ("truth-tied", "reference-tied", "full"),
    "fasttrain-hybrid": ("truth-hybrid", "reference-hybrid", "hybrid"),
}
HOT_PATHS = ("optimizer", "clip", "loss", "collator", "sampler")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch(out: Path, layout: str) -> dict[str, list[dict]]:
    procs, rows, runs = LAUNCHES[layout]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(procs),
        "--master_port",
        _free_port(),
        str(WORKER),
        str(out),
        "--runs",
        ",".join(runs),
        "--epochs",
        str(EPOCHS),
        "--rows",
        str(rows),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return {
        run: [json.loads((out / f"{run}-rank{r}.json").read_text()) for r in range(procs)] for run in runs
    }


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """layout -> its runs, each layout launched once (on first use) for every test of the module."""
    cache: dict[str, dict[str, list[dict]]] = {}

    def runs(layout: str) -> dict[str, list[dict]]:
        if layout not in cache:
            cache[layout] = launch(tmp_path_factory.mktemp(layout), layout)
        return cache[layout]

    return runs


def _trained(results: list[dict]) -> list[dict]:
    for r in results:
        assert "error" not in r, r.get("traceback", r.get("error"))
    return results


def _layout(run: str) -> str:
    return next(layout for layout, (_, _, runs) in LAUNCHES.items() if run in runs)


def test_fsdp_needs_the_harness_on_cpu(launched):
    # the facts the harness works around, checked so that a transformers/Accelerate that runs FSDP on CPU
    # by itself shows up here (the harness can then go)
    runs = launched("full")
    for r in runs["probe-no-cpu"]:
        assert r == {
            "refused": "Using fsdp only works in distributed training.",
            "parallel_mode": "ParallelMode.NOT_PARALLEL",
        }
    for r in runs["probe-use-cpu"]:  # FSDP silently dropped: the Trainer would run DDP
        assert r == {
            "distributed_type": "DistributedType.MULTI_CPU",
            "is_fsdp_enabled": False,
            "parallel_mode": "ParallelMode.DISTRIBUTED",
        }


@pytest.mark.parametrize("layout", list(LAUNCHES))
def test_runs_are_fsdp2_on_a_cpu_mesh(launched, layout):
    procs = LAUNCHES[layout][0]
    runs = launched(layout)
    trained = {name: _trained(results) for name, results in runs.items() if not name.startswith("probe")}
    for name, results in trained.items():
        for r in results:
            assert (r["world_size"], r["distributed_type"], r["is_fsdp2"]) == (
                procs,
                "DistributedType.FSDP",
                True,
            )
            assert r["model_class"].startswith("FSDP") and r["param_types"] == ["DTensor"], name
            assert r["weights_device"] == "cpu" and r["mesh"]["device_type"] == "cpu"
            assert r["weights_dtype"] == ("torch.float64" if name.startswith("truth") else "torch.float32")
            assert r["offload_policy"] == (
                "CPUOffloadPolicy" if name.endswith("-offload") else "OffloadPolicy"
            )
            if layout == "hybrid":  # replicated over one mesh dimension, sharded over the other
                assert r["mesh"]["shape"] == [2, procs // 2] and r["mesh"]["placements"] == ["R", "S(0)"], r[
                    "mesh"
                ]
            else:
                assert r["mesh"]["shape"] == [procs] and r["mesh"]["placements"] == ["S(0)"], r["mesh"]
    # every run started from the same weights (the tied runs from theirs)
    for tied in (False, True):
        checksums = {
            r["initial_checksum"] for results in trained.values() for r in results if r["tied"] is tied
        }
        assert len(checksums) <= 1, checksums
    assert all(r["tied"] == name.endswith("-tied") for name, results in trained.items() for r in results)


@pytest.mark.parametrize("run", ["reference", "fasttrain", "fasttrain-offload", "fasttrain-hybrid"])
def test_every_example_once_per_epoch(launched, run):
    _, rows, _ = LAUNCHES[_layout(run)]
    results = _trained(launched(_layout(run))[run])
    for epoch in range(EPOCHS):
        seen = sorted(row for r in results for row in r["rows_by_epoch"][str(epoch)])
        assert seen == list(range(rows)), f"epoch {epoch}: rows seen {seen}"


@pytest.mark.parametrize("run", list(BASELINES))
def test_loss_and_grad_norm_as_close_to_float64_as_the_reference(launched, run):
    truth_run, ref_run, layout = BASELINES[run]
    runs = launched(layout)
    truth, ref, ours = (_trained(runs[name])[0]["logs"] for name in (truth_run, ref_run, run))
    assert len(ours) == len(ref) == len(truth) == STEPS
    off = []
    for step, (t, r, o) in enumerate(zip(truth, ref, ours, strict=True), start=1):
        for key in ("loss", "grad_norm"):
            bound = K * abs(r[key] - t[key]) + FLOOR * abs(t[key])
            if abs(o[key] - t[key]) > bound:
                off.append(
                    f"step {step} {key}: |ours - truth| = {abs(o[key] - t[key]):.3e} > {bound:.3e} "
                    f"(|ref - truth| = {abs(r[key] - t[key]):.3e})"
                )
    assert not off, "\n".join(off)
    # every rank logs the same values (loss averaged across ranks, norm reduced over the mesh)
    assert all(r["logs"] == runs[run][0]["logs"] for r in runs[run])


@pytest.mark.parametrize(
    "run",
    [
        "fasttrain",
        "fasttrain-offload",
        "fasttrain-tied",
        "fasttrain-hybrid",
        "fasttrain-resume",
        "fasttrain-8bit-resume",
    ],
)
def test_status_tells_the_truth(launched, run):
    runs = launched(_layout(run))
    ours = _trained(runs[run])[0]
    ref = _trained(runs[BASELINES.get(run, ("", "reference"))[1]])[0]
    assert {path: ours["status"][path] for path in HOT_PATHS} == dict.fromkeys(HOT_PATHS, "on")
    # optimizer "on": FusedAdamW stepped the DTensor shards (its moments are DTensors like the parameters)
    assert ours["inner_optimizer"] == "fasttrain.optim.adamw.FusedAdamW"
    assert ours["inner_optimizer_states"] > 0 and "DTensor" in ours["state_types"]
    # clip "on": FusedAdamW applied the fused clip at every step of this run (a resumed run steps after SAVE_STEP)
    steps = STEPS - SAVE_STEP if run.endswith("-resume") else STEPS
    assert ours["deferred_clips_applied"] == steps
    # loss "on": lm_head was never called, the reference called it at every forward; lm_head's FSDP2 unit was
    # all-gathered once per forward (by the backbone's final norm, or tied, its embedding), not once per chunk
    assert ours["lm_head_calls"] == 0 < ref["lm_head_calls"]
    assert ours["head_unshards"] == ours["forwards"] > 0
    assert ref["head_unshards"] == ref["forwards"]


def test_8bit_states_on_dtensor_shards(launched):
    runs = launched("full")
    ours = _trained(runs["fasttrain-8bit-save"])
    # the embedding and lm_head (256 x 32, >= min_8bit_size) are quantized on their shards, as DTensors
    assert {"exp_avg_codes:uint8", "exp_avg_absmax:float32", "exp_avg:float32"} <= set(ours[0]["state_keys"])
    assert ours[0]["state_types"] == ["DTensor", "Tensor"]  # moments DTensors, step counts plain tensors
    # 8-bit moments of two matrices: the losses stay within 1% of the fp32-moment run's (a sanity bound; the
    # update itself is checked against the unsharded optimizer's in tests/test_optim_fsdp_8bit.py)
    plain = _trained(runs["fasttrain"])[0]["logs"]
    for a, b in zip(ours[0]["logs"], plain, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-2 * abs(b["loss"]), (a, b)


@pytest.mark.parametrize("moments", ["default", "8bit"])
def test_sharded_checkpoint_resumes_as_the_uninterrupted_run(launched, moments):
    runs = launched("full")
    save, resume = (
        ("fasttrain-save", "fasttrain-resume")
        if moments == "default"
        else (
            "fasttrain-8bit-save",
            "fasttrain-8bit-resume",
        )
    )
    # SHARDED_STATE_DICT: torch.distributed.checkpoint folders of shards (model and optimizer), no full weights
    files = _trained(runs[save])[0]["checkpoint_files"]
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(files), files
    assert not any(f.endswith((".safetensors", ".bin")) for f in files), files
    uninterrupted = {log["step"]: log for log in _trained(runs[save])[0]["logs"]}
    resumed = [log for log in _trained(runs[resume])[0]["logs"] if log["step"] > SAVE_STEP]
    assert [log["step"] for log in resumed] == [s for s in uninterrupted if s > SAVE_STEP]
    for log in resumed:
        # the sharded checkpoint holds the shards and FusedAdamW's state exactly: the same arithmetic follows
        for key in ("loss", "grad_norm"):
            expected = uninterrupted[log["step"]][key]
            assert abs(log[key] - expected) <= FLOOR * abs(expected), (log["step"], key)
    if moments != "default":
        return
    # and the uninterrupted run is the plain fasttrain run (saving changed nothing)
    plain = _trained(runs["fasttrain"])[0]["logs"]
    assert [(x["loss"], x["grad_norm"]) for x in plain] == [
        (x["loss"], x["grad_norm"]) for x in uninterrupted.values()
    ]
