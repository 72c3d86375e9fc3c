"""Bad input to the Rust collators: a precise ValueError/TypeError/KeyError naming the example index
and the key; never a Rust panic (PyO3's PanicException derives from BaseException, so
``pytest.raises(ValueError)`` would not catch one and the test fails), never a silent wrong batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _collator_cases import make_tokenizer
from fasttrain.data import collators as ft


def padding_collators():
    tok = make_tokenizer()
    return {
        "padding": ft.DataCollatorWithPadding(tok),
        "lm": ft.DataCollatorForLanguageModeling(tok, mlm=False),
        "seq2seq": ft.DataCollatorForSeq2Seq(tok),
        "flattening": ft.DataCollatorWithFlattening(),
    }


ALL = ["padding", "lm", "seq2seq", "flattening"]

BAD_TOKENS = [
    pytest.param("a", TypeError, "str", id="string"),
    pytest.param(2.5, TypeError, "float", id="float"),
    pytest.param([5, 6], TypeError, "nested", id="nested-list"),
    pytest.param(2**63, ValueError, "int64", id="above-int64"),
    pytest.param(-(2**63) - 1, ValueError, "int64", id="below-int64"),
    pytest.param(None, TypeError, "NoneType", id="none"),
]


@pytest.mark.parametrize("which", ALL)
@pytest.mark.parametrize(("bad", "error", "word"), BAD_TOKENS)
def test_bad_token_names_example_and_key(which, bad, error, word):
    collator = padding_collators()[which]
    features = [{"input_ids": [5, 6, 7]}, {"input_ids": [5, 6, 7]}, {"input_ids": [5, bad, 7]}]
    with pytest.raises(error, match=rf"example 2: 'input_ids'\[1\].*{word}"):
        collator(features)


@pytest.mark.parametrize("which", ["padding", "lm", "seq2seq"])
def test_bad_attention_mask_value(which):
    features = [{"input_ids": [5, 6], "attention_mask": [1, 1]}, {"input_ids": [5], "attention_mask": ["x"]}]
    with pytest.raises(TypeError, match=r"example 1: 'attention_mask'\[0\]"):
        padding_collators()[which](features)


@pytest.mark.parametrize("which", ["seq2seq", "flattening"])
def test_bad_label_value(which):
    features = [{"input_ids": [5, 6], "labels": [5, 6]}, {"input_ids": [7, 8], "labels": [7, 8.5]}]
    with pytest.raises(TypeError, match=r"example 1: 'labels'\[1\] is a float"):
        padding_collators()[which](features)


@pytest.mark.parametrize("which", ALL)
def test_arrays_of_floats_and_2d_are_refused(which):
    collator = padding_collators()[which]
    for bad, word in [
        (np.array([5.0, 6.0]), "dtype float64"),
        (torch.tensor([5.0, 6.0]), "dtype float32"),
        (np.array([[5, 6]]), "2-d array"),
        (np.array([2**64 - 1], dtype=np.uint64), "outside the int64 range"),
        ("5 6", "is a str"),
        (7, "is a int"),
    ]:
        features = [{"input_ids": [5, 6]}, {"input_ids": bad}]
        with pytest.raises((TypeError, ValueError), match=rf"example 1: 'input_ids'.*{word}"):
            collator(features)


@pytest.mark.parametrize("which", ["padding", "lm", "seq2seq"])
def test_key_missing_from_some_examples(which):
    collator = padding_collators()[which]
    features = [{"input_ids": [5], "attention_mask": [1]}] * 3 + [{"input_ids": [5, 6]}]
    with pytest.raises(KeyError, match=r"example 3 has no key 'attention_mask'"):
        collator(features)
    features = [{"input_ids": [5], "token_type_ids": [0]}, {"input_ids": [5], "token_type_ids": [0]}, {}]
    with pytest.raises(KeyError, match=r"example 2 has no key 'input_ids'"):
        collator(features)


def test_unpadded_key_missing_names_example():
    features = [{"input_ids": [5], "label": 1}, {"input_ids": [5, 6]}]
    with pytest.raises(KeyError, match=r"example 1 has no key 'label'"):
        padding_collators()["padding"](features)
    features = [{"input_ids": [5], "labels": [1]}, {"input_ids": [5, 6]}]
    with pytest.raises(KeyError, match=r"example 1 has no key 'labels'"):
        padding_collators()["seq2seq"](features)


def test_flattening_missing_labels():
    features = [{"input_ids": [5], "labels": [1]}, {"input_ids": [5, 6]}]
    with pytest.raises(KeyError, match=r"example 1 has no key 'labels'"):
        padding_collators()["flattening"](features)


@pytest.mark.parametrize("which", ["padding", "lm", "seq2seq"])
@pytest.mark.parametrize("key", ["attention_mask", "token_type_ids", "special_tokens_mask"])
def test_lengths_that_disagree(which, key):
    # a single example too: transformers would return input_ids and the mask with different shapes
    for features in (
        [{"input_ids": [5, 6, 7], key: [1, 1, 1]}, {"input_ids": [5, 6], key: [1, 1, 1]}],
        [{"input_ids": [5, 6], key: [1, 1, 1]}],
    ):
        with pytest.raises(
            ValueError, match=rf"example \d: '{key}' has length 3 but 'input_ids' has length 2"
        ):
            padding_collators()[which](features)


def test_flattening_labels_length_disagrees():
    features = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [5, 6], "labels": [1]}]
    with pytest.raises(ValueError, match=r"example 1: 'labels' has length 1 but 'input_ids' has length 2"):
        padding_collators()["flattening"](features)


@pytest.mark.parametrize("which", ALL)
def test_empty_batch(which):
    with pytest.raises(ValueError, match="empty"):
        padding_collators()[which]([])


def test_flattening_all_examples_empty():
    with pytest.raises(ValueError, match="every example is empty"):
        padding_collators()["flattening"]([{"input_ids": []}, {"input_ids": np.array([], dtype=np.int64)}])


def test_non_mapping_example_in_the_middle():
    features = [{"input_ids": [5]}, [5, 6]]
    with pytest.raises(TypeError, match=r"example 1 is a list, expected a mapping"):
        padding_collators()["padding"](features)


def test_no_padding_ragged_and_too_long():
    tok = make_tokenizer()
    ragged = [{"input_ids": [5, 6]}, {"input_ids": [5, 6, 7]}]
    with pytest.raises(ValueError, match=r"example 1: 'input_ids' has length 3 but example 0 has length 2"):
        ft.DataCollatorWithPadding(tok, padding=False)(ragged)
    with pytest.raises(
        ValueError, match=r"example 1: 'input_ids' has length 3, longer than the padding length 2"
    ):
        ft.DataCollatorWithPadding(tok, padding="max_length", max_length=2)(ragged)
    with pytest.raises(
        ValueError, match=r"example 1: 'labels' has length 3, longer than the padding length 2"
    ):
        ft.DataCollatorForSeq2Seq(tok, padding="max_length", max_length=2)(
            [{"input_ids": [5], "labels": [5, 6]}, {"input_ids": [5], "labels": [5, 6, 7]}]
        )


def test_bad_settings():
    tok = make_tokenizer()
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        ft.DataCollatorWithPadding(tok, pad_to_multiple_of=0)([{"input_ids": [5]}, {"input_ids": [5, 6]}])
    with pytest.raises(ValueError, match="not a valid PaddingStrategy"):  # transformers' own check
        ft.DataCollatorWithPadding(tok, padding="sideways")([{"input_ids": [5]}])


def test_failed_batch_leaves_collator_usable():
    collator = padding_collators()["padding"]
    with pytest.raises(TypeError):
        collator([{"input_ids": [5, "x"]}])
    out = collator([{"input_ids": [5, 6]}, {"input_ids": [7]}])
    assert out["input_ids"].tolist() == [[5, 6], [7, 3]]


def test_flattening_names_the_original_example_after_dropping_empty_ones():
    features = [{"input_ids": [], "labels": []}, {"input_ids": [5, 6], "labels": [1, "x"]}]
    with pytest.raises(TypeError, match=r"example 1: 'labels'\[1\] is a str"):
        padding_collators()["flattening"](features)
