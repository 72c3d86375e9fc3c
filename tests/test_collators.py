"""Parity of fasttrain's Rust collators with the transformers classes of the same name.

Every comparison is byte-level: same return type, same keys in the same order, and for each value
the same type, dtype, shape and values (``torch.equal`` / ``np.array_equal``). Batches are drawn by
hypothesis over the settings that change the output (padding strategy, max_length,
pad_to_multiple_of, padding side, return_tensors, input container, extra keys). When transformers
raises, ours must raise too (a ValueError/TypeError/KeyError, never a Rust panic).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

import fasttrain
from _collator_cases import (
    PAD_ID,
    as_container,
    assert_same,
    clone,
    flattening_batches,
    make_tokenizer,
    padded_batches,
    run_both,
    seq2seq_batches,
    token,
)
from fasttrain import _logging as fasttrain_logging
from fasttrain.data import collators as ft

# FASTTRAIN_HYPOTHESIS_EXAMPLES=2000 for a longer search than the CI default.
SETTINGS = settings(
    max_examples=int(os.environ.get("FASTTRAIN_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


paddings = st.sampled_from([True, "longest", "max_length", False, "do_not_pad"])
max_lengths = st.one_of(st.none(), st.integers(0, 14))
multiples = st.sampled_from([None, 1, 3, 8])
sides = st.sampled_from(["right", "left"])
tensors = st.sampled_from(["pt", "np"])


@SETTINGS
@given(padded_batches(), paddings, max_lengths, multiples, sides, tensors, st.booleans())
def test_with_padding_matches_transformers(features, padding, max_length, multiple, side, rt, token_types):
    tok = make_tokenizer(side, token_type_ids=token_types)
    args = {
        "padding": padding,
        "max_length": max_length,
        "pad_to_multiple_of": multiple,
        "return_tensors": rt,
    }
    run_both(
        ft.DataCollatorWithPadding(tok, **args), transformers.DataCollatorWithPadding(tok, **args), features
    )


@SETTINGS
@given(padded_batches(), multiples, sides, tensors)
def test_causal_lm_matches_transformers(features, multiple, side, rt):
    tok = make_tokenizer(side)
    args = {"mlm": False, "pad_to_multiple_of": multiple, "return_tensors": rt}
    err = run_both(
        ft.DataCollatorForLanguageModeling(tok, **args),
        transformers.DataCollatorForLanguageModeling(tok, **args),
        features,
    )
    assert err is None


@SETTINGS
@given(seq2seq_batches(), paddings, max_lengths, multiples, sides, tensors, st.sampled_from([-100, 0, 7]))
def test_seq2seq_matches_transformers(features, padding, max_length, multiple, side, rt, label_pad):
    tok = make_tokenizer(side)
    args = {
        "padding": padding,
        "max_length": max_length,
        "pad_to_multiple_of": multiple,
        "label_pad_token_id": label_pad,
        "return_tensors": rt,
    }
    run_both(
        ft.DataCollatorForSeq2Seq(tok, **args), transformers.DataCollatorForSeq2Seq(tok, **args), features
    )


class ShiftRightModel:
    """Stands in for an encoder-decoder model: only prepare_decoder_input_ids_from_labels is used."""

    def prepare_decoder_input_ids_from_labels(self, labels):
        shifted = torch.full_like(labels, 1)
        shifted[:, 1:] = labels[:, :-1].clamp(min=0)
        return shifted


def test_seq2seq_decoder_input_ids_come_from_the_model():
    tok = make_tokenizer()
    features = [{"input_ids": [5, 6, 7], "labels": [8, 9]}, {"input_ids": [5], "labels": [10, 11, 12]}]
    args = {"model": ShiftRightModel(), "pad_to_multiple_of": 4}
    ref = transformers.DataCollatorForSeq2Seq(tok, **args)(clone(features))
    ours = ft.DataCollatorForSeq2Seq(tok, **args)(clone(features))
    assert "decoder_input_ids" in ref
    assert_same(ours, ref)


def test_seq2seq_without_labels_returns_labels_none():
    tok = make_tokenizer()
    for features in ([{"input_ids": [5, 6]}, {"input_ids": [7]}], [{"input_ids": [5], "labels": None}]):
        assert_same(
            ft.DataCollatorForSeq2Seq(tok)(clone(features)),
            transformers.DataCollatorForSeq2Seq(tok)(clone(features)),
        )


@SETTINGS
@given(
    flattening_batches(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from([-100, 0, 5]),
    st.sampled_from([0, 2]),
    tensors,
    st.sampled_from([None, -1]),
)
def test_flattening_matches_transformers(features, pos, flash, seq_idx, sep, start, rt, call_sep):
    args = {
        "return_position_ids": pos,
        "return_flash_attn_kwargs": flash,
        "return_seq_idx": seq_idx,
        "separator_id": sep,
        "position_ids_start": start,
        "return_tensors": rt,
    }
    run_both(
        ft.DataCollatorWithFlattening(**args),
        transformers.DataCollatorWithFlattening(**args),
        features,
        separator_id=call_sep,
    )


def test_flattening_cu_seq_lens_are_not_aliased():
    batch = ft.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": [5, 6]}, {"input_ids": [7]}]
    )
    batch["cu_seq_lens_q"][0] = 99
    assert batch["cu_seq_lens_k"][0] == 0


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("multiple", [None, 8])
def test_pad_to_multiple_adds_no_block_when_aligned(side, multiple):
    tok = make_tokenizer(side)
    features = [{"input_ids": list(range(5, 13))}, {"input_ids": [5, 6, 7]}]  # longest is 8
    ours = ft.DataCollatorWithPadding(tok, pad_to_multiple_of=multiple)(clone(features))
    assert ours["input_ids"].shape == (2, 8)
    assert_same(ours, transformers.DataCollatorWithPadding(tok, pad_to_multiple_of=multiple)(clone(features)))


def test_label_and_label_ids_renaming():
    tok = make_tokenizer()
    for extra in ({"label": 1}, {"label_ids": [1, 2]}, {"label": 0.5}):
        features = [{"input_ids": [5, 6], **extra}, {"input_ids": [7], **extra}]
        ours = ft.DataCollatorWithPadding(tok)(clone(features))
        assert "labels" in ours
        assert_same(ours, transformers.DataCollatorWithPadding(tok)(clone(features)))


def test_long_random_batch_matches():
    """A batch like the benchmark's: 64 examples, lengths 16-2048, all token keys."""
    rng = np.random.default_rng(0)
    tok = make_tokenizer("left")
    features = []
    for n in rng.integers(16, 2049, 64):
        features.append(
            {
                "input_ids": rng.integers(0, 30_000, n).tolist(),
                "token_type_ids": rng.integers(0, 2, n).tolist(),
                "attention_mask": [1] * n,
                "special_tokens_mask": [0] * n,
                "label": int(rng.integers(0, 3)),
            }
        )
    args = {"pad_to_multiple_of": 64}
    assert_same(
        ft.DataCollatorWithPadding(tok, **args)(clone(features)),
        transformers.DataCollatorWithPadding(tok, **args)(clone(features)),
    )


