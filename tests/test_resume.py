"""Checkpoint and resume with fasttrain on: the resumed run ends on the weights of the run that never
stopped, also after a SIGKILL, and the optimizer state crosses between FusedAdamW and torch AdamW.

A run resumed by the same implementation repeats the same arithmetic: its weights are equal, bit for bit. A run
that crosses implementations rounds differently after the checkpoint: it must be about as close to the truth
(the reference Trainer on the float64 twin, never stopped) as the reference's own float32 run is (``_truth``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import _tiny as tiny
import _truth
import fasttrain

pytestmark = [pytest.mark.dropin, pytest.mark.numeric]

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_train_script.py"


def _trainer(cls, out, model=None, **overrides):
    tok = tiny.tokenizer()
    args = dict(max_steps=6, save_strategy="steps", save_steps=3)
    args.update(overrides)
    return cls(
        model=model or tiny.model("llama"),
        args=tiny.training_args(str(out), **args),
        train_dataset=tiny.dataset(),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )


def _assert_equal_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: max difference {float((p - q).abs().max()):.3e}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    trainer = _trainer(fasttrain.Trainer, out)
    trainer.train()
    return out, trainer.model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference Trainer never stopped (checkpoint-3 kept), and the truth: the same on the float64 twin."""
    out = tmp_path_factory.mktemp("reference")
    ref = _trainer(transformers.Trainer, out)
    ref.train()
    truth = _trainer(
        transformers.Trainer,
        tmp_path_factory.mktemp("truth"),
        model=_truth.float64_twin(tiny.model("llama")),
        save_strategy="no",
    )
    truth.train()
    return out, ref.model, truth.model


def test_resume_ends_on_the_same_weights(uninterrupted, tmp_path):
    out, full_model = uninterrupted
    resumed = _trainer(fasttrain.Trainer, tmp_path)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    _assert_equal_weights(full_model, resumed.model)


def test_fasttrain_checkpoint_resumes_in_the_reference_trainer(uninterrupted, reference, tmp_path):
    out, _ = uninterrupted
    _, ref_model, truth_model = reference
    crossed = _trainer(transformers.Trainer, tmp_path)
    crossed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    _truth.assert_params_near_truth(crossed.model, ref_model, truth_model)


def test_reference_checkpoint_resumes_in_fasttrain(reference, tmp_path):
    out, ref_model, truth_model = reference
    ours = _trainer(fasttrain.Trainer, tmp_path)
    ours.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert ours.fasttrain_status["optimizer"] == "on"
    _truth.assert_params_near_truth(ours.model, ref_model, truth_model)


def test_optimizer_state_loads_into_torch_adamw(uninterrupted, tmp_path):
    out, _ = uninterrupted
    state = torch.load(out / "checkpoint-3" / "optimizer.pt", weights_only=True)
    ref = _trainer(transformers.Trainer, tmp_path)
    optimizer = ref.create_optimizer()
    assert type(optimizer) is torch.optim.AdamW
    optimizer.load_state_dict(state)  # raises on any layout mismatch
    loaded = optimizer.state_dict()
    assert loaded["state"].keys() == state["state"].keys()
    for index, saved in state["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(loaded["state"][index][key], saved[key], rtol=0, atol=0)


def test_sigkill_after_checkpoint_then_resume(tmp_path):
    env = dict(os.environ)
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), "--save-steps", "3", "--kill-at-save", "3"]
    # per_device_train_batch_size differs from the fixture's run: compare against a run of the same script
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert (tmp_path / "checkpoint-3" / "optimizer.pt").exists()
    assert not (tmp_path / "result-rank0.json").exists()
    resumed = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "--resume", str(tmp_path / "checkpoint-3")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "straight")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    a = torch.load(tmp_path / "final-rank0.pt", weights_only=True)
    b = torch.load(tmp_path / "straight" / "final-rank0.pt", weights_only=True)
    assert a.keys() == b.keys()
    for name in b:  # the same script and implementation: the same arithmetic, bit for bit
        assert torch.equal(a[name], b[name]), f"parameter {name}"
