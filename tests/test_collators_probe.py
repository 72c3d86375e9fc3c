"""The native collators cannot silently drift from transformers' (``fasttrain.data.collator_probe``).

At the installed transformers every probe agrees and the native classes run natively. A simulated upstream change
(a field the native path does not know, or a collator whose batches change) makes ``native_equivalent`` keep
transformers' collator with the reason logged once, the Trainer's status says ``collator: off: <reason>``, and a
native class used directly returns transformers' own batches. The probe runs once per process and class.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from transformers.data import data_collator as hf

import _tiny as tiny
import fasttrain
from _collator_cases import assert_same, clone, make_tokenizer
from fasttrain import _logging as fasttrain_logging
from fasttrain.data import collator_probe
from fasttrain.data import collators as ft

PAIRS = [
    (hf.DataCollatorWithPadding, ft.DataCollatorWithPadding),
    (hf.DataCollatorForLanguageModeling, ft.DataCollatorForLanguageModeling),
    (hf.DataCollatorForSeq2Seq, ft.DataCollatorForSeq2Seq),
    (hf.DataCollatorWithFlattening, ft.DataCollatorWithFlattening),
]
IDS = [theirs.__name__ for theirs, _ in PAIRS]
# labels of equal lengths: the padding collator passes them through unpadded
FEATURES = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9, 10], "labels": [8, 9, 10]}]


def make(cls: type, **kwargs):
    """An instance of a collator class of either library, with settings the native path serves."""
    if issubclass(cls, hf.DataCollatorWithFlattening):
        return cls(**kwargs)
    if issubclass(cls, hf.DataCollatorForLanguageModeling):
        kwargs.setdefault("mlm", False)
    return cls(make_tokenizer("left"), **kwargs)


@pytest.fixture(autouse=True)
def fresh_probe(monkeypatch):
    """Each test starts with no probe cached and nothing logged, and leaves no simulated verdict behind."""
    monkeypatch.setattr(fasttrain_logging, "_said", set())
    collator_probe._probe.cache_clear()
    yield
    collator_probe._probe.cache_clear()


@pytest.mark.parametrize(("theirs", "ours"), PAIRS, ids=IDS)
def test_probes_agree_at_the_installed_transformers(theirs, ours, caplog):
    with caplog.at_level(logging.WARNING, logger="fasttrain"):
        assert collator_probe.refusal(make(ours)) is None
        twin = ft.native_equivalent(make(theirs))
    assert type(twin) is ours
    assert not caplog.records


@pytest.mark.parametrize(("theirs", "ours"), PAIRS, ids=IDS)
def test_a_field_the_native_path_does_not_know_keeps_transformers_collator(theirs, ours, monkeypatch, caplog):
    """A transformers release that adds a setting: simulated by an __init__ that sets one more attribute."""
    original_init = theirs.__init__

    def init_with_new_field(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.pad_on_both_sides = True

    monkeypatch.setattr(theirs, "__init__", init_with_new_field)
    collator = make(theirs)
    with caplog.at_level(logging.WARNING, logger="fasttrain"):
        assert ft.native_equivalent(collator) is None
        reason = ft.why_no_native_equivalent(collator)
        assert ft.native_equivalent(collator) is None  # asked again: logged once only
    assert reason == (
        f"transformers {transformers.__version__}'s {theirs.__name__} has fields fasttrain's native path does "
        "not know: ['pad_on_both_sides']"
    )
    assert [r.getMessage() for r in caplog.records] == [
        f"fasttrain: {reason}; transformers' {theirs.__name__} is used (logged once)"
    ]
    # our class itself, built by the same (simulated) __init__, hands every batch to transformers' code
    native = make(ours)
    assert collator_probe.refusal(native) == reason
    assert_same(native(clone(FEATURES)), collator(clone(FEATURES)))


def _changed_output(theirs: type, monkeypatch) -> None:
    """Simulates a transformers release whose collator returns other batches: its labels are shifted by one."""
    name = "torch_call" if theirs is hf.DataCollatorForLanguageModeling else "__call__"
    original = getattr(theirs, name)

    def changed(self, *args, **kwargs):
        batch = original(self, *args, **kwargs)
        batch["labels"] = batch["labels"] + 1
        return batch

    monkeypatch.setattr(theirs, name, changed)


@pytest.mark.parametrize(("theirs", "ours"), PAIRS, ids=IDS)
def test_a_collator_that_makes_other_batches_keeps_transformers_collator(theirs, ours, monkeypatch, caplog):
    _changed_output(theirs, monkeypatch)
    collator = make(theirs)
    with caplog.at_level(logging.WARNING, logger="fasttrain"):
        assert ft.native_equivalent(collator) is None
        reason = ft.why_no_native_equivalent(collator)
    prefix = (
        f"transformers {transformers.__version__}'s {theirs.__name__} makes other batches than fasttrain's: "
    )
    assert reason.startswith(prefix) and "'labels' holds other values" in reason
    assert [r.getMessage() for r in caplog.records] == [
        f"fasttrain: {reason}; transformers' {theirs.__name__} is used (logged once)"
    ]
    native = make(ours)
    batch = native(clone(FEATURES))
    assert_same(batch, collator(clone(FEATURES)))  # transformers' own batch, shifted labels included
    assert torch.equal(batch["labels"], make(ours)._native_call(clone(FEATURES))["labels"] + 1)


def test_the_status_says_why_the_collator_is_off(monkeypatch, tmp_path):
    _changed_output(hf.DataCollatorForSeq2Seq, monkeypatch)
    collator = hf.DataCollatorForSeq2Seq(tiny.tokenizer(), padding=True)
    trainer = fasttrain.Trainer(
        model=tiny.model("llama"),
        args=tiny.training_args(str(tmp_path), max_steps=1),
        train_dataset=tiny.dataset(),
        data_collator=collator,
    )
    assert trainer.data_collator is collator
    assert trainer.fasttrain_status["collator"] == f"off: {ft.why_no_native_equivalent(collator)}"
    assert "makes other batches than fasttrain's" in trainer.fasttrain_status["collator"]
    # a class fasttrain replaces, kept only because it drifted: a fallback (the status line is a WARNING)
    assert "collator" in fasttrain.integration.seam_of(trainer).fallbacks


def test_the_probe_runs_once_per_process_and_class(monkeypatch):
    """The first use runs transformers' collator on the probes; later collators and batches do not."""
    calls = []
    original = hf.DataCollatorWithPadding.__call__

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(hf.DataCollatorWithPadding, "__call__", counting)
    native = ft.native_equivalent(make(hf.DataCollatorWithPadding))
    probes = len(calls)
    assert probes > 0 and type(native) is ft.DataCollatorWithPadding
    for _ in range(3):
        ft.native_equivalent(make(hf.DataCollatorWithPadding))
        native(clone(FEATURES))
    assert len(calls) == probes
    assert collator_probe._probe.cache_info().misses == 1
    # another transformers version in the same process (a reload) is probed again
    installed = collator_probe.transformers  # the module object the probe reads the version from
    monkeypatch.setattr(installed, "__version__", installed.__version__ + "+other")
    assert type(ft.native_equivalent(make(hf.DataCollatorWithPadding))) is ft.DataCollatorWithPadding
    assert len(calls) == 2 * probes
