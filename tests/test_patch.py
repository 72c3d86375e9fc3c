"""fasttrain.patch() / unpatch(): unmodified scripts and Trainer subclasses (TRL) get the hot paths;
idempotent and fully reversible."""

from __future__ import annotations

import logging

import pytest
import transformers

import _tiny as tiny
import _truth
import fasttrain

pytestmark = [pytest.mark.dropin, pytest.mark.gpu_versions]


@pytest.fixture(autouse=True)
def _always_unpatched():
    fasttrain.unpatch()
    yield
    fasttrain.unpatch()


class _Quiet(transformers.TrainerCallback):
    """A user's callback, given as a class (the Trainer instantiates it)."""


class _Recorder(transformers.TrainerCallback):
    def __init__(self):
        self.events = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(sorted(logs))


def _observable(trainer, recorder, out):
    """What a user sees of a trained Trainer, with the numbers left out (parity tests compare those)."""
    return {
        "callbacks": [type(cb) for cb in trainer.callback_handler.callbacks],
        "args": {k: v for k, v in trainer.args.to_dict().items() if k not in ("output_dir", "logging_dir")},
        "log keys": recorder.events,
        "history keys": [sorted(h) for h in trainer.state.log_history],
        "checkpoint files": sorted(p.name for p in out.glob("checkpoint-*/*")),
        "optimizer_cls_and_kwargs": trainer.optimizer_cls_and_kwargs,
        "model_init": trainer.model_init,
    }


@pytest.mark.parametrize("disable_tqdm", [True, False])
@pytest.mark.parametrize("with_callback", [False, True])
def test_patched_trainer_looks_like_the_reference(tmp_path, disable_tqdm, with_callback):
    # transformers' own callback tests (default callbacks present, a custom callback added at init, the
    # printer callback when tqdm is disabled) look at exactly these lists
    seen = []
    for patched in (False, True):
        if patched:
            fasttrain.patch()
        out = tmp_path / str(patched)
        recorder = _Recorder()
        tok = tiny.tokenizer()
        trainer = transformers.Trainer(
            model=tiny.model("llama"),
            args=tiny.training_args(
                str(out), max_steps=2, save_strategy="steps", save_steps=2, disable_tqdm=disable_tqdm
            ),
            train_dataset=tiny.dataset(),
            data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
            processing_class=tok,
            callbacks=[recorder, _Quiet] if with_callback else [recorder],
        )
        before = [type(cb) for cb in trainer.callback_handler.callbacks]
        trainer.train()
        seen.append((before, _observable(trainer, recorder, out)))
        fasttrain.unpatch()
    (ref_before, ref), (ours_before, ours) = seen
    assert ours_before == ref_before
    assert ours == ref


def test_unpatch_restores_the_same_init_and_loss_mapping_is_never_touched():
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    original = transformers.Trainer.__dict__["__init__"]
    fasttrain.patch()
    fasttrain.patch()
    assert transformers.Trainer.__init__.__wrapped__ is original
    assert LOSS_MAPPING["ForCausalLM"] is ForCausalLMLoss
    fasttrain.unpatch()
    fasttrain.unpatch()
    assert transformers.Trainer.__dict__["__init__"] is original


def _train_plain(tmp_path, name, float64=False):
    tok = tiny.tokenizer()
    model = tiny.model("qwen3")
    trainer = transformers.Trainer(
        model=_truth.float64_twin(model) if float64 else model,
        args=tiny.training_args(str(tmp_path / name), train_sampling_strategy="group_by_length"),
        train_dataset=tiny.dataset(with_length=True),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    trainer.train()
    return trainer


def test_unmodified_script_gets_every_hot_path(tmp_path):
    ref = _train_plain(tmp_path, "ref")
    truth = _train_plain(tmp_path, "truth", float64=True)
    fasttrain.patch()
    ours = _train_plain(tmp_path, "ours")
    assert type(ours) is transformers.Trainer
    assert ours.fasttrain_status == tiny.all_on_status()
    _truth.assert_logs_near_truth(
        ours,
        ref,
        truth,
        _truth.FP32_STEP,
        keys=("loss", "grad_norm"),
        abs_floor={"loss": tiny.LOGGED_LOSS_ABS},
    )


def test_fasttrain_trainer_under_patch_is_not_doubled(tmp_path, caplog):
    fasttrain.patch(hot_paths=fasttrain.HotPaths(loss=False))
    tok = tiny.tokenizer()
    trainer = fasttrain.Trainer(
        model=tiny.model("llama"),
        args=tiny.training_args(str(tmp_path), max_steps=2),
        train_dataset=tiny.dataset(),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        trainer.train()
    # the seam ran once, with fasttrain.Trainer's own hot paths (all on), not patch()'s
    assert trainer.fasttrain_status == {**tiny.all_on_status(), "sampler": "off: group_by_length is not set"}
    assert len([r for r in caplog.records if "fasttrain hot paths" in r.getMessage()]) == 1
