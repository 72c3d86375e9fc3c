"""``python -m fasttrain.bench.convergence`` end to end on the tiny shape: the three files, every curve at the asked
length, and each mode trained with what its name says, read from its tensors (8-bit codes, bf16 weights, gradients
freed by the step in backward, no clip there)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from fasttrain.bench import convergence

STEPS, EVAL_EVERY = 6, 3
SEEDS = [0, 1]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence")
    args = ["--preset", "tiny", "--steps", str(STEPS), "--batch-size", "2", "--seq-len", "32"]
    args += ["--eval-every", str(EVAL_EVERY), "--eval-rows", "4", "--seeds", ",".join(map(str, SEEDS))]
    # a process of its own, as the command runs: the -m entry point and its argument parsing are what is tested
    subprocess.run(
        [sys.executable, "-m", "fasttrain.bench.convergence", *args, "--out", str(out)], check=True
    )
    return out, json.loads((out / "convergence_cpu.json").read_text())


def test_files_and_curves(result):
    out, data = result
    assert data["provenance"]["command"].startswith("python -m fasttrain.bench.convergence --preset tiny")
    assert (out / "convergence_cpu.png").stat().st_size > 1000
    runs = data["runs"]
    assert [(r["mode"], r["seed"]) for r in runs] == [(m, s) for m in convergence.MODES for s in SEEDS]
    for r in runs:
        assert [p["step"] for p in r["eval_curve"]] == [0, 3, 6]
        assert len(r["train_losses"]) == STEPS
        assert r["final_eval_loss"] == r["eval_curve"][-1]["eval_loss"] > 0
        assert r["tokens_per_s"] > 0
    md = (out / "convergence_cpu.md").read_text()
    assert "- command: `python -m fasttrain.bench.convergence" in md
    for mode in convergence.MODES:
        assert f"| {mode} | " in md
    low, high = data["summary"]["spread"]
    ref = [r["final_eval_loss"] for r in runs if r["mode"] == convergence.REFERENCE]
    assert (low, high) == (min(ref), max(ref))
    by_seed = {(r["mode"], r["seed"]): r["final_eval_loss"] for r in runs}
    assert [row["mode"] for row in data["summary"]["rows"]] == list(convergence.MODES)
    for row in data["summary"]["rows"]:
        finals = [by_seed[row["mode"], s] for s in SEEDS]
        assert row["final_eval_losses"] == finals and row["final_eval_loss"] == pytest.approx(sum(finals) / 2)
        # each seed against the reference run of the same seed (same init, same data order)
        paired = [by_seed[row["mode"], s] - by_seed[convergence.REFERENCE, s] for s in SEEDS]
        assert row["paired_differences"] == pytest.approx(paired, abs=1e-12)
        assert row["paired_mean"] == pytest.approx(sum(paired) / 2, abs=1e-12)
        assert row["within_reference_spread"] == (low <= row["final_eval_loss"] <= high)
        assert (row["outside_by"] == 0) == row["within_reference_spread"]


def test_each_mode_ran_as_named(result):
    _, data = result
    by_mode = {r["mode"]: r for r in data["runs"] if r["seed"] == SEEDS[0]}
    for mode, r in by_mode.items():
        ev, spec = r["evidence"], convergence.MODES[mode]
        assert ev["optimizer"] == ("AdamW" if spec["optimizer"] == "torch" else "FusedAdamW"), mode
        assert ev["param_dtypes"] == [f"torch.{spec['dtype']}"], mode
        # the embedding's moments: 8-bit codes unless the mode keeps them apart in fp32; in the tiny shape no
        # other tensor reaches min_8bit_size, so there are codes exactly where the embedding has them
        embedding_8bit = spec["options"].get("state_dtype") == "8bit" and spec["embedding_state"] is None
        assert (ev["uint8_state_tensors"] > 0) == embedding_8bit, mode
        assert ("torch.uint8" in ev["embedding_state_dtypes"]) == embedding_8bit, mode
        if spec["embedding_state"]:
            assert ev["embedding_state_dtypes"] == ["torch.float32"], mode
        assert ev["stochastic_rounding"] == spec["options"].get("bf16_stochastic_rounding", False), mode
        in_backward = spec.get("in_backward", False)
        # the step in backward frees each gradient it steps: none is left once backward returns
        assert ev["grads_after_first_backward"] is not in_backward, mode
        assert spec["clip"] == (not in_backward and "without clip" not in mode), mode
        assert ev["max_grad_norm"] == (convergence.MAX_GRAD_NORM if spec["clip"] else 0.0), mode
        assert ev["clipped_steps"] == (STEPS if spec["clip"] else 0), mode
        assert (ev["updates_in_backward"] > 0) == in_backward, mode
    # the tiny shape: 2 layers x 11 tensors + the final norm + the tied embedding, each stepped every step
    assert (
        by_mode["fasttrain bf16+SR+8-bit + step in backward"]["evidence"]["updates_in_backward"] == 24 * STEPS
    )
    # the control's moments are bf16 (rounded to nearest), no 8-bit codes
    assert "torch.bfloat16" in by_mode["bf16 without SR"]["evidence"]["state_dtypes"]
    # FusedAdamW fp32 is torch's AdamW math: the same run, to rounding
    ref = by_mode[convergence.REFERENCE]["final_eval_loss"]
    assert by_mode["fasttrain fp32"]["final_eval_loss"] == pytest.approx(ref, abs=1e-4)


def test_lr_schedule_and_decay_groups():
    factors = [convergence.lr_factor(s, 100, 5) for s in range(100)]
    assert factors[:5] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(factors[4:]))
    assert factors[-1] == pytest.approx(convergence.MIN_LR_RATIO, abs=0.01)
    model = convergence.build_model(convergence.PRESETS["tiny"], 64, 0, convergence.torch.float32)
    decay, rest = convergence.param_groups(model)
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in rest["params"])
    assert rest["weight_decay"] == 0 and decay["weight_decay"] == convergence.WEIGHT_DECAY
    assert len(decay["params"]) + len(rest["params"]) == len(list(model.parameters()))
    # the embedding apart: in its own group (decayed, its state dtype), in no other
    *others, own = convergence.param_groups(model, "float32")
    embedding = model.get_input_embeddings().weight
    assert own["params"] == [embedding] and own["state_dtype"] == "float32" and own["weight_decay"] > 0
    assert not any(p is embedding for g in others for p in g["params"])
    assert sum(len(g["params"]) for g in [*others, own]) == len(list(model.parameters()))
