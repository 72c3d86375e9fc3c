"""TRL's SFTTrainer and DPOTrainer under ``fasttrain.patch()``: every hot path runs (fasttrain's kernel behind
TRL's fused LM head, its collators, the sampler when grouping is asked), and the loss and every metric TRL logs
equal plain TRL's at every step (fp32). A user's subclass of those trainers gets the same."""

from __future__ import annotations

import math
import warnings

import pytest

import _tiny as tiny
import fasttrain

trl = pytest.importorskip("trl")

RTOL, ATOL = 1e-4, 1e-6  # DPO's rewards/* start at exactly 0
# bf16 autocast: both heads run the matmul in bf16 (8 bits of mantissa) but reduce in their own order; that
# ours runs under the same autocast is checked by structure (_assert_under_accelerate_autocast)
BF16_RTOL, BF16_ATOL = 1e-2, 5e-4


@pytest.fixture(autouse=True)
def _unpatched():
    fasttrain.unpatch()
    yield
    fasttrain.unpatch()


def _train(make, patched):
    if patched:
        fasttrain.patch()
    lm_head_calls = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = make()
        for model in (trainer.model, getattr(trainer, "ref_model", None)):
            if model is not None:
                model.get_output_embeddings().register_forward_hook(lambda *_: lm_head_calls.append(1))
        trainer.train()
    fasttrain.unpatch()
    return trainer, len(lm_head_calls)


def _assert_same_metrics(ref, ours, must_have, rtol=RTOL, atol=ATOL):
    ref_logs, our_logs = tiny.step_logs(ref), tiny.step_logs(ours)
    assert len(ref_logs) == len(our_logs) >= 2
    for step, (a, b) in enumerate(zip(ref_logs, our_logs, strict=True), start=1):
        assert a.keys() == b.keys() and must_have <= a.keys(), (step, sorted(a))
        for key, expected in a.items():
            if isinstance(expected, float) and math.isfinite(expected):
                assert abs(b[key] - expected) <= rtol * abs(expected) + atol, (step, key, b[key], expected)
            else:
                assert b[key] == expected, (step, key)


def _assert_under_accelerate_autocast(trainer, bf16):
    """Under mixed precision, fasttrain's forward sits where TRL's was: inside Accelerate's autocast wrapper."""
    from fasttrain.loss import trl_support

    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        original = model.__dict__.get("_original_forward")
        if not bf16:
            assert original is None
            continue
        assert getattr(original.__func__, "_fasttrain_trl_head", False), original
        assert trl_support._wraps(model.forward, original.__func__)


class MySFTTrainer(trl.SFTTrainer):
    """A user's subclass (its own hook on logging), as people write them."""

    def log(self, logs, *args, **kwargs):
        super().log(logs, *args, **kwargs)


@pytest.mark.parametrize(
    ("cls", "bf16"),
    [(trl.SFTTrainer, False), (MySFTTrainer, False), (trl.SFTTrainer, True)],
    ids=["SFTTrainer", "subclass", "SFTTrainer-bf16"],
)
def test_sft_under_patch(tmp_path, cls, bf16):
    def make():
        config = trl.SFTConfig(
            output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, logging_steps=1, report_to=[],
            save_strategy="no", use_cpu=True, bf16=bf16, seed=0, learning_rate=1e-3, max_length=64,
            disable_tqdm=True, **tiny.grouping_args(),
        )
        return cls(model=tiny.model("llama"), args=config,
                   train_dataset=tiny.text_dataset().select_columns(["text"]), processing_class=tiny.tokenizer())

    ref, _ = _train(make, patched=False)
    ours, lm_head_calls = _train(make, patched=True)
    assert ours.fasttrain_status == tiny.all_on_status()
    assert lm_head_calls == 0
    _assert_under_accelerate_autocast(ours, bf16)
    tol = (BF16_RTOL, BF16_ATOL) if bf16 else (RTOL, ATOL)
    _assert_same_metrics(ref, ours, {"loss", "mean_token_accuracy", "entropy", "num_tokens", "grad_norm"}, *tol)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_dpo_under_patch(tmp_path, bf16):
    def make():
        config = trl.DPOConfig(
            output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, logging_steps=1, report_to=[],
            save_strategy="no", use_cpu=True, bf16=bf16, seed=0, learning_rate=1e-3, max_length=48,
            disable_tqdm=True,
        )
        # a model built from a config has no hub name: TRL cannot reload it as the reference, so pass one
        return trl.DPOTrainer(model=tiny.model("llama"), ref_model=tiny.model("llama"), args=config,
                              train_dataset=tiny.text_dataset().select_columns(["prompt", "chosen", "rejected"]),
                              processing_class=tiny.tokenizer())

    ref, _ = _train(make, patched=False)
    ours, lm_head_calls = _train(make, patched=True)
    assert ours.fasttrain_status == {**tiny.all_on_status(), "sampler": "off: group_by_length is not set"}
    assert lm_head_calls == 0
    _assert_under_accelerate_autocast(ours, bf16)
    tol = (BF16_RTOL, BF16_ATOL) if bf16 else (RTOL, ATOL)
    _assert_same_metrics(ref, ours, {"loss", "rewards/chosen", "rewards/margins", "logps/chosen", "grad_norm"}, *tol)


def test_a_trl_trainer_whose_head_cannot_be_served_keeps_trls(tmp_path, monkeypatch):
    from fasttrain.loss import trl_support

    monkeypatch.setitem(trl_support.KERNEL_CHOICE, ("cpu", "sft"), "trl")

    def make():
        config = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                               save_strategy="no", use_cpu=True, bf16=False, max_length=64, disable_tqdm=True)
        return trl.SFTTrainer(model=tiny.model("llama"), args=config,
                              train_dataset=tiny.text_dataset().select_columns(["text"]),
                              processing_class=tiny.tokenizer())

    ours, _ = _train(make, patched=True)
    assert ours.fasttrain_status["loss"] == (
        "off: TRL's own fused LM head measured faster for sft on cpu (KERNEL_CHOICE)"
    )