def test_no_pad_token_raises_like_transformers():
    tok = make_tokenizer(pad=False)
    features = [{"input_ids": [5, 6]}, {"input_ids": [7]}]
    with pytest.raises(ValueError) as ref:
        transformers.DataCollatorWithPadding(tok)(clone(features))
    with pytest.raises(ValueError) as ours:
        ft.DataCollatorWithPadding(tok)(clone(features))
    assert str(ours.value) == str(ref.value)
    for cls in (ft.DataCollatorForSeq2Seq, ft.DataCollatorForLanguageModeling):
        kwargs = {"mlm": False} if cls is ft.DataCollatorForLanguageModeling else {}
        with pytest.raises(ValueError, match="padding token"):
            cls(tok, **kwargs)(clone(features))
    # no padding asked for: no pad token needed
    same = [{"input_ids": [5, 6]}, {"input_ids": [7, 8]}]
    assert_same(
        ft.DataCollatorWithPadding(tok, padding=False)(clone(same)),
        transformers.DataCollatorWithPadding(tok, padding=False)(clone(same)),
    )


def test_mlm_hands_over_to_transformers_and_logs_once(caplog, monkeypatch):
    monkeypatch.setattr(fasttrain_logging, "_said", set())
    tok = make_tokenizer()
    features = [{"input_ids": list(range(5, 30))}, {"input_ids": list(range(5, 20))}]
    ours = ft.DataCollatorForLanguageModeling(tok, seed=7)
    ref = transformers.DataCollatorForLanguageModeling(tok, seed=7)
    with caplog.at_level(logging.WARNING, logger="fasttrain"):
        for _ in range(3):
            assert_same(ours(clone(features)), ref(clone(features)))
    handover = [r for r in caplog.records if "mlm=True" in r.getMessage()]
    assert len(handover) == 1


@SETTINGS
@given(
    # no empty rows: transformers crashes on them with left padding (result[i, -0:] is the whole row)
    st.lists(st.lists(token, min_size=1, max_size=12), min_size=1, max_size=6),
    st.sampled_from(["list", "tuple", "np64", "np32"]),
    multiples,
    sides,
    tensors,
    st.booleans(),
)
def test_causal_lm_on_bare_sequences(rows, container, multiple, side, rt, pad):
    """Examples that are token sequences, not mappings (transformers' _torch/_numpy_collate_batch)."""
    tok = make_tokenizer(side, pad=pad)
    examples = [tuple(r) if container == "tuple" else as_container(r, container) for r in rows]
    args = {"mlm": False, "pad_to_multiple_of": multiple, "return_tensors": rt}
    ours = ft.DataCollatorForLanguageModeling(tok, **args)
    ref = transformers.DataCollatorForLanguageModeling(tok, **args)
    try:
        expected = ref(clone_rows(examples))
    except Exception:
        with pytest.raises((ValueError, TypeError, KeyError)):
            ours(clone_rows(examples))
        return
    assert_same(ours(clone_rows(examples)), expected)


