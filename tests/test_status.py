"""Every status is true: a path reads "on" exactly when a detector saw fasttrain's code run in its place.

Detectors watch what ran during a short training: the optimizer's class; calls of ``Accelerator.clip_grad_norm_``
(the reference clip); calls of the ``lm_head`` module (the logits the fused loss never makes); calls of the
transformers collator's ``__call__``; iterations of transformers' ``LengthGroupedSampler``; training forwards of
a packed batch (one row, no attention mask; with sdpa a batch packs where that costs no more attention, so a run
may mix packed and padded batches). Each is checked with
every path on and with each path switched off alone, through ``HotPaths`` and through ``FASTTRAIN_DISABLE``,
under ``fasttrain.Trainer`` and under ``fasttrain.patch()``, and for a plain Trainer after ``unpatch()``.
"""

from __future__ import annotations

import collections

import accelerate
import pytest
import torch
import transformers
from transformers import trainer_pt_utils

import _tiny as tiny
import fasttrain
from fasttrain import FusedAdamW, HotPaths
from fasttrain.data.collators import native_equivalent

pytestmark = [pytest.mark.dropin, pytest.mark.gpu_versions]


@pytest.fixture(autouse=True)
def _unpatched():
    fasttrain.unpatch()
    yield
    fasttrain.unpatch()


@pytest.fixture
def seen(monkeypatch):
    """Counts of reference code that ran: clip, collator, sampler (the lm_head is hooked per model)."""
    counts = collections.Counter()
    # fasttrain's collator check runs transformers' collator on its probes once per process: not a batch
    native_equivalent(transformers.DataCollatorForSeq2Seq(tiny.tokenizer()))

    def counting(key, original):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        accelerate.Accelerator, "clip_grad_norm_", counting("clip", accelerate.Accelerator.clip_grad_norm_)
    )
    monkeypatch.setattr(
        transformers.DataCollatorForSeq2Seq,
        "__call__",
        counting("collator", transformers.DataCollatorForSeq2Seq.__call__),
    )
    monkeypatch.setattr(
        trainer_pt_utils.LengthGroupedSampler,
        "__iter__",
        counting("sampler", trainer_pt_utils.LengthGroupedSampler.__iter__),
    )
    return counts


def _train(make_trainer, seen, tmp_path):
    tok = tiny.tokenizer()
    model = tiny.model("llama")
    model.lm_head.register_forward_hook(lambda *_: seen.update(["lm_head"]))

    def packed_forward(module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        if module.training and ids.shape[0] == 1 and kwargs.get("attention_mask") is None:
            seen.update(["packed_forward"])

    model.register_forward_pre_hook(packed_forward, with_kwargs=True)
    trainer = make_trainer(
        model=model,
        args=tiny.training_args(str(tmp_path), max_steps=2, train_sampling_strategy="group_by_length"),
        train_dataset=tiny.dataset(with_length=True),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    trainer.train()
    return trainer


def _what_ran(trainer, seen) -> dict[str, bool]:
    """Per hot path: did fasttrain's code run in place of the reference (from the detectors alone)?"""
    optimizer = trainer.optimizer
    while not isinstance(optimizer, (FusedAdamW, torch.optim.AdamW)):
        optimizer = optimizer.optimizer
    return {
        "optimizer": isinstance(optimizer, FusedAdamW),
        "clip": seen["clip"] == 0,
        "loss": seen["lm_head"] == 0,
        "collator": seen["collator"] == 0 and type(trainer.data_collator).__module__.startswith("fasttrain."),
        "sampler": seen["sampler"] == 0,
        "packing": seen["packed_forward"] > 0,
    }


CASES = [None, *[(name, via) for name in HotPaths.names() for via in ("hot_paths", "env")]]


@pytest.mark.parametrize("entry", ["class", "patch"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "all-on" if c is None else f"{c[0]}-off-by-{c[1]}")
def test_status_says_what_ran(entry, case, seen, tmp_path, monkeypatch):
    paths = None
    if case is not None:
        name, via = case
        if via == "env":
            monkeypatch.setenv("FASTTRAIN_DISABLE", name)
        else:
            paths = HotPaths(**{name: False})
    if entry == "class":

        def make(**kwargs):
            return fasttrain.Trainer(hot_paths=paths, **kwargs)
    else:
        fasttrain.patch(hot_paths=paths)
        make = transformers.Trainer
    trainer = _train(make, seen, tmp_path)
    ran = _what_ran(trainer, seen)
    status = trainer.fasttrain_status
    for path, did_run in ran.items():
        assert (status[path] == "on") == did_run, (path, status, dict(seen))
    off = set() if case is None else {case[0]} | ({"clip"} if case[0] == "optimizer" else set())
    if not hasattr(transformers.Trainer, "_clip_grad_norm"):  # transformers < 5 clips inside its loop
        off.add("clip")
        assert status["clip"] in (
            "off: switched off",
            "off: the optimizer hot path is switched off",
            tiny.all_on_status()["clip"],
        ), status
    if (
        not tiny.PACKING
    ):  # transformers < 5 counts num_items_in_batch over unshifted labels: batches stay padded
        off.add("packing")
        assert status["packing"] in ("off: switched off", tiny.all_on_status()["packing"]), status
    assert {path for path, did_run in ran.items() if not did_run} == off, (status, dict(seen))
    if case is not None:
        assert status[case[0]] == "off: switched off"


def test_after_unpatch_a_trainer_is_the_reference(seen, tmp_path):
    fasttrain.patch()
    fasttrain.unpatch()
    trainer = _train(transformers.Trainer, seen, tmp_path)
    assert not hasattr(trainer, "fasttrain_status")
    assert not any(_what_ran(trainer, seen).values()), dict(seen)


def test_patch_twice_changes_only_the_hot_paths(seen, tmp_path):
    original = transformers.Trainer.__init__
    fasttrain.patch()
    patched = transformers.Trainer.__init__
    fasttrain.patch(hot_paths=HotPaths(loss=False))
    assert transformers.Trainer.__init__ is patched is not original
    trainer = _train(transformers.Trainer, seen, tmp_path)
    assert trainer.fasttrain_status["loss"] == "off: switched off" and seen["lm_head"] > 0
    fasttrain.unpatch()
    assert transformers.Trainer.__init__ is original
