"""fasttrain.patch() / unpatch(): unmodified scripts and Trainer subclasses (TRL) get the hot paths;
idempotent and fully reversible."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import trainer_optimizer

import _tiny as tiny
import fasttrain
from fasttrain import patching

HOOKED = ("__init__", "_get_train_sampler", "create_optimizer", "_clip_grad_norm", "_get_grad_norm",
          "compute_loss", "prediction_step")


@pytest.fixture(autouse=True)
def _always_unpatched():
    fasttrain.unpatch()
    yield
    fasttrain.unpatch()


def _snapshot():
    methods = {name: transformers.Trainer.__dict__[name] for name in HOOKED}
    handlers = dict(trainer_optimizer._OPTIMIZER_HANDLERS)
    return methods, handlers


def test_patch_is_idempotent_and_reversible():
    before = _snapshot()
    fasttrain.patch()
    once = _snapshot()
    fasttrain.patch()
    assert _snapshot() == once, "a second patch() must not wrap again"
    assert all(once[0][n] is not before[0][n] for n in HOOKED)
    assert once[1]["adamw_torch_fused"] is not before[1]["adamw_torch_fused"]
    fasttrain.unpatch()
    after = _snapshot()
    assert all(after[0][n] is before[0][n] for n in HOOKED)
    assert after[1] == before[1] and all(after[1][k] is before[1][k] for k in before[1])
    fasttrain.unpatch()
    assert not patching.is_patched()
    assert transformers.trainer_utils  # LOSS_MAPPING untouched:
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    assert LOSS_MAPPING["ForCausalLM"] is ForCausalLMLoss


def _train_plain(tmp_path, name):
    tok = tiny.tokenizer()
    trainer = transformers.Trainer(
        model=tiny.model("qwen3"),
        args=tiny.training_args(str(tmp_path / name), train_sampling_strategy="group_by_length"),
        train_dataset=tiny.dataset(with_length=True),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    trainer.train()
    return trainer


def test_unmodified_script_gets_every_hot_path(tmp_path):
    ref = _train_plain(tmp_path, "ref")
    fasttrain.patch()
    ours = _train_plain(tmp_path, "ours")
    assert type(ours) is transformers.Trainer
    assert all(v == "on" for v in ours.fasttrain_status.values()), ours.fasttrain_status
    for a, b in zip(tiny.step_logs(ref), tiny.step_logs(ours), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def test_fasttrain_trainer_under_patch_is_not_doubled(tmp_path):
    fasttrain.patch()
    tok = tiny.tokenizer()
    trainer = fasttrain.Trainer(
        model=tiny.model("llama"),
        args=tiny.training_args(str(tmp_path), max_steps=2),
        train_dataset=tiny.dataset(),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    trainer.train()
    assert sum(isinstance(cb, fasttrain.integration.HotPathReport) for cb in trainer.callback_handler.callbacks) == 1
    assert trainer.fasttrain_status["optimizer"] == "on"


def _sft(tmp_path, name):
    trl = pytest.importorskip("trl")
    config = trl.SFTConfig(
        output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=4, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, learning_rate=1e-3, max_length=64,
        disable_tqdm=True,
    )
    trainer = trl.SFTTrainer(model=tiny.model("llama"), args=config,
                             train_dataset=tiny.text_dataset().select_columns(["text"]),
                             processing_class=tiny.tokenizer())
    trainer.train()
    return trainer


def test_trl_sft_trainer_under_patch(tmp_path):
    ref = _sft(tmp_path, "ref")
    fasttrain.patch()
    ours = _sft(tmp_path, "ours")
    status = ours.fasttrain_status
    assert status["optimizer"] == "on" and status["clip"] == "on", status
    assert status["loss"].startswith("off: SFTTrainer.compute_loss"), status
    for a, b in zip(tiny.step_logs(ref), tiny.step_logs(ours), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


def _dpo(tmp_path, name):
    trl = pytest.importorskip("trl")
    config = trl.DPOConfig(
        output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=4, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, learning_rate=1e-3, max_length=48,
        disable_tqdm=True,
    )
    # a model built from a config has no hub name: TRL cannot reload it as the reference, so pass one
    trainer = trl.DPOTrainer(model=tiny.model("llama"), ref_model=tiny.model("llama"), args=config,
                             train_dataset=tiny.text_dataset().select_columns(["prompt", "chosen", "rejected"]),
                             processing_class=tiny.tokenizer())
    trainer.train()
    return trainer


def test_trl_dpo_trainer_under_patch(tmp_path):
    ref = _dpo(tmp_path, "ref")
    fasttrain.patch()
    ours = _dpo(tmp_path, "ours")
    assert ours.fasttrain_status["optimizer"] == "on", ours.fasttrain_status
    for a, b in zip(tiny.step_logs(ref), tiny.step_logs(ours), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    assert all(torch.isfinite(p).all() for p in ours.model.parameters())