def test_causal_lm_bare_sequences_with_an_empty_row():
    for side, expected in (("left", [[3, 3], [5, 6]]), ("right", [[3, 3], [5, 6]])):
        batch = ft.DataCollatorForLanguageModeling(make_tokenizer(side), mlm=False)([[], [5, 6]])
        assert batch["input_ids"].tolist() == expected
        assert batch["labels"].tolist() == [[-100, -100], [5, 6]]


def clone_rows(rows):
    return [r.copy() if isinstance(r, np.ndarray) else r for r in rows]


def test_causal_lm_on_tensor_sequences_hands_over():
    tok = make_tokenizer()
    rows = [torch.tensor([5, 6, 7], dtype=torch.int32), torch.tensor([8], dtype=torch.int32)]
    args = {"mlm": False}
    assert_same(
        ft.DataCollatorForLanguageModeling(tok, **args)([r.clone() for r in rows]),
        transformers.DataCollatorForLanguageModeling(tok, **args)([r.clone() for r in rows]),
    )


def test_same_constructor_and_isinstance():
    tok = make_tokenizer()
    for ours, ref in [
        (ft.DataCollatorWithPadding, transformers.DataCollatorWithPadding),
        (ft.DataCollatorForLanguageModeling, transformers.DataCollatorForLanguageModeling),
        (ft.DataCollatorForSeq2Seq, transformers.DataCollatorForSeq2Seq),
    ]:
        assert issubclass(ours, ref)
        assert [f.name for f in ours.__dataclass_fields__.values()] == list(ref.__dataclass_fields__)
        assert isinstance(ours(tok), ref)
    assert fasttrain.DataCollatorWithPadding is ft.DataCollatorWithPadding
    assert fasttrain.DataCollatorWithFlattening is ft.DataCollatorWithFlattening
    with pytest.raises(ValueError):  # transformers' own validation runs
        ft.DataCollatorForLanguageModeling(tok, mlm=False, whole_word_mask=True)


def test_native_equivalent():
    tok = make_tokenizer("left")
    pairs = [
        transformers.DataCollatorWithPadding(tok, padding="max_length", max_length=9, pad_to_multiple_of=4),
        transformers.DataCollatorForLanguageModeling(
            tok, mlm=False, pad_to_multiple_of=8, return_tensors="np"
        ),
        transformers.DataCollatorForSeq2Seq(tok, label_pad_token_id=0, pad_to_multiple_of=2),
        transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, separator_id=7),
    ]
    features = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8], "labels": [9]}]
    plain = [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}]
    for hf in pairs:
        ours = ft.native_equivalent(hf)
        assert type(ours).__name__ == type(hf).__name__ and type(ours) is not type(hf)
        assert isinstance(ours, type(hf))
        assert vars(ours) == vars(hf)
        assert run_both(ours, hf, features) is None or isinstance(hf, transformers.DataCollatorWithPadding)
        assert_same(ours(clone(plain)), hf(clone(plain)))
        assert ft.native_equivalent(ours) is ours
    assert ft.native_equivalent(transformers.DataCollatorForLanguageModeling(tok)) is None  # mlm=True
    assert ft.native_equivalent(transformers.DefaultDataCollator()) is None

    class Custom(transformers.DataCollatorWithPadding):
        pass

    assert ft.native_equivalent(Custom(tok)) is None
    # the reasons name the class (or function) with its module
    assert ft.why_no_native_equivalent(Custom(tok)) == (
        "test_collators.test_native_equivalent.<locals>.Custom subclasses "
        "transformers.data.data_collator.DataCollatorWithPadding and may change what it does, so it is kept"
    )
    assert ft.why_no_native_equivalent(transformers.DataCollatorForLanguageModeling(tok)) == (
        "transformers.data.data_collator.DataCollatorForLanguageModeling with mlm=True (masked LM) keeps "
        "transformers' masking"
    )
    assert ft.why_no_native_equivalent(transformers.default_data_collator) == (
        "transformers.data.data_collator.default_data_collator has no native equivalent"
    )
    assert ft.why_no_native_equivalent(transformers.DefaultDataCollator()) == (
        "transformers.data.data_collator.DefaultDataCollator has no native equivalent"
    )


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda v: np.asarray(v * 2, dtype=np.int64)[::2], id="strided-numpy"),
        pytest.param(lambda v: torch.tensor(v * 2)[::2], id="strided-torch"),
        pytest.param(lambda v: np.asarray(v, dtype=np.uint16), id="uint16"),
        pytest.param(lambda v: np.asarray(v, dtype=np.int8), id="int8"),
        pytest.param(lambda v: torch.tensor(v, dtype=torch.int32), id="torch-int32"),
        pytest.param(
            lambda v: torch.tensor(v, dtype=torch.float32, requires_grad=True).long(), id="torch-from-grad"
        ),
        pytest.param(
            lambda v: np.frombuffer(np.asarray(v, dtype=np.int64).tobytes(), dtype=np.int64), id="readonly"
        ),
    ],
)
def test_input_containers(make):
    tok = make_tokenizer("left")
    rows = [[5, 6, 7, 8], [9], [10, 11]]
    features = [{"input_ids": make(r), "attention_mask": make([1] * len(r))} for r in rows]
    for cls in ("DataCollatorWithPadding", "DataCollatorForSeq2Seq"):
        ours = getattr(ft, cls)(tok, pad_to_multiple_of=3)
        ref = getattr(transformers, cls)(tok, pad_to_multiple_of=3)
        assert run_both(ours, ref, features) is None


