"""Once per process: do the installed transformers' collators still make the batches ours make?

The native collators take over a transformers collator by copying its fields (``native_equivalent``), and they
reimplement its ``__call__``. A field that a new transformers release adds, or a change in what its collator
returns, would then be silently ignored. So before a native class runs natively it must pass two checks:

- every field of the collator is one the native path was written for (``KNOWN_FIELDS``: the union over the
  transformers releases it was checked against, 4.57 to 5.24); an unknown one means: not ours to run;
- on first use of the class (per transformers version), the transformers collator and ours run on a few small
  probes covering the options that change the output (padding side, padding strategy, max_length,
  pad_to_multiple_of, return_tensors, labels, token_type_ids, the flattening options) and must return the same
  type, the same keys in the same order, and per value the same type, dtype, shape and values.

Any difference (or a probe that our native path hands over, or that raises) makes ``refusal`` return the
reason: ``native_equivalent`` then keeps transformers' collator (the Trainer's status says
``collator: off: <reason>``) and a native class used directly hands every batch to transformers' own code.
The reason is logged once.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tokenizers
import torch
import transformers
from transformers import PreTrainedTokenizerFast
from transformers.data import data_collator as hf

from .._logging import log_once

# The instance attributes of each transformers class that the native path reads or may ignore by design
# (masking settings are only used with mlm=True, which transformers' own class serves).
KNOWN_FIELDS: dict[type, frozenset[str]] = {
    hf.DataCollatorWithPadding: frozenset(
        {"tokenizer", "padding", "max_length", "pad_to_multiple_of", "return_tensors"}
    ),
    hf.DataCollatorForLanguageModeling: frozenset(
        {
            "tokenizer",
            "mlm",
            "whole_word_mask",
            "mlm_probability",
            "mask_replace_prob",
            "random_replace_prob",
            "pad_to_multiple_of",
            "tf_experimental_compile",  # transformers 4.x: TensorFlow only
            "return_tensors",
            "seed",
            "generator",  # the masking's random generator (mlm=True)
            "_generator_pid",  # transformers 5.2x: the process that generator was seeded in (mlm=True)
        }
    ),
    hf.DataCollatorForSeq2Seq: frozenset(
        {
            "tokenizer",
            "model",
            "padding",
            "max_length",
            "pad_to_multiple_of",
            "label_pad_token_id",
            "return_tensors",
        }
    ),
    hf.DataCollatorWithFlattening: frozenset(
        {
            "return_tensors",
            "return_position_ids",
            "separator_id",
            "return_flash_attn_kwargs",
            "return_seq_idx",
            "position_ids_start",  # transformers 5.x
            # transformers' own bookkeeping for its numpy/torch conversion (constants set in __init__)
            "_int_64_keys",
            "_batch_dim_keys",
            "_py_int_keys",
        }
    ),
}

_PAD_ID = 3  # not 0: a pad written with the wrong value shows
_VOCAB = 20


def _tokenizer(padding_side: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer built in memory (no files, no network) with a pad token and token_type_ids."""
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[PAD]": _PAD_ID}
    vocab.update({f"w{i}": i for i in range(4, _VOCAB)})
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", padding_side=padding_side
    )
    tok.model_input_names = ["input_ids", "token_type_ids", "attention_mask"]
    return tok


# Each probe: (keyword arguments of the collator, the batch). Lengths differ so that padding shows; token ids
# avoid the pad id except where a row holds it on purpose (the LM collator masks pad ids in the labels).
def _padding_probes(tok: Any) -> Iterator[tuple[dict, list]]:
    batch = [
        {"input_ids": [5, 6, 7], "token_type_ids": [0, 0, 1], "label": 1},
        {"input_ids": [8], "token_type_ids": [1], "label": 0},
    ]
    with_mask = [
        {"input_ids": [5, 6], "attention_mask": [1, 1], "label_ids": [1, 2]},
        {"input_ids": [8, 9, 10, 11], "attention_mask": [1, 1, 1, 0], "label_ids": [0, 3]},
    ]
    for return_tensors in ("pt", "np"):
        for padding, max_length, multiple in (
            (True, None, None),
            ("max_length", 6, None),
            ("longest", None, 4),
        ):
            for features in (batch, with_mask):
                yield (
                    dict(
                        tokenizer=tok,
                        padding=padding,
                        max_length=max_length,
                        pad_to_multiple_of=multiple,
                        return_tensors=return_tensors,
                    ),
                    features,
                )


def _language_modeling_probes(tok: Any) -> Iterator[tuple[dict, list]]:
    mappings = [
        {"input_ids": [5, 6, _PAD_ID, 7], "special_tokens_mask": [1, 0, 0, 1]},
        {"input_ids": [8, 9], "special_tokens_mask": [0, 0]},
    ]
    sequences = [[5, 6, 7], [8]]
    same_length = [[5, 6], [7, 8]]
    for return_tensors in ("pt", "np"):
        for multiple in (None, 4):
            for features in (mappings, sequences, same_length):
                yield (
                    dict(
                        tokenizer=tok, mlm=False, pad_to_multiple_of=multiple, return_tensors=return_tensors
                    ),
                    features,
                )


def _seq2seq_probes(tok: Any) -> Iterator[tuple[dict, list]]:
    batch = [
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [9, 10]},
        {"input_ids": [8], "attention_mask": [1], "labels": [11, 12, 13, 14]},
    ]
    no_labels = [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}]
    for return_tensors in ("pt", "np"):
        for padding, max_length, multiple in ((True, None, None), ("max_length", 6, None), (True, None, 3)):
            for label_pad in (-100, 0):
                yield (
                    dict(
                        tokenizer=tok,
                        padding=padding,
                        max_length=max_length,
                        pad_to_multiple_of=multiple,
                        label_pad_token_id=label_pad,
                        return_tensors=return_tensors,
                    ),
                    batch,
                )
        yield dict(tokenizer=tok, return_tensors=return_tensors), no_labels


