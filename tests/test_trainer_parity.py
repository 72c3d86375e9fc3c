"""fasttrain.Trainer against transformers.Trainer, end to end on CPU: loss and grad_norm at every step.

Both trainers see the same model weights, data, seed and arguments; only the Trainer class differs. A third
run, the reference Trainer with the model in float64, is the truth: at every logged step (gradient accumulation,
clipping, prompt-masked labels and group_by_length included) and in the final weights, fasttrain must be about
as close to it as the reference is (``_truth``: a fixed bound between two float32 runs fails on CPUs that round
differently while both are equally exact).
"""

from __future__ import annotations

import pytest
import transformers

import _tiny as tiny
import _truth
import fasttrain
from fasttrain.hot_paths import HotPaths

pytestmark = [pytest.mark.dropin, pytest.mark.gpu_versions, pytest.mark.numeric]

# transformers < 5 logs the loss rounded to 4 decimals: the truth is rounded too
LOG_FLOOR = {"loss": tiny.LOGGED_LOSS_ABS}


def _train(trainer_cls, kind: str, tmp_path, collator=None, hot_paths=None, truth=False, **arg_overrides):
    """``truth``: the reference Trainer on the float64 twin of the same model (fasttrain off)."""
    tok = tiny.tokenizer()
    model = tiny.model(kind)
    if truth:
        trainer_cls, model = transformers.Trainer, _truth.float64_twin(model)
    kwargs = {} if hot_paths is None else {"hot_paths": hot_paths}
    trainer = trainer_cls(
        model=model,
        args=tiny.training_args(str(tmp_path / f"{trainer_cls.__module__}-{truth}"), **arg_overrides),
        train_dataset=tiny.dataset(with_length=True),
        data_collator=collator or transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
        **kwargs,
    )
    trainer.train()
    return trainer


def _compare(ref, ours, truth):
    assert len(tiny.step_logs(ref)) == ref.args.max_steps
    # transformers < 5 logs no grad_norm without clipping (assert_logs_near_truth checks all three log the same keys)
    keys = ("loss", "grad_norm") if "grad_norm" in tiny.step_logs(ref)[0] else ("loss",)
    _truth.assert_logs_near_truth(ours, ref, truth, _truth.FP32_STEP, keys=keys, abs_floor=LOG_FLOOR)
    _truth.assert_params_near_truth(ours.model, ref.model, truth.model)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fp32_parity_every_step(kind, tmp_path):
    common = dict(train_sampling_strategy="group_by_length")
    ref = _train(transformers.Trainer, kind, tmp_path, **common)
    ours = _train(fasttrain.Trainer, kind, tmp_path, **common)
    _compare(ref, ours, _train(None, kind, tmp_path, truth=True, **common))
    assert ours.fasttrain_status == tiny.all_on_status()


def test_no_clipping_and_random_sampler(tmp_path):
    common = dict(max_grad_norm=0.0, gradient_accumulation_steps=1)
    ref = _train(transformers.Trainer, "llama", tmp_path, **common)
    ours = _train(fasttrain.Trainer, "llama", tmp_path, **common)
    _compare(ref, ours, _train(None, "llama", tmp_path, truth=True, **common))
    assert ours.fasttrain_status["sampler"] == "off: group_by_length is not set"
    assert ours.fasttrain_status["clip"] in (
        "off: max_grad_norm=0.0: no clipping",
        tiny.all_on_status()["clip"],
    )


def test_every_hot_path_switched_off_is_the_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTTRAIN_DISABLE", "all")
    ref = _train(transformers.Trainer, "llama", tmp_path)
    ours = _train(fasttrain.Trainer, "llama", tmp_path)
    # identical code: identical numbers, no rounding to allow for
    tiny.assert_same_logs(ref, ours, 0)
    tiny.assert_same_updates(ours.model, ref.model, tiny.model("llama"), 0)
    assert all(v == "off: switched off" for v in ours.fasttrain_status.values()), ours.fasttrain_status


