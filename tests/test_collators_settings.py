"""Every setting of the native collators fuzzed against transformers itself: zero, negative and huge values.

For each drawn combination of settings and batch, transformers' collator and ours run on copies of the same
batch; either both return the same batch (keys, dtypes, values), or both raise. Ours must raise a catchable
``Exception`` (never pyo3's PanicException, a BaseException, never an abort): an absurd ``max_length`` or
``pad_to_multiple_of`` is a MemoryError (as transformers' own Python lists raise) or a ValueError naming it.

Huge values are 2**62 and 2**70: transformers refuses those before allocating anything ([x] * 2**62 is a
MemoryError, [x] * 2**70 an OverflowError), so the comparison is safe on any machine. 2**40 (the value of the
original report: a 8 TiB list) is compared only where the kernel refuses such an allocation up front
(vm.overcommit_memory != 1); ours is checked on its own everywhere.

FASTTRAIN_HYPOTHESIS_EXAMPLES=3000 runs a longer search than the CI default.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import transformers
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers.utils import PaddingStrategy

from _collator_cases import (
    assert_same,
    clone,
    flattening_batches,
    make_tokenizer,
    padded_batches,
    reference_dropped_tokens,
    seq2seq_batches,
)
from fasttrain.data import collators as ft

SETTINGS = settings(
    max_examples=int(os.environ.get("FASTTRAIN_HYPOTHESIS_EXAMPLES", "80")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _overcommit_always() -> bool:
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1"
    except OSError:
        return True  # unknown kernel policy: do not ask transformers for an 8 TiB list


HUGE = [2**62, 2**70] + ([] if _overcommit_always() else [2**40])
paddings = st.sampled_from(
    [True, False, "longest", "max_length", "do_not_pad", PaddingStrategy.MAX_LENGTH, "sideways"]
)
max_lengths = st.one_of(st.none(), st.integers(-6, 16), st.sampled_from(HUGE))
multiples = st.one_of(st.none(), st.sampled_from([-4, -3, -1, 0, 1, 2, 3, 8]), st.sampled_from(HUGE))
sides = st.sampled_from(["right", "left", "middle"])
tensors = st.sampled_from(["pt", "np", "tf"])
pad_ids = st.sampled_from([-100, 0, 7, -(2**63), 2**63 - 1, 2**63, -(2**63) - 1, None])


def compare(ours, ref, features, **kwargs):
    """Both return the same batch, or both raise (ours a plain Exception, whatever the hand-overs)."""
    handovers = []
    quiet = mock.patch.object(ft._rows, "hand_over", lambda _c, why: handovers.append(why))
    try:
        expected = ref(clone(features), **kwargs)
    except Exception:
        with quiet, pytest.raises(Exception):  # noqa: B017 - the contract is "catchable", any type
            ours(clone(features), **kwargs)
        event("both raised" + (" (handed over)" if handovers else ""))
        return
    with quiet:
        try:
            got = ours(clone(features), **kwargs)
        except ValueError as err:  # the one deliberate difference, see _collator_cases.run_both
            assert reference_dropped_tokens(features, expected), (
                f"ours raised where transformers did not: {err}"
            )
            event("ours raised: transformers dropped tokens")
            return
    assert_same(got, expected)
    event("same batch" + (" (handed over)" if handovers else " (native)"))


def tokenizer(side: str):
    tok = make_tokenizer("right")
    tok.padding_side = side  # "middle" too: transformers only complains when it has to pad
    return tok


@SETTINGS
@given(padded_batches(), paddings, max_lengths, multiples, sides, tensors)
def test_with_padding_settings(features, padding, max_length, multiple, side, rt):
    args = dict(padding=padding, max_length=max_length, pad_to_multiple_of=multiple, return_tensors=rt)
    tok = tokenizer(side)
    compare(
        ft.DataCollatorWithPadding(tok, **args), transformers.DataCollatorWithPadding(tok, **args), features
    )


@SETTINGS
@given(seq2seq_batches(), paddings, max_lengths, multiples, sides, tensors, pad_ids)
def test_seq2seq_settings(features, padding, max_length, multiple, side, rt, label_pad):
    args = dict(
        padding=padding,
        max_length=max_length,
        pad_to_multiple_of=multiple,
        label_pad_token_id=label_pad,
        return_tensors=rt,
    )
    tok = tokenizer(side)
    compare(
        ft.DataCollatorForSeq2Seq(tok, **args), transformers.DataCollatorForSeq2Seq(tok, **args), features
    )


@st.composite
def lm_batches(draw):
    """Mappings, or bare token lists (transformers' _torch/_numpy_collate_batch)."""
    features = draw(padded_batches())
    if draw(st.booleans()):
        return features
    return [list(f["input_ids"]) for f in features]


@SETTINGS
@given(lm_batches(), multiples, sides, st.sampled_from(["pt", "np"]))
def test_causal_lm_settings(examples, multiple, side, rt):
    args = dict(mlm=False, pad_to_multiple_of=multiple, return_tensors=rt)
    tok = tokenizer(side)
    ours, ref = (
        ft.DataCollatorForLanguageModeling(tok, **args),
        transformers.DataCollatorForLanguageModeling(tok, **args),
    )
    if isinstance(examples[0], dict):
        compare(ours, ref, examples)
        return
    event("bare sequences")
    if side != "right" and any(len(e) == 0 for e in examples):
        return  # transformers fails on an empty row padded on the left (result[i, -0:]); ours pads it
    try:
        expected = ref([list(e) for e in examples])
    except Exception:
        with pytest.raises(Exception):  # noqa: B017
            ours([list(e) for e in examples])
        return
    try:
        got = ours([list(e) for e in examples])
    except ValueError:
        # A negative pad_to_multiple_of can make transformers' result narrower than a row: torch and numpy
        # then broadcast a 1-token row into 0 columns and drop it silently. Ours raises instead.
        assert np.asarray(expected["input_ids"]).size < sum(map(len, examples)), (
            "ours raised, transformers did not"
        )
        return
    assert_same(got, expected)


@SETTINGS
@given(
    flattening_batches(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.sampled_from([-100, 0, 5, 2**63 - 1, 2**63, -(2**63) - 1]),
    st.sampled_from([0, 2, -5, 2**63 - 3, 2**63 - 1, 2**70]),
    st.sampled_from(["pt", "np", "tf"]),
)
def test_flattening_settings(features, pos, flash, seq_idx, sep, start, rt):
    args = dict(
        return_position_ids=pos,
        return_flash_attn_kwargs=flash,
        return_seq_idx=seq_idx,
        separator_id=sep,
        position_ids_start=start,
        return_tensors=rt,
    )
    compare(ft.DataCollatorWithFlattening(**args), transformers.DataCollatorWithFlattening(**args), features)


# --- the report's cases, on ours alone (they must raise a catchable error on any machine) ---


@pytest.mark.parametrize(
    "args",
    [
        dict(pad_to_multiple_of=2**40),
        dict(padding="max_length", max_length=2**40),
        dict(padding="max_length", max_length=2**62),
        dict(padding="max_length", max_length=2**70),
        dict(padding="max_length", max_length=2**40, pad_to_multiple_of=3),
    ],
    ids=["multiple-2**40", "max_length-2**40", "max_length-2**62", "max_length-2**70", "both"],
)
def test_absurd_sizes_raise_memory_error_naming_the_setting(args):
    features = [{"input_ids": [5, 6]}, {"input_ids": [7]}]
    tok = make_tokenizer()
    for collator in (ft.DataCollatorWithPadding(tok, **args), ft.DataCollatorForSeq2Seq(tok, **args)):
        with pytest.raises(MemoryError, match=r"max_length=.*pad_to_multiple_of="):
            collator(clone(features))
    lm = ft.DataCollatorForLanguageModeling(tok, mlm=False, pad_to_multiple_of=args.get("pad_to_multiple_of"))
    if args.get("pad_to_multiple_of", 0) >= 2**40:
        with pytest.raises(MemoryError, match="pad_to_multiple_of="):
            lm(clone(features))
    # the collator stays usable afterwards
    assert ft.DataCollatorWithPadding(tok)(clone(features))["input_ids"].tolist() == [[5, 6], [7, 3]]


def test_zero_multiple_and_bad_pad_ids_name_the_setting():
    tok = make_tokenizer()
    features = [{"input_ids": [5, 6], "labels": [1]}, {"input_ids": [7], "labels": [1, 2]}]
    with pytest.raises(ValueError, match="pad_to_multiple_of must not be 0"):
        ft.DataCollatorWithPadding(tok, pad_to_multiple_of=0)(clone(features))
    with pytest.raises(ValueError, match=r"label_pad_token_id=9223372036854775808 does not fit in int64"):
        ft.DataCollatorForSeq2Seq(tok, label_pad_token_id=2**63)(clone(features))
    with pytest.raises(TypeError, match="label_pad_token_id must be an integer"):
        ft.DataCollatorForSeq2Seq(tok, label_pad_token_id=None)(clone(features))
    with pytest.raises(ValueError, match="position_ids_start"):
        ft.DataCollatorWithFlattening(position_ids_start=2**63 - 1)([{"input_ids": [5, 6]}])
