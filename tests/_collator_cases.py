"""What the collator parity tests share: a word-level tokenizer, hypothesis strategies for the batches each
transformers collator takes, and the byte-level comparison of ours against transformers' (``run_both``)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import tokenizers
import torch
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from fasttrain.data import collators as ft

PAD_ID = 3  # not 0, so that a pad written with the wrong value shows
VOCAB_SIZE = 40


def make_tokenizer(padding_side: str = "right", pad: bool = True, token_type_ids: bool = False):
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[PAD]": PAD_ID, "[MASK]": 4}
    vocab.update({f"w{i}": i for i in range(5, VOCAB_SIZE)})
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    kwargs = {"pad_token": "[PAD]"} if pad else {}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", mask_token="[MASK]", padding_side=padding_side, **kwargs
    )
    if token_type_ids:
        tok.model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    return tok


def assert_same(ours, ref) -> None:
    assert type(ours) is type(ref)
    assert list(ours.keys()) == list(ref.keys())
    for key in ref:
        a, b = ours[key], ref[key]
        assert type(a) is type(b), key
        if isinstance(b, torch.Tensor):
            assert (a.dtype, a.shape) == (b.dtype, b.shape), key
            assert torch.equal(a, b), key
        elif isinstance(b, np.ndarray):
            assert (a.dtype, a.shape) == (b.dtype, b.shape), key
            if b.dtype == object:  # transformers' ragged numpy batches
                assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b, strict=True)), (
                    key
                )
            else:
                assert np.array_equal(a, b), key
        else:
            assert a == b, key


def run_both(ours, ref, features, **kwargs):
    """Calls both collators on (separate copies of) the same batch and compares.

    Also checks that ours ran natively: the only hand-overs to transformers these batches may cause
    are a ragged batch with return_tensors="np" (transformers builds object arrays for it) and
    boolean values (transformers may keep a bool dtype).
    """
    handovers = []

    def call_ours():
        with mock.patch.object(ft._rows, "hand_over", lambda _c, why: handovers.append(str(why))):
            return ours(clone(features), **kwargs)

    try:
        expected = ref(clone(features), **kwargs)
    except Exception as ref_error:
        with pytest.raises((ValueError, TypeError, KeyError)):
            call_ours()
        assert all(allowed_handover(h) for h in handovers), handovers
        return ref_error
    try:
        got = call_ours()
        assert all(allowed_handover(h) for h in handovers), handovers
    except ValueError:
        # The one place we differ on purpose: torch.tensor([[], [5]]) is a (2, 0) tensor, so
        # transformers silently drops every token of a ragged batch whose first row is empty.
        assert reference_dropped_tokens(features, expected), "ours raised where transformers did not"
        return None
    assert_same(got, expected)
    return None


def allowed_handover(why: str) -> bool:
    return "ragged batch with return_tensors='np'" in why or "holds booleans" in why


def reference_dropped_tokens(features, expected) -> bool:
    """Whether transformers' batch holds fewer tokens than its input (ragged rows lost, not raised)."""
    for key, out_key in (("input_ids", "input_ids"), ("labels", "labels"), ("label", "labels")):
        out = expected.get(out_key)
        if key not in features[0] or not isinstance(out, (torch.Tensor, np.ndarray)):
            continue
        total = sum(len(f[key]) for f in features)
        if (out.numel() if isinstance(out, torch.Tensor) else out.size) < total:
            return True
    return False


def clone(features):
    def copy(v):
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, np.ndarray):
            return v.copy()
        if isinstance(v, list):
            return list(v)
        return v

    return [{k: copy(v) for k, v in f.items()} for f in features]


def as_container(values: list[int], container: str):
    if container == "list":
        return list(values)
    if container == "tuple":
        return tuple(values)
    if container == "np64":
        return np.asarray(values, dtype=np.int64)
    if container == "np32":
        return np.asarray(values, dtype=np.int32)
    if container == "torch":
        return torch.tensor(values, dtype=torch.int64)
    raise AssertionError(container)


CONTAINERS = st.sampled_from(["list", "np64", "np32", "torch"])


token = st.integers(0, VOCAB_SIZE - 1)  # includes PAD_ID: labels mask by value


sequences = st.lists(token, min_size=0, max_size=12)


@st.composite
def padded_batches(draw, min_len: int = 0):
    """A batch of examples with the keys tokenizer.pad knows, plus an unpadded label."""
    n = draw(st.integers(1, 6))
    container = draw(CONTAINERS)
    extras = draw(
        st.sets(st.sampled_from(["attention_mask", "token_type_ids", "special_tokens_mask", "label"]))
    )
    features = []
    for _ in range(n):
        ids = draw(st.lists(token, min_size=min_len, max_size=12))
        f = {"input_ids": as_container(ids, container)}
        bits = st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids))
        for key in ("token_type_ids", "attention_mask", "special_tokens_mask"):
            if key in extras:
                f[key] = as_container(draw(bits), container)
        if "label" in extras:
            f["label"] = draw(st.integers(0, 4))
        features.append(f)
    return features


@st.composite
def seq2seq_batches(draw):
    features = draw(padded_batches())
    label_key = draw(st.sampled_from(["labels", "label"]))
    container = draw(st.sampled_from(["list", "np64", "torch"]))
    for f in features:
        f.pop("label", None)
        f[label_key] = as_container(draw(sequences), container)
    return features


@st.composite
def flattening_batches(draw):
    n = draw(st.integers(1, 6))
    container = draw(CONTAINERS)
    with_labels = draw(st.booleans())
    features = []
    for _ in range(n):
        ids = draw(sequences)
        f = {"input_ids": as_container(ids, container)}
        if with_labels:
            labels = draw(st.lists(st.integers(-100, VOCAB_SIZE), min_size=len(ids), max_size=len(ids)))
            f["labels"] = as_container(labels, container)
        features.append(f)
    return features
