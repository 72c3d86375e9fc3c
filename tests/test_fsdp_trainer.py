"""FSDP2 through ``transformers.Trainer`` on CPU (gloo), with and without fasttrain.

FSDP through the Trainer does not start without an accelerator (tests/_fsdp_trainer_worker.py says where, and
``test_fsdp_needs_the_harness_on_cpu`` checks it still holds); the worker's harness relabels Accelerate's gloo
process state so that the Trainer's real FSDP2 path runs: ``Accelerator.prepare`` -> ``fsdp2_prepare_model`` ->
``fully_shard`` on a CPU mesh. Three launches, one after the other into one output folder: full shard on 2
processes (float64 truth, float32 reference, fasttrain, 8-bit states, CPU offload, sharded save and resume), hybrid
shard on 4 (a 2 x 2 mesh; also full shard on 4) and the 2-process resumes of the 4-process checkpoints. Checked:

- per-step loss and grad_norm: ``|ours - truth| <= K * |reference - truth| + floor`` against the float64 run;
- every example trained on exactly once per epoch across the ranks;
- ``fasttrain_status`` against detectors: FusedAdamW stepped the DTensor shards (its state exists, as DTensors),
  the fused clip ran at every step, the fused loss never called ``lm_head`` and its FSDP2 unit was all-gathered
  once per forward (as in the reference);
- a sharded checkpoint resumes to the same losses as the uninterrupted run, with 8-bit moments too (their codes
  and absmax DTensors on the shards, tests/test_optim_fsdp_8bit.py checks them against the unsharded optimizer
  and across world sizes);
- a sharded checkpoint saved at one world size or mesh resumes at another (2 -> 4 and 4 -> 2 processes, full
  shard <-> hybrid shard at 2 and 4 processes, full shard <-> CPU offload at 4 and 2) to the uninterrupted run's
  losses and grad norms, for every FusedAdamW state_dtype, within the spread between uninterrupted runs at the two
  layouts; an offloaded run's checkpoint resumes offloaded the same way;
- a sharded checkpoint written by the reference (torch's AdamW) resumes under fasttrain and fasttrain's (default
  state) in the reference, at 2 processes and from 2 to 4 and 4 to 2: the step counts go on from the checkpoint's,
  and the steps after it are as close to the float64 truth as the reference's own float32 run;
- 8-bit moments under hybrid shard and CPU offload: codes and absmax DTensors placed like the parameter, training
  as under full shard to the reduction order.
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

# Resharding (the worker's reshard- runs and schedule): a run per layout and FusedAdamW state_dtype trains
# RESHARD_STEPS steps uninterrupted, saving a sharded checkpoint at RESHARD_SAVE_STEP; the resumes continue it at
# another layout. Every layout trains on the same RESHARD_GLOBAL_BATCH rows per micro-step (2 processes x 4 rows,
# 4 x 2), in the same random order, so the runs differ only in where their arithmetic ran.
RESHARD_STEPS = 4
RESHARD_SAVE_STEP = 2
RESHARD_GLOBAL_BATCH = 8
RESHARD_ACCUMULATION = 2
# layout -> processes (hybrid4: a 2 x 2 mesh; offload2: full shard with FSDP2's CPU offload policy)
RESHARD_LAYOUTS = {"full2": 2, "full4": 4, "hybrid4": 4, "offload2": 2}
STATE_DTYPES = ("param", "float32", "8bit")  # state_dtype None (the parameter's dtype), "float32", "8bit"
# (source, target): 2 -> 4 and 4 -> 2 processes, full shard <-> hybrid shard (2 -> 4, 4 -> 2 and at 4 processes),
# and full shard <-> CPU offload (an offloaded checkpoint resumed at 4 processes, a 4-process one resumed offloaded)
RESHARDS = [
    ("full2", "full4"),
    ("full4", "full2"),
    ("full2", "hybrid4"),
    ("hybrid4", "full2"),
    ("full4", "hybrid4"),
    ("hybrid4", "full4"),
    ("offload2", "full4"),
    ("full4", "offload2"),
]
# (source, target) at the same layout: an offloaded run's checkpoint resumed offloaded
RESUMES_IN_PLACE = [("offload2", "offload2")]
# checkpoints crossing implementations, (source layout, source optimizer) -> (target layout, target optimizer):
# the reference's torch AdamW ("torch") <-> fasttrain's FusedAdamW with its default state ("param"), at one layout
# and across world sizes
TORCH = "torch"
CROSSES = [
    (("full2", TORCH), ("full2", "param")),
    (("full2", "param"), ("full2", TORCH)),
    (("full2", TORCH), ("full4", "param")),
    (("full4", "param"), ("full2", TORCH)),
]
TRUTH_RUN = "reshard-full2-truth"  # the reference in float64 on the reshard schedule


def reshard_run(layout: str, state: str, source: str | None = None) -> str:
    return f"reshard-{layout}-{state}" + (f"-from-{source}" if source else "")


def crossed_run(source: tuple[str, str], target: tuple[str, str]) -> str:
    return reshard_run(*target, source=f"{source[0]}-{source[1]}")


def _crossed(processes: int) -> list[str]:
    """The crossing resumes at the layouts with this many processes."""
    return [crossed_run(s, t) for s, t in CROSSES if RESHARD_LAYOUTS[t[0]] == processes]


def _saves(processes: int) -> list[str]:
    """The uninterrupted (saving) reshard- runs of the layouts with this many processes."""
    return [
        reshard_run(layout, state)
        for layout, procs in RESHARD_LAYOUTS.items()
        if procs == processes
        for state in STATE_DTYPES
    ]


def _resumes(processes: int) -> list[str]:
    """The reshard- resumes at the layouts with this many processes (of checkpoints saved at another, or in
    place)."""
    return [
        reshard_run(target, state, source)
        for source, target in RESHARDS + RESUMES_IN_PLACE
        if RESHARD_LAYOUTS[target] == processes
        for state in STATE_DTYPES
    ]


# layout -> (processes, rows, runs): ranks x 2 rows x 2 accumulation steps per optimizer step, 4 steps an epoch
# (the reshard- runs set their own rows and schedule)
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
            *_saves(2),
            reshard_run("full2", TORCH),
            TRUTH_RUN,
            *[run for run in _crossed(2) if "-from-full2-" in run],  # sources saved above
            "probe-no-cpu",  # last: the probes replace the harness's process state
            "probe-use-cpu",
        ],
    ),
    "hybrid": (
        4,
        64,
        [
            "truth-hybrid",
            "reference-hybrid",
            "fasttrain-hybrid",
            *_saves(4),
            reshard_run("full4", TORCH),
            *_resumes(4),
            *_crossed(4),
        ],
    ),
    "full-resumes": (2, 32, [*_resumes(2), *[run for run in _crossed(2) if "-from-full2-" not in run]]),
}
# a launch that resumes another's checkpoints runs after it (all write into one output folder)
AFTER = {"hybrid": "full", "full-resumes": "hybrid"}
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
    """layout -> its runs, each layout launched once (on first use, after the launch it resumes from) for every
    test of the module."""
    cache: dict[str, dict[str, list[dict]]] = {}
    out = tmp_path_factory.mktemp("fsdp-trainer")

    def runs(layout: str) -> dict[str, list[dict]]:
        if layout not in cache:
            if layout in AFTER:
                runs(AFTER[layout])
            cache[layout] = launch(out, layout)
        return cache[layout]

    return runs


def _trained(results: list[dict]) -> list[dict]:
    for r in results:
        assert "error" not in r, r.get("traceback", r.get("error"))
    return results


def _layout(run: str) -> str:
    return next(layout for layout, (_, _, runs) in LAUNCHES.items() if run in runs)


def _hybrid(run: str) -> bool:
    if run.startswith("reshard-"):  # reshard-<layout>-<state>[-from-<source>]
        return run.split("-")[1] == "hybrid4"
    return run.endswith("-hybrid")


def _offloaded(run: str) -> bool:
    if run.startswith("reshard-"):
        return run.split("-")[1] == "offload2"
    return run.endswith("-offload")


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
            assert r["weights_dtype"] == ("torch.float64" if "truth" in name.split("-") else "torch.float32")
            assert r["offload_policy"] == ("CPUOffloadPolicy" if _offloaded(name) else "OffloadPolicy"), name
            # and fully_shard offloaded every parameter of an offloaded run, none of another's
            assert r["fsdp_params"] > 0
            assert r["offloaded_params"] == (r["fsdp_params"] if _offloaded(name) else 0), name
            if _hybrid(name):  # replicated over one mesh dimension, sharded over the other
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


def _assert_near_truth(steps, truth: list[dict], ref: list[dict], ours: list[dict]) -> None:
    """At each of ``steps`` (1-based), ``ours`` logs loss and grad_norm within K times the reference's distance
    from the float64 truth, plus FLOOR float32 units of the value."""
    off = []
    for step in steps:
        t, r, o = truth[step - 1], ref[step - 1], ours[step - 1]
        for key in ("loss", "grad_norm"):
            bound = K * abs(r[key] - t[key]) + FLOOR * abs(t[key])
            if abs(o[key] - t[key]) > bound:
                off.append(
                    f"step {step} {key}: |ours - truth| = {abs(o[key] - t[key]):.3e} > {bound:.3e} "
                    f"(|ref - truth| = {abs(r[key] - t[key]):.3e})"
                )
    assert not off, "\n".join(off)


@pytest.mark.parametrize("run", list(BASELINES))
def test_loss_and_grad_norm_as_close_to_float64_as_the_reference(launched, run):
    truth_run, ref_run, layout = BASELINES[run]
    runs = launched(layout)
    truth, ref, ours = (_trained(runs[name])[0]["logs"] for name in (truth_run, ref_run, run))
    assert len(ours) == len(ref) == len(truth) == STEPS
    _assert_near_truth(range(1, STEPS + 1), truth, ref, ours)
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


def _reshard_results(launched, run: str) -> list[dict]:
    layout = run.split("-")[1]
    results = _trained(launched(_layout(run))[run])
    assert results[0]["world_size"] == RESHARD_LAYOUTS[layout] == len(results), run
    assert all(r["logs"] == results[0]["logs"] for r in results), f"{run}: the ranks logged different values"
    return results


def _rows_per_step(results: list[dict]) -> list[list[int]]:
    """The rows each optimizer step of a run trained on, over all its ranks (from the rows each rank recorded
    at each micro-step, in order: RESHARD_ACCUMULATION micro-steps of RESHARD_GLOBAL_BATCH / ranks rows a step)."""
    per_rank = [r["rows_by_epoch"]["0"] for r in results]
    per_step = RESHARD_ACCUMULATION * RESHARD_GLOBAL_BATCH // len(results)
    steps = len(per_rank[0]) // per_step
    assert all(len(rows) == steps * per_step for rows in per_rank)
    return [
        sorted(row for rows in per_rank for row in rows[s * per_step : (s + 1) * per_step])
        for s in range(steps)
    ]


# the bound of the fp32 logged values' own rounding: the Trainer sums the loss of the accumulation steps in float32
# and averages it over the ranks (2 or 4: another order of a few additions), the grad norm is reduced over another
# mesh; a few float32 units of the value
RESHARD_FLOOR = 4 * 2.0**-23
# the resumed run may be up to this many times as far from the uninterrupted run as an uninterrupted run at the
# other layout is (it ran part of the steps in the other order, that run all of them)
RESHARD_K = 4.0


@pytest.mark.parametrize("state", STATE_DTYPES)
def test_every_layout_trains_on_the_same_examples_per_step(launched, state):
    # the premise of the resharding tests: 2 x 4 rows and 4 x 2 rows per micro-step are the same 8 examples, so an
    # optimizer step sees the same examples at every world size and mesh
    runs = {layout: _reshard_results(launched, reshard_run(layout, state)) for layout in RESHARD_LAYOUTS}
    rows = {layout: _rows_per_step(results) for layout, results in runs.items()}
    assert len(rows["full2"]) == RESHARD_STEPS
    assert sorted(row for step in rows["full2"] for row in step) == list(
        range(RESHARD_STEPS * RESHARD_ACCUMULATION * RESHARD_GLOBAL_BATCH)
    )
    assert all(rows[layout] == rows["full2"] for layout in RESHARD_LAYOUTS), rows
    # and the first step (the same weights, the same examples) logs the same loss and grad norm to the fp32
    # reduction order
    first = {layout: results[0]["logs"][0] for layout, results in runs.items()}
    for key in ("loss", "grad_norm"):
        values = [log[key] for log in first.values()]
        assert max(values) - min(values) <= RESHARD_FLOOR * abs(values[0]), (key, first)


@pytest.mark.parametrize("source,target", RESHARDS, ids=[f"{s}-to-{t}" for s, t in RESHARDS])
@pytest.mark.parametrize("state", STATE_DTYPES)
def test_sharded_checkpoint_resumes_at_another_world_size(launched, state, source, target):
    _resumes_as_the_uninterrupted_run(launched, state, source, target)


@pytest.mark.parametrize("source,target", RESUMES_IN_PLACE, ids=[f"{s}-to-{t}" for s, t in RESUMES_IN_PLACE])
@pytest.mark.parametrize("state", STATE_DTYPES)
def test_offloaded_sharded_checkpoint_resumes_offloaded(launched, state, source, target):
    # the same checks; the uninterrupted run at the target layout is the uninterrupted run itself (no spread): the
    # resume must give its losses and grad norms to the float32 units of their own rounding
    _resumes_as_the_uninterrupted_run(launched, state, source, target)


def _resumes_as_the_uninterrupted_run(launched, state: str, source: str, target: str) -> None:
    uninterrupted = _reshard_results(launched, reshard_run(source, state))
    other = _reshard_results(launched, reshard_run(target, state))  # uninterrupted at the target layout
    resumed = _reshard_results(launched, reshard_run(target, state, source))
    files = uninterrupted[0]["checkpoint_files"]
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(files), files
    # the resume loaded the checkpoint's trainer state (its logs up to the save) and trained the remaining steps,
    # on the rows the uninterrupted run trained on at those steps
    ours, expected, spread_run = (
        {log["step"]: log for log in run[0]["logs"]} for run in (resumed, uninterrupted, other)
    )
    assert sorted(ours) == sorted(expected) == list(range(1, RESHARD_STEPS + 1))
    assert all(ours[s] == expected[s] for s in range(1, RESHARD_SAVE_STEP + 1))
    assert _rows_per_step(resumed) == _rows_per_step(uninterrupted)[RESHARD_SAVE_STEP:]
    assert resumed[0]["deferred_clips_applied"] == RESHARD_STEPS - RESHARD_SAVE_STEP
    # the moments in the state_dtype's layout (8-bit codes and absmax on the shards for "8bit")
    assert resumed[0]["state_keys"] == uninterrupted[0]["state_keys"]
    assert ("exp_avg_codes:uint8" in resumed[0]["state_keys"]) == (state == "8bit")
    # the bound: how far apart the uninterrupted runs at the two layouts are (another reduction order, the same
    # arithmetic otherwise), at any step
    off = []
    for key in ("loss", "grad_norm"):
        spread = max(abs(spread_run[s][key] - expected[s][key]) for s in expected)
        # which must itself be a reduction-order spread (64 float32 units), or the bound would say nothing
        assert spread <= 16 * RESHARD_FLOOR * max(abs(log[key]) for log in expected.values()), (key, spread)
        for step in range(RESHARD_SAVE_STEP + 1, RESHARD_STEPS + 1):
            bound = RESHARD_K * spread + RESHARD_FLOOR * abs(expected[step][key])
            if abs(ours[step][key] - expected[step][key]) > bound:
                off.append(
                    f"step {step} {key}: resumed {ours[step][key]!r}, uninterrupted {expected[step][key]!r} "
                    f"(bound {bound:.3e}; the layouts' spread {spread:.3e})"
                )
    assert not off, "\n".join(off)


@pytest.mark.parametrize("layout", ["hybrid4", "offload2"])
def test_8bit_states_on_hybrid_and_offloaded_shards(launched, layout):
    ours = _reshard_results(launched, reshard_run(layout, "8bit"))
    full = _reshard_results(launched, reshard_run("full2", "8bit"))
    # the embedding and lm_head quantized on their shards: codes and absmax DTensors, placed like the parameters
    # (on the hybrid mesh replicated over one dimension, sharded over the other)
    assert {"exp_avg_codes:uint8", "exp_avg_absmax:float32", "exp_avg:float32"} <= set(ours[0]["state_keys"])
    assert ours[0]["state_keys"] == full[0]["state_keys"]
    assert ours[0]["state_types"] == ["DTensor", "Tensor"]
    placements = ",".join(ours[0]["mesh"]["placements"])
    assert {p.split(":")[0] for p in ours[0]["state_placements"]} >= {"exp_avg_codes", "exp_avg_absmax"}
    assert {p.split(":")[1] for p in ours[0]["state_placements"]} == {placements}, ours[0]["state_placements"]
    # and they train as 8-bit moments under full shard at 2 processes, at every step (from step 2 on, the update
    # reads the moments), to the reduction order (the spread the reshard tests allow between layouts)
    for a, b in zip(ours[0]["logs"], full[0]["logs"], strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 16 * RESHARD_FLOOR * abs(b[key]), (key, a, b)


@pytest.mark.parametrize(
    "source,target", CROSSES, ids=[f"{s[0]}-{s[1]}-to-{t[0]}-{t[1]}" for s, t in CROSSES]
)
def test_checkpoint_crosses_between_torch_adamw_and_fasttrain(launched, source, target):
    # a sharded checkpoint the reference wrote (torch's AdamW) resumes under fasttrain, and fasttrain's in the
    # reference: both keep step, exp_avg and exp_avg_sq in the parameter's dtype, keyed by parameter name
    saved = _reshard_results(launched, reshard_run(*source))
    resumed = _reshard_results(launched, crossed_run(source, target))
    reference = _reshard_results(
        launched, reshard_run(target[0], TORCH)
    )  # uninterrupted, the target's layout
    truth = _trained(launched("full")[TRUTH_RUN])[0]["logs"]
    files = saved[0]["checkpoint_files"]
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(files), files
    torch_adamw = "torch.optim.adamw.AdamW"
    fused = "fasttrain.optim.adamw.FusedAdamW"
    assert saved[0]["inner_optimizer"] == (torch_adamw if source[1] == TORCH else fused)
    assert resumed[0]["inner_optimizer"] == (torch_adamw if target[1] == TORCH else fused)
    if target[1] != TORCH:  # fasttrain's optimizer and clip stepped the loaded state
        assert resumed[0]["status"]["optimizer"] == "on" and resumed[0]["status"]["clip"] == "on"
        assert resumed[0]["deferred_clips_applied"] == RESHARD_STEPS - RESHARD_SAVE_STEP
    # the same state type on both sides, and the loaded step counts went on from the checkpoint's
    assert (
        resumed[0]["state_keys"]
        == saved[0]["state_keys"]
        == ["exp_avg:float32", "exp_avg_sq:float32", "step:float32"]
    )
    assert resumed[0]["state_steps"] == saved[0]["state_steps"] == [float(RESHARD_STEPS)]
    ours, written = ({log["step"]: log for log in run[0]["logs"]} for run in (resumed, saved))
    assert sorted(ours) == list(range(1, RESHARD_STEPS + 1))
    assert all(
        ours[s] == written[s] for s in range(1, RESHARD_SAVE_STEP + 1)
    )  # the checkpoint's trainer state
    assert _rows_per_step(resumed) == _rows_per_step(saved)[RESHARD_SAVE_STEP:]
    assert _rows_per_step(reference) == _rows_per_step(saved)  # the steps are the truth's steps
    # the steps after the checkpoint ran one implementation's arithmetic on the other's weights and moments: as
    # close to the float64 truth as the reference's own float32 run at the target layout is
    resumed_logs = [ours[step] for step in sorted(ours)]
    _assert_near_truth(
        range(RESHARD_SAVE_STEP + 1, RESHARD_STEPS + 1), truth, reference[0]["logs"], resumed_logs
    )