def _flattening_probes(_tok: Any) -> Iterator[tuple[dict, list]]:
    batch = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]
    if flattening_drops_empty_examples(transformers.__version__):  # else ours hands such batches over
        batch.insert(1, {"input_ids": []})
    labelled = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, -100]}]
    for return_tensors in ("pt", "np"):
        for positions, flash, seq_idx, separator in ((True, False, False, -100), (False, True, True, 2)):
            for features in (batch, labelled):
                yield (
                    dict(
                        return_tensors=return_tensors,
                        return_position_ids=positions,
                        return_flash_attn_kwargs=flash,
                        return_seq_idx=seq_idx,
                        separator_id=separator,
                    ),
                    features,
                )


_PROBES: dict[type, Callable[[Any], Iterator[tuple[dict, list]]]] = {
    hf.DataCollatorWithPadding: _padding_probes,
    hf.DataCollatorForLanguageModeling: _language_modeling_probes,
    hf.DataCollatorForSeq2Seq: _seq2seq_probes,
    hf.DataCollatorWithFlattening: _flattening_probes,
}


@functools.cache
def flattening_drops_empty_examples(transformers_version: str) -> bool:
    """Whether this transformers' ``DataCollatorWithFlattening`` drops empty examples, as ours does. Releases
    before 5.2x (4.57, 5.17) keep them: a separator label with no token, so labels outgrow input_ids; ours hands
    such batches to them rather than copy that. Asked once per transformers version."""
    try:
        batch = hf.DataCollatorWithFlattening(return_tensors="np")(
            [{"input_ids": [5, 6]}, {"input_ids": []}, {"input_ids": [7]}]
        )
        return batch["labels"].shape == batch["input_ids"].shape == (1, 3)
    except Exception:  # whatever it does instead, it is not what ours does
        return False


def batch_difference(ours: Any, theirs: Any) -> str | None:
    """Where two batches differ (None: same type, keys in order, and per value type, dtype, shape, values).
    Also the TRL collators' agreement check (``trl_collators.agrees_with_trl``)."""
    if type(ours) is not type(theirs):
        return f"a {type(ours).__name__} where transformers returns a {type(theirs).__name__}"
    if list(ours.keys()) != list(theirs.keys()):
        return f"keys {list(ours.keys())} where transformers returns {list(theirs.keys())}"
    for key, expected in theirs.items():
        got = ours[key]
        if type(got) is not type(expected):
            return f"'{key}' is a {type(got).__name__} where transformers returns a {type(expected).__name__}"
        if isinstance(expected, (torch.Tensor, np.ndarray)):
            if (got.dtype, tuple(got.shape)) != (expected.dtype, tuple(expected.shape)):
                return (
                    f"'{key}' is {got.dtype} {tuple(got.shape)} where transformers returns "
                    f"{expected.dtype} {tuple(expected.shape)}"
                )
            same = (
                torch.equal(got, expected) if isinstance(got, torch.Tensor) else np.array_equal(got, expected)
            )
        else:
            same = got == expected
        if not same:
            return f"'{key}' holds other values than transformers' ({got!r} vs {expected!r})"
    return None


@functools.cache
def _probe(theirs_cls: type, ours_cls: type, transformers_version: str) -> str | None:
    """Why ``ours_cls`` makes other batches than this transformers' ``theirs_cls`` on the probes (None: same).
    ``transformers_version`` keys the cache: once per collator class and transformers version."""
    sides = ("right",) if theirs_cls is hf.DataCollatorWithFlattening else ("right", "left")  # no tokenizer
    for side in sides:
        for index, (kwargs, features) in enumerate(_PROBES[theirs_cls](_tokenizer(side))):
            where = f"probe {index} (padding side {side}, {_settings(kwargs)})"
            try:
                theirs = theirs_cls(**kwargs)(copy.deepcopy(features))
                ours = ours_cls(**kwargs)._native_call(copy.deepcopy(features))
            except Exception as err:  # any failure, a hand-over included, means: transformers' collator runs
                return f"{where} fails: {type(err).__name__}: {err}"
            difference = batch_difference(ours, theirs)
            if difference is not None:
                return f"{where}: {difference}"
    return None


def _settings(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "tokenizer")


def refusal(collator: Any) -> str | None:
    """Why the native class ``collator`` (one of fasttrain's four) must leave its batches to transformers'
    class (None: it may run natively). Logged once per reason."""
    ours_cls = next(cls for cls in type(collator).__mro__ if cls.__dict__.get("fasttrain_native"))
    theirs_cls = next(base for base in ours_cls.__mro__[1:] if base in KNOWN_FIELDS)
    name = theirs_cls.__name__
    version = transformers.__version__
    # a framework's subclass whose own fields only its own code reads names them (llamafactory_collators)
    extra = getattr(type(collator), "fasttrain_extra_fields", frozenset())
    unknown = sorted(set(vars(collator)) - KNOWN_FIELDS[theirs_cls] - extra)
    if unknown:
        why = f"transformers {version}'s {name} has fields fasttrain's native path does not know: {unknown}"
    else:
        why = _probe(theirs_cls, ours_cls, version)
        if why is not None:
            why = f"transformers {version}'s {name} makes other batches than fasttrain's: {why}"
    if why is not None:
        log_once(f"collator-probe:{why}", f"fasttrain: {why}; transformers' {name} is used (logged once)")
    return why
