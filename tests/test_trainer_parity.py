"""fasttrain.Trainer against transformers.Trainer, end to end on CPU: loss and grad_norm at every step.

Both trainers see the same model weights, data, seed and arguments; only the Trainer class differs. fp32
runs must agree within 1e-5 relative at every logged step (gradient accumulation, clipping, prompt-masked
labels and group_by_length included); the final weights within the same tolerance.
"""

from __future__ import annotations

import pytest
import transformers

import _tiny as tiny
import fasttrain
from fasttrain.hot_paths import HotPaths

RTOL = 1e-5
UPDATE_RTOL = 1e-4  # measured ~1e-6: the fused loss sums its chunks in another order


def _train(trainer_cls, kind: str, tmp_path, collator=None, hot_paths=None, **arg_overrides):
    tok = tiny.tokenizer()
    model = tiny.model(kind)
    kwargs = {} if hot_paths is None else {"hot_paths": hot_paths}
    trainer = trainer_cls(
        model=model,
        args=tiny.training_args(str(tmp_path / trainer_cls.__module__), **arg_overrides),
        train_dataset=tiny.dataset(with_length=True),
        data_collator=collator or transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
        **kwargs,
    )
    trainer.train()
    return trainer


def _compare(ref, ours, kind="llama", rtol=RTOL, update_rtol=UPDATE_RTOL):
    assert len(tiny.step_logs(ref)) == ref.args.max_steps
    tiny.assert_same_logs(ref, ours, rtol)
    tiny.assert_same_updates(ours.model, ref.model, tiny.model(kind), update_rtol)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fp32_parity_every_step(kind, tmp_path):
    common = dict(train_sampling_strategy="group_by_length")
    ref = _train(transformers.Trainer, kind, tmp_path, **common)
    ours = _train(fasttrain.Trainer, kind, tmp_path, **common)
    _compare(ref, ours, kind)
    assert ours.fasttrain_status == tiny.all_on_status()


def test_no_clipping_and_random_sampler(tmp_path):
    common = dict(max_grad_norm=0.0, gradient_accumulation_steps=1)
    ref = _train(transformers.Trainer, "llama", tmp_path, **common)
    ours = _train(fasttrain.Trainer, "llama", tmp_path, **common)
    _compare(ref, ours)
    assert ours.fasttrain_status["sampler"] == "off: group_by_length is not set"
    assert ours.fasttrain_status["clip"] in ("off: max_grad_norm=0.0: no clipping", tiny.all_on_status()["clip"])


def test_every_hot_path_switched_off_is_the_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTTRAIN_DISABLE", "all")
    ref = _train(transformers.Trainer, "llama", tmp_path)
    ours = _train(fasttrain.Trainer, "llama", tmp_path)
    _compare(ref, ours, rtol=0, update_rtol=0)
    assert all(v == "off: switched off" for v in ours.fasttrain_status.values()), ours.fasttrain_status


@pytest.mark.parametrize("off", HotPaths.names())
def test_each_hot_path_switches_off_alone(off, tmp_path):
    paths = HotPaths(**{off: False})
    ours = _train(fasttrain.Trainer, "llama", tmp_path, hot_paths=paths, max_steps=2,
                  train_sampling_strategy="group_by_length")
    expected = {**tiny.all_on_status(), off: "off: switched off"}
    if off == "optimizer":
        expected["clip"] = "off: the optimizer hot path is switched off"
    assert ours.fasttrain_status == expected


def test_bf16_close_to_reference(tmp_path):
    # bf16 autocast on CPU: both runs round identically in the model; the fused loss keeps its logits in
    # fp32 where the reference rounds them to bf16 first, so the losses agree to bf16 resolution only.
    ref = _train(transformers.Trainer, "llama", tmp_path, bf16=True)
    ours = _train(fasttrain.Trainer, "llama", tmp_path, bf16=True)
    for a, b in zip(tiny.step_logs(ref), tiny.step_logs(ours), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)


def test_user_collate_function_is_kept(tmp_path):
    tok = tiny.tokenizer()
    seq2seq = transformers.DataCollatorForSeq2Seq(tok, padding=True)

    def collate(features):
        return seq2seq(features)

    ours = _train(fasttrain.Trainer, "llama", tmp_path, collator=collate, max_steps=1)
    assert ours.data_collator is collate
    assert ours.fasttrain_status["collator"] == (
        "off: test_trainer_parity.test_user_collate_function_is_kept.<locals>.collate has no native equivalent"
    )


def test_prediction_loss_only_evaluation_matches(tmp_path, monkeypatch):
    from fasttrain.loss import model_patch

    fused_calls = []
    real = model_patch.fused_linear_cross_entropy
    monkeypatch.setattr(
        model_patch, "fused_linear_cross_entropy", lambda *a, **k: fused_calls.append(1) or real(*a, **k)
    )
    tok = tiny.tokenizer()
    results = []
    for cls in (transformers.Trainer, fasttrain.Trainer):
        trainer = cls(
            model=tiny.model("llama"),
            args=tiny.training_args(str(tmp_path / cls.__module__), prediction_loss_only=True),
            eval_dataset=tiny.dataset(n=10),
            data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
            processing_class=tok,
        )
        results.append(trainer.evaluate()["eval_loss"])
    assert results[1] == pytest.approx(results[0], rel=RTOL)
    # 10 rows at eval batch size 8: both batches took the fused path, the first one included
    assert len(fused_calls) == 2


def test_evaluation_with_logits_keeps_them(tmp_path):
    tok = tiny.tokenizer()
    trainer = fasttrain.Trainer(
        model=tiny.model("llama"),
        args=tiny.training_args(str(tmp_path), max_steps=1),
        train_dataset=tiny.dataset(n=8),
        eval_dataset=tiny.dataset(n=6),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    trainer.train()
    out = trainer.predict(tiny.dataset(n=6))
    assert out.predictions is not None and out.predictions.shape[-1] == tiny.VOCAB


def test_model_init_and_gradient_checkpointing(tmp_path):
    # model_init builds the model inside train(): the fused loss must wrap that model, not a stale one
    common = dict(max_steps=3, gradient_checkpointing=True)
    tok = tiny.tokenizer()
    runs = []
    for cls in (transformers.Trainer, fasttrain.Trainer):
        trainer = cls(
            model_init=lambda: tiny.model("llama"),
            args=tiny.training_args(str(tmp_path / cls.__module__), **common),
            train_dataset=tiny.dataset(),
            data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
            processing_class=tok,
        )
        trainer.train()
        runs.append(trainer)
    ref, ours = runs
    assert ours.fasttrain_status["loss"] == "on", ours.fasttrain_status
    from fasttrain.loss.model_patch import fused_loss_enabled

    assert fused_loss_enabled(ours.model)
    tiny.assert_same_logs(ref, ours, RTOL)


@pytest.mark.slow
def test_torch_compile_keeps_working(tmp_path):
    # torch.compile wraps the model; the fused loss is a compiler-disabled region inside the wrapped forward
    ref = _train(transformers.Trainer, "llama", tmp_path, torch_compile=True, max_steps=2)
    ours = _train(fasttrain.Trainer, "llama", tmp_path, torch_compile=True, max_steps=2)
    assert ours.fasttrain_status["loss"] == "on", ours.fasttrain_status
    for a, b in zip(tiny.step_logs(ref), tiny.step_logs(ours), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