def test_batch_encoding_examples_and_tuple_batch():
    tok = make_tokenizer()

    def features():
        return [
            transformers.BatchEncoding({"input_ids": [5, 6, 7]}),
            transformers.BatchEncoding({"input_ids": [8]}),
        ]

    ours = ft.DataCollatorWithPadding(tok)
    assert_same(ours(features()), transformers.DataCollatorWithPadding(tok)(features()))
    assert ours(tuple(features()))["input_ids"].tolist() == [[5, 6, 7], [8, 3, 3]]
    with pytest.raises(KeyError, match="example 1 has no key 'attention_mask'"):
        ours([transformers.BatchEncoding({"input_ids": [5], "attention_mask": [1]}), features()[1]])


class ShoutingTokenizer(PreTrainedTokenizerFast):
    """A tokenizer with its own _pad (as some model tokenizers have): ours must use it."""

    def _pad(self, encoded_inputs, *args, **kwargs):
        out = super()._pad(encoded_inputs, *args, **kwargs)
        out["input_ids"] = [7 if t == PAD_ID else t for t in out["input_ids"]]
        return out


def test_tokenizer_with_its_own_pad_hands_over(caplog, monkeypatch):
    monkeypatch.setattr(fasttrain_logging, "_said", set())
    base = make_tokenizer()
    tok = ShoutingTokenizer(tokenizer_object=base.backend_tokenizer, pad_token="[PAD]", unk_token="[UNK]")
    features = [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}]
    with caplog.at_level(logging.WARNING, logger="fasttrain"):
        ours = ft.DataCollatorWithPadding(tok)(clone(features))
    assert ours["input_ids"].tolist() == [[5, 6, 7], [8, 7, 7]]
    assert_same(ours, transformers.DataCollatorWithPadding(tok)(clone(features)))
    assert any("has its own pad()" in r.getMessage() for r in caplog.records)


def test_4d_attention_masks_hand_over():
    tok = make_tokenizer()
    features = [
        {"input_ids": [5, 6], "attention_mask": torch.ones(1, 2, 2, dtype=torch.int64)},
        {"input_ids": [7, 8], "attention_mask": torch.ones(1, 2, 2, dtype=torch.int64)},
    ]
    assert_same(
        ft.DataCollatorWithPadding(tok)(clone(features)),
        transformers.DataCollatorWithPadding(tok)(clone(features)),
    )


@pytest.mark.parametrize("container", ["list", "numpy", "torch"])
def test_boolean_masks_keep_transformers_dtype(container):
    tok = make_tokenizer()
    ids = {"list": list, "numpy": np.asarray, "torch": torch.tensor}[container]
    mask = {"list": list, "numpy": lambda v: np.asarray(v, dtype=bool), "torch": torch.tensor}[container]
    for rows in ([[True, True], [True, False]], [[True, True], [True]]):
        features = [{"input_ids": ids(list(range(5, 5 + len(m)))), "attention_mask": mask(m)} for m in rows]
        run_both(ft.DataCollatorWithPadding(tok), transformers.DataCollatorWithPadding(tok), features)
    if container == "list":  # an int first: int64 in both, natively
        features = [
            {"input_ids": [5, 6], "attention_mask": [1, True]},
            {"input_ids": [7], "attention_mask": [False]},
        ]
        out = ft.DataCollatorWithPadding(tok)(clone(features))
        assert out["attention_mask"].dtype == torch.int64
        assert (
            run_both(ft.DataCollatorWithPadding(tok), transformers.DataCollatorWithPadding(tok), features)
            is None
        )
