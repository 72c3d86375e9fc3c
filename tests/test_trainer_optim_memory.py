"""Optimizer memory through the Trainer: the reference's by default, less only when asked through TrainingArguments
(``optim_args``) or the environment (``FASTTRAIN_OPTIM_ARGS``), under ``fasttrain.Trainer`` and ``patch()``."""

from __future__ import annotations

import pytest
import torch
import transformers

import _tiny as tiny
import fasttrain
from fasttrain import FusedAdamW

pytestmark = [pytest.mark.dropin, pytest.mark.gpu_versions]


@pytest.fixture(autouse=True)
def _unpatched():
    fasttrain.unpatch()
    yield
    fasttrain.unpatch()


def _state_bytes(trainer) -> int:
    optimizer = trainer.optimizer.optimizer  # under Accelerate's AcceleratedOptimizer
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for key, t in state.items()
        if isinstance(t, torch.Tensor) and key != "step"
    )


def _train_bf16(cls, tmp_path, **args):
    tok = tiny.tokenizer()
    trainer = cls(
        model=tiny.model("llama", dtype=torch.bfloat16),
        args=tiny.training_args(str(tmp_path), max_steps=2, **args),
        train_dataset=tiny.dataset(),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    trainer.train()
    return trainer


def test_a_bf16_model_holds_the_reference_optimizer_memory(tmp_path):
    ref = _train_bf16(transformers.Trainer, tmp_path / "ref")
    ours = _train_bf16(fasttrain.Trainer, tmp_path / "ours")
    assert ours.fasttrain_status["optimizer"] == "on"
    assert _state_bytes(ours) == _state_bytes(ref) > 0
    moments = [
        t for s in ours.optimizer.optimizer.state.values() for k, t in s.items() if k.startswith("exp_avg")
    ]
    assert {t.dtype for t in moments} == {torch.bfloat16}


@pytest.mark.parametrize("entry", ["optim_args", "env-under-patch"])
def test_8bit_states_on_request_without_changing_the_script(tmp_path, monkeypatch, entry):
    ref = _train_bf16(transformers.Trainer, tmp_path / "ref")
    if entry == "optim_args":
        ours = _train_bf16(
            fasttrain.Trainer, tmp_path / "ours", optim_args="state_dtype=8bit,min_8bit_size=256"
        )
    else:
        monkeypatch.setenv("FASTTRAIN_OPTIM_ARGS", "state_dtype=8bit,min_8bit_size=256")
        fasttrain.patch()
        ours = _train_bf16(transformers.Trainer, tmp_path / "ours")
    optimizer = ours.optimizer.optimizer
    assert isinstance(optimizer, FusedAdamW) and optimizer.param_groups[0]["state_dtype"] == "8bit"
    # the tiny model's 256x32 embedding and head are quantized: far less state than the reference's
    assert _state_bytes(ours) < 0.75 * _state_bytes(ref)
    assert all(torch.isfinite(p).all() for p in ours.model.parameters())


def test_a_bad_optim_arg_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="state_dtype"):
        _train_bf16(fasttrain.Trainer, tmp_path, optim_args="state_dtype=4bit")
