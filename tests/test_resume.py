"""Checkpoint and resume with fasttrain on: the resumed run ends on the weights of the run that never
stopped, also after a SIGKILL, and the optimizer state crosses between FusedAdamW and torch AdamW."""

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
import fasttrain

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_train_script.py"


def _trainer(cls, out, **overrides):
    tok = tiny.tokenizer()
    args = dict(max_steps=6, save_strategy="steps", save_steps=3)
    args.update(overrides)
    return cls(
        model=tiny.model("llama"),
        args=tiny.training_args(str(out), **args),
        train_dataset=tiny.dataset(),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, rtol: float) -> None:
    # Per tensor, relative to the change training made: FusedAdamW and torch AdamW round differently
    # (1e-4 of the update); the same implementation resumed must agree to rounding (1e-5).
    tiny.assert_same_updates(b, a, tiny.model("llama"), rtol)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    trainer = _trainer(fasttrain.Trainer, out)
    trainer.train()
    return out, trainer.model


def test_resume_ends_on_the_same_weights(uninterrupted, tmp_path):
    out, full_model = uninterrupted
    resumed = _trainer(fasttrain.Trainer, tmp_path)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    _assert_same_weights(full_model, resumed.model, rtol=1e-5)


def test_fasttrain_checkpoint_resumes_in_the_reference_trainer(uninterrupted, tmp_path):
    out, full_model = uninterrupted
    ref = _trainer(transformers.Trainer, tmp_path)
    ref.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    _assert_same_weights(full_model, ref.model, rtol=1e-4)


def test_reference_checkpoint_resumes_in_fasttrain(tmp_path):
    ref = _trainer(transformers.Trainer, tmp_path / "ref")
    ref.train()
    ours = _trainer(fasttrain.Trainer, tmp_path / "ours")
    ours.train(resume_from_checkpoint=str(tmp_path / "ref" / "checkpoint-3"))
    assert ours.fasttrain_status["optimizer"] == "on"
    # the run that continues the reference's checkpoint is compared with the reference's own continuation
    _assert_same_weights(ref.model, ours.model, rtol=1e-4)


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
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), "--save-steps", "3",
           "--kill-at-save", "3"]
    # per_device_train_batch_size differs from the fixture's run: compare against a run of the same script
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert (tmp_path / "checkpoint-3" / "optimizer.pt").exists()
    assert not (tmp_path / "result-rank0.json").exists()
    resumed = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), "--resume", str(tmp_path / "checkpoint-3")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "straight")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    a = torch.load(tmp_path / "final-rank0.pt", weights_only=True)
    b = torch.load(tmp_path / "straight" / "final-rank0.pt", weights_only=True)
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7, msg=f"parameter {name}")