@pytest.mark.parametrize("off", HotPaths.names())
def test_each_hot_path_switches_off_alone(off, tmp_path):
    paths = HotPaths(**{off: False})
    ours = _train(
        fasttrain.Trainer,
        "llama",
        tmp_path,
        hot_paths=paths,
        max_steps=2,
        train_sampling_strategy="group_by_length",
    )
    expected = {**tiny.all_on_status(), off: "off: switched off"}
    if off == "optimizer":
        expected["clip"] = "off: the optimizer hot path is switched off"
    assert ours.fasttrain_status == expected


def test_bf16_close_to_reference(tmp_path):
    # bf16 autocast on CPU: both runs round identically in the model; the fused loss keeps its logits in
    # fp32 where the reference rounds them to bf16 first: both are bf16 runs, the truth is float64 without autocast
    ref = _train(transformers.Trainer, "llama", tmp_path, bf16=True)
    ours = _train(fasttrain.Trainer, "llama", tmp_path, bf16=True)
    truth = _train(None, "llama", tmp_path, truth=True, bf16=False)
    _truth.assert_logs_near_truth(
        ours, ref, truth, _truth.BF16_STEP, keys=("loss", "grad_norm"), abs_floor=LOG_FLOOR
    )


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
    runs = [
        (transformers.Trainer, tiny.model("llama")),
        (fasttrain.Trainer, tiny.model("llama")),
        (transformers.Trainer, _truth.float64_twin(tiny.model("llama"))),
    ]
    for index, (cls, model) in enumerate(runs):
        trainer = cls(
            model=model,
            args=tiny.training_args(str(tmp_path / str(index)), prediction_loss_only=True),
            eval_dataset=tiny.dataset(n=10),
            data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
            processing_class=tok,
        )
        results.append(trainer.evaluate()["eval_loss"])
    ref, ours, truth = results
    _truth.assert_scalar_near_truth("eval_loss", ours, ref, truth, _truth.FP32_STEP)
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
    for cls, init in (
        (transformers.Trainer, lambda: tiny.model("llama")),
        (fasttrain.Trainer, lambda: tiny.model("llama")),
        (transformers.Trainer, lambda: _truth.float64_twin(tiny.model("llama"))),
    ):
        trainer = cls(
            model_init=init,  # no argument: the Trainer would pass it a trial
            args=tiny.training_args(str(tmp_path / f"{cls.__module__}-{len(runs)}"), **common),
            train_dataset=tiny.dataset(),
            data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
            processing_class=tok,
        )
        trainer.train()
        runs.append(trainer)
    ref, ours, truth = runs
    assert ours.fasttrain_status["loss"] == "on", ours.fasttrain_status
    from fasttrain.integration.loss import fused_forwards
    from fasttrain.loss.model_patch import fused_loss_enabled

    # the model model_init built took the fused loss at every micro-batch, and has its own forward back after
    assert fused_forwards(ours) == 3 * ours.args.gradient_accumulation_steps
    assert not fused_loss_enabled(ours.model)
    _truth.assert_logs_near_truth(
        ours, ref, truth, _truth.FP32_STEP, keys=("loss", "grad_norm"), abs_floor=LOG_FLOOR
    )


@pytest.mark.slow
def test_torch_compile_keeps_working(tmp_path):
    # torch.compile wraps the model; the fused loss is a compiler-disabled region inside the wrapped forward
    ref = _train(transformers.Trainer, "llama", tmp_path, torch_compile=True, max_steps=2)
    ours = _train(fasttrain.Trainer, "llama", tmp_path, torch_compile=True, max_steps=2)
    assert ours.fasttrain_status["loss"] == "on", ours.fasttrain_status
    # the truth is not compiled: compiling changes the order of rounding, not the math
    truth = _train(None, "llama", tmp_path, truth=True, max_steps=2)
    _truth.assert_logs_near_truth(ours, ref, truth, _truth.FP32_STEP, keys=("loss",), abs_floor=LOG_FLOOR)
