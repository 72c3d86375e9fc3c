"""Drop-in replacements for transformers' padding collators, with the token rows read and padded in Rust.

Each class subclasses the transformers class of the same name, so it takes the same constructor
arguments (same names, same defaults, same validation), passes ``isinstance`` checks, pickles the
same way, and returns the same type with the same keys in the same order, dtypes and values.

What runs natively: the token keys that ``tokenizer.pad`` pads (the model's main input,
``attention_mask``, ``token_type_ids``, ``special_tokens_mask``), the labels of the LM and seq2seq
collators, and the whole of ``DataCollatorWithFlattening``. Each sequence crosses into Rust once
(lists are walked in Rust, numpy arrays and torch tensors are read from their buffer), padding runs
with the GIL released, and the arrays come back without a copy (``torch.from_numpy``). Widths follow
transformers' own arithmetic on the settings (see :mod:`fasttrain.data._rows`), huge and negative
settings included: what transformers pads, raises (``MemoryError`` for an absurd ``max_length``) or
refuses, these do too.

What stays in transformers' code: keys that are not padded (``label``, float features, ...) are
converted by transformers' own ``BatchEncoding`` exactly as ``tokenizer.pad`` converts them, and a
whole batch is handed to the transformers class when it needs something the native path does not
model (``mlm=True``, a tokenizer that overrides ``pad``, examples that are neither mappings nor
bare token lists, ``return_tensors`` other than "pt"/"np", 4-d attention masks, ragged batches with
``return_tensors="np"``, padding-free batches with empty examples where transformers keeps them). Each such
hand-over is logged once. And every batch goes to the transformers class when ``collator_probe.refusal`` finds
that the installed transformers has drifted from what these were written against (a collator field they do
not know, or other batches on the probes it runs once per process).

Bad input raises ValueError/TypeError/KeyError naming the example and the key; where transformers
would fail later with a generic message or return mismatched shapes, these raise up front. Token ids
must be integers: a float among them raises TypeError (transformers would return a float tensor).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import transformers
from transformers.data import data_collator as hf
from transformers.tokenization_utils_base import BatchEncoding, PreTrainedTokenizerBase
from transformers.utils import PaddingStrategy
from transformers.utils.generic import to_py_obj

from .._classes import from_package
from .._logging import log_once
from . import _rows, collator_probe
from ._rows import HandOver, Rows, column, native_or_reference, read, round_up

__all__ = [
    "DataCollatorForLanguageModeling",
    "DataCollatorForSeq2Seq",
    "DataCollatorWithFlattening",
    "DataCollatorWithPadding",
    "native_equivalent",
    "why_no_native_equivalent",
]

_NATIVE_TENSORS = ("pt", "np")
_probe = collator_probe.refusal  # whether this transformers' collators still make the batches ours make
# tokenizer.pad's padding values besides the main input (model_input_names[0]) and the mask.
_PAD_VALUE_ATTR = {"token_type_ids": "pad_token_type_id"}
_PAD_VALUE_CONST = {"special_tokens_mask": 1}


def _has_standard_pad(tokenizer: Any) -> bool:
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerBase)
        and getattr(cls, "pad", None) is PreTrainedTokenizerBase.pad
        and getattr(cls, "_pad", None) is PreTrainedTokenizerBase._pad
    )


def _tokenizer_target(strategy: PaddingStrategy, longest: int, max_length: Any, multiple: Any) -> int | None:
    """The length ``tokenizer._pad`` pads every row up to (None: no padding), with its arithmetic."""
    if strategy == PaddingStrategy.DO_NOT_PAD:
        if max_length is not None:
            round_up(max_length, multiple)  # transformers evaluates max_length % multiple even here
        return None
    return round_up(longest if strategy == PaddingStrategy.LONGEST else max_length, multiple)


def _pad(
    tokenizer: Any,
    features: Any,
    *,
    padding: Any,
    max_length: int | None,
    pad_to_multiple_of: int | None,
    return_tensors: str,
    exclude: str | None = None,
) -> dict[str, Any]:
    """``tokenizer.pad(features, ...)`` for a list of mappings, as a plain dict (same key order).

    The padded keys come back as int64 numpy arrays (the caller converts them); the other keys are
    already converted by transformers' ``BatchEncoding``. ``exclude`` drops one key (seq2seq labels).
    """
    if return_tensors not in _NATIVE_TENSORS:
        raise HandOver(f"return_tensors={return_tensors!r}")
    if not _has_standard_pad(tokenizer):
        raise HandOver(f"{type(tokenizer).__name__} has its own pad()")
    features = _rows.example_mappings(features)
    first = features[0]
    main = tokenizer.model_input_names[0]
    if main not in first:
        raise ValueError(
            "You should supply an encoding or a list of encodings to this method "
            f"that includes {main}, but you provided {list(first.keys())} (example 0)"
        )
    if getattr(first.get("attention_mask"), "ndim", 0) > 1:
        raise HandOver("4-d attention masks")

    strategy, _, max_length, _ = tokenizer._get_padding_truncation_strategies(
        padding=padding, max_length=max_length, verbose=True
    )
    return_attention_mask = "attention_mask" in tokenizer.model_input_names
    keys = [k for k in first.keys() if k != exclude]  # noqa: SIM118 - .keys() as transformers (Mapping subclasses)
    pad_values = {main: (tokenizer.pad_token_id, "the tokenizer's pad_token_id")}
    if return_attention_mask:
        pad_values["attention_mask"] = (0, "")
    for key, attr in _PAD_VALUE_ATTR.items():
        pad_values[key] = (getattr(tokenizer, attr), f"the tokenizer's {attr}")
    pad_values.update({k: (v, "") for k, v in _PAD_VALUE_CONST.items()})
    padded_keys = [main] + [k for k in keys if k != main and k in pad_values]
    for key in padded_keys:
        if _starts_with_bool(features, key):
            raise HandOver(f"'{key}' holds booleans (torch.tensor keeps them as bool)")

    rows = {key: read(column(features, key), key) for key in padded_keys}
    for key in padded_keys[1:]:
        _rows.check_same_lengths(rows[main], main, rows[key], key)
    lengths = rows[main].lengths
    target = _tokenizer_target(strategy, int(lengths.max()), max_length, pad_to_multiple_of)
    width = _rows.uniform_width(lengths, target)
    if width is None:
        if return_tensors == "np":  # transformers returns object arrays for it, by design
            raise HandOver("a ragged batch with return_tensors='np' (object arrays)")
        raise _rows.ragged_error(lengths, target, main)
    padding_needed = width > lengths.min()
    side = tokenizer.padding_side if padding_needed else "right"
    # tokenizer._pad reads the side for every row whose length differs from the target, even one it
    # leaves alone (a longer row: it pads by a negative amount, that is not at all).
    side_read = target is not None and any(n != target for n in lengths.tolist())
    if side_read and tokenizer.padding_side not in ("left", "right"):
        raise ValueError(f"Invalid padding strategy:{tokenizer.padding_side}")  # transformers' message
    settings = f"padding={padding!r}, max_length={max_length}, pad_to_multiple_of={pad_to_multiple_of}"

    def value(key: str) -> int:
        pad, setting = pad_values[key]
        return _rows.int64_setting(pad, setting) if padding_needed else 0

    padded = {key: _rows.pad(rows[key], width, value(key), side, key, settings) for key in padded_keys}
    make_mask = return_attention_mask and "attention_mask" not in first
    if make_mask:
        padded["attention_mask"] = _rows.mask(lengths, width, side)

    # Keys tokenizer.pad does not pad go through transformers' own tensor conversion. It first
    # turns every value into Python objects when the main input is an array or tensor.
    others = {k: column(features, k) for k in keys if k not in padded}
    if others:
        if not isinstance(first[main], (list, tuple)):
            others = {k: to_py_obj(v) for k, v in others.items()}
        others = dict(BatchEncoding(others, tensor_type=return_tensors))
    out = {k: padded[k] if k in padded else others[k] for k in keys}
    if make_mask:
        out["attention_mask"] = padded["attention_mask"]
    return out


def _starts_with_bool(features: list, key: str) -> bool:
    """Whether the first value of ``key`` in the batch is a bool. torch.tensor/np.asarray give a bool
    array only when every value is a bool, so a batch whose first value is an int converts to int64
    exactly like ours; the rare batch that starts with a bool is transformers' to convert."""
    for f in features:
        v = f.get(key) if isinstance(f, Mapping) else None
        if v is None:
            return False
        if isinstance(v, np.ndarray):
            return v.dtype == np.bool_
        if isinstance(v, torch.Tensor):
            return v.dtype == torch.bool
        if isinstance(v, (list, tuple)) and len(v) > 0:
            return isinstance(v[0], (bool, np.bool_))
        if not isinstance(v, (list, tuple)):
            return False
    return False


def _tensors(batch: dict[str, Any], return_tensors: str, keys: Any = None) -> dict[str, Any]:
    """Turns the native numpy arrays among ``keys`` (default: all) into torch tensors, in place."""
    if return_tensors == "pt":
        for k in batch if keys is None else keys:
            v = batch[k]
            if isinstance(v, np.ndarray):
                batch[k] = torch.from_numpy(v)
    return batch


class DataCollatorWithPadding(hf.DataCollatorWithPadding):
    """transformers' ``DataCollatorWithPadding``, padded in Rust (same arguments and outputs)."""

    fasttrain_native = True

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        return native_or_reference(self, self._native_call, super().__call__, features, refusal=_probe)

    def _native_call(self, features: Any) -> dict[str, Any]:
        padded = _pad(
            self.tokenizer,
            features,
            padding=self.padding,
            max_length=self.max_length,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_tensors=self.return_tensors,
        )
        batch = BatchEncoding(_tensors(padded, self.return_tensors))
        if "label" in batch:
            batch["labels"] = batch["label"]
            del batch["label"]
        if "label_ids" in batch:
            batch["labels"] = batch["label_ids"]
            del batch["label_ids"]
        return batch


class DataCollatorForLanguageModeling(hf.DataCollatorForLanguageModeling):
    """transformers' ``DataCollatorForLanguageModeling``; native for ``mlm=False`` (causal LM).

    With ``mlm=True`` (transformers' default) every batch runs through transformers' masking code.
    """

    fasttrain_native = True

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        return self._call(examples, "pt")

    def numpy_call(self, examples: list[Any]) -> dict[str, Any]:
        return self._call(examples, "np")

    def _call(self, examples: list[Any], return_tensors: str) -> dict[str, Any]:
        parent = super().torch_call if return_tensors == "pt" else super().numpy_call
        native = functools.partial(self._native_call, return_tensors=return_tensors)
        return native_or_reference(self, native, parent, examples, refusal=_probe)

    def _native_call(self, examples: Any, return_tensors: str | None = None) -> dict[str, Any]:
        if return_tensors is None:
            return_tensors = self.return_tensors
        if self.mlm:
            raise HandOver("mlm=True (masked LM)")
        examples = _rows.as_example_list(examples)
        if examples and not isinstance(examples[0], Mapping):
            batch = self._collate_sequences(examples, return_tensors)
        else:
            if self.tokenizer.model_input_names[:1] != ["input_ids"]:
                raise HandOver("the tokenizer's main input is not input_ids")
            batch = _pad(
                self.tokenizer,
                examples,
                padding=True,
                max_length=None,
                pad_to_multiple_of=self.pad_to_multiple_of,
                return_tensors=return_tensors,
            )
            batch = BatchEncoding(batch)
        batch.pop("special_tokens_mask", None)
        batch.pop("offset_mapping", None)
        labels = batch["input_ids"].copy()
        if self.tokenizer.pad_token_id is not None:
            labels[labels == self.tokenizer.pad_token_id] = -100
        batch["labels"] = labels
        return _tensors(batch, return_tensors)

    def _collate_sequences(self, examples: list[Any], return_tensors: str) -> dict[str, Any]:
        """Examples that are bare token sequences: transformers' ``_torch_collate_batch`` /
        ``_numpy_collate_batch`` (a plain dict with ``input_ids``; a pad token only when padding)."""
        first = examples[0]
        if isinstance(first, torch.Tensor):
            raise HandOver("examples are tensors (transformers keeps their dtype)")
        if return_tensors == "np" and isinstance(first, np.ndarray):
            raise HandOver(
                "examples are numpy arrays with return_tensors='np' (transformers keeps their dtype)"
            )
        if not isinstance(first, (list, tuple, np.ndarray)):
            raise HandOver(f"examples are {type(first).__name__}")
        tok, multiple = self.tokenizer, self.pad_to_multiple_of
        rows = read(examples, "input_ids")
        lengths = rows.lengths
        first_length = int(lengths[0])
        if (lengths == first_length).all() and round_up(first_length, multiple) == first_length:
            return {"input_ids": rows.values.reshape(len(lengths), first_length)}
        if tok.pad_token is None:
            raise ValueError(
                "You are attempting to pad samples but the tokenizer you are using"
                f" ({tok.__class__.__name__}) does not have a pad token."
            )
        width = round_up(int(lengths.max()), multiple)
        side = "right" if tok.padding_side == "right" else "left"
        settings = f"pad_to_multiple_of={multiple}"
        pad_id = _rows.int64_setting(tok.pad_token_id, "the tokenizer's pad_token_id")
        return {"input_ids": _rows.pad(rows, width, pad_id, side, "input_ids", settings)}


class DataCollatorForSeq2Seq(hf.DataCollatorForSeq2Seq):
    """transformers' ``DataCollatorForSeq2Seq``, inputs and labels padded in Rust.

    ``decoder_input_ids`` still come from ``model.prepare_decoder_input_ids_from_labels`` when a
    model is given, as in transformers.
    """

    fasttrain_native = True

    def __call__(self, features: list[dict[str, Any]], return_tensors: str | None = None) -> dict[str, Any]:
        return native_or_reference(
            self, self._native_call, super().__call__, features, return_tensors, refusal=_probe
        )

    def _native_call(self, features: Any, return_tensors: str | None = None) -> dict[str, Any]:
        if return_tensors is None:
            return_tensors = self.return_tensors
        features = _rows.example_mappings(features)
        first = features[0]
        label_name = "label" if "label" in first else "labels"
        has_labels = label_name in first and not all(v is None for v in column(features, label_name))
        if not has_labels and label_name == "label" and "labels" in first:
            raise HandOver("examples carry both 'label' and 'labels'")

        batch = _pad(
            self.tokenizer,
            features,
            padding=self.padding,
            max_length=self.max_length,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_tensors=return_tensors,
            exclude=label_name,
        )
        padded_keys = [k for k, v in batch.items() if isinstance(v, np.ndarray)]
        if has_labels:
            batch["labels"] = self._pad_labels(read(column(features, label_name), label_name), label_name)
            padded_keys.append("labels")
        else:
            batch["labels"] = None
        batch = BatchEncoding(_tensors(batch, return_tensors, padded_keys))

        model = self.model
        if has_labels and model is not None and hasattr(model, "prepare_decoder_input_ids_from_labels"):
            batch["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
        return batch

    def _pad_labels(self, labels: Rows, label_name: str) -> np.ndarray:
        """transformers' own label padding: its arithmetic (not tokenizer.pad's) and its side rule."""
        multiple = self.pad_to_multiple_of
        if self.padding is False or self.padding == PaddingStrategy.DO_NOT_PAD:
            target = None
        else:
            max_padding = self.padding == PaddingStrategy.MAX_LENGTH and self.max_length is not None
            target = int(labels.lengths.max()) if not max_padding else self.max_length
            if multiple is not None:
                if multiple == 0:
                    raise ValueError("pad_to_multiple_of must not be 0 (the reference divides by it)")
                target = (target + multiple - 1) // multiple * multiple
        width = _rows.uniform_width(labels.lengths, target)
        if width is None:
            raise _rows.ragged_error(labels.lengths, target, label_name)
        padding_needed = width > labels.lengths.min()
        pad_id = _rows.int64_setting(self.label_pad_token_id, "label_pad_token_id") if padding_needed else 0
        side = "right" if self.tokenizer.padding_side == "right" else "left"
        settings = f"padding={self.padding!r}, max_length={self.max_length}, pad_to_multiple_of={multiple}"
        return _rows.pad(labels, width, pad_id, side, label_name, settings)


class DataCollatorWithFlattening(hf.DataCollatorWithFlattening):
    """transformers' ``DataCollatorWithFlattening`` (padding-free batches), rows read in Rust."""

    fasttrain_native = True

    def __call__(
        self,
        features: list[dict[str, Any]],
        return_tensors: str | None = None,
        separator_id: int | None = None,
    ) -> dict[str, Any]:
        return native_or_reference(
            self, self._native_call, super().__call__, features, return_tensors, separator_id, refusal=_probe
        )

    def _native_call(
        self, features: Any, return_tensors: str | None = None, separator_id: int | None = None
    ) -> dict[str, Any]:
        if return_tensors is None:
            return_tensors = self.return_tensors
        if separator_id is None:
            separator_id = self.separator_id
        if return_tensors not in _NATIVE_TENSORS:
            raise HandOver(f"return_tensors={return_tensors!r}")
        features = _rows.as_example_list(features)
        ids = read(column(features, "input_ids"), "input_ids")
        kept = np.flatnonzero(ids.lengths > 0)  # transformers drops empty examples first
        if len(kept) < len(ids.lengths) and not collator_probe.flattening_drops_empty_examples(
            transformers.__version__
        ):
            raise HandOver(f"empty examples (transformers {transformers.__version__} keeps them)")
        if len(kept) == 0:
            raise ValueError("DataCollatorWithFlattening received a batch where every example is empty.")
        ids = Rows(ids.values, ids.lengths[kept])
        total = len(ids.values)
        starts = ids.starts
        separator_id = _rows.int64_setting(separator_id, "separator_id")
        if "labels" in features[kept[0]]:  # asked of the first kept example, as transformers does
            kept_features = [features[i] for i in kept]
            labels = read(column(kept_features, "labels", kept), "labels", kept)
            # transformers writes [separator] + labels[1:] per example: it must line up with input_ids
            if not np.array_equal(np.maximum(labels.lengths, 1), ids.lengths):
                i = int(np.flatnonzero(np.maximum(labels.lengths, 1) != ids.lengths)[0])
                raise ValueError(
                    f"example {kept[i]}: 'labels' has length {labels.lengths[i]} but 'input_ids' has length "
                    f"{ids.lengths[i]}"
                )
            firsts = labels.starts[labels.lengths > 0]
            rest = np.ones(len(labels.values), dtype=bool)
            rest[firsts] = False
            flat_labels = np.full(total, separator_id, dtype=np.int64)
            not_first = np.ones(total, dtype=bool)
            not_first[starts] = False
            flat_labels[not_first] = labels.values[rest]
        else:
            flat_labels = ids.values.copy()
            flat_labels[starts] = separator_id

        batch: dict[str, Any] = {"input_ids": ids.values[None], "labels": flat_labels[None]}
        if self.return_position_ids:
            start = _rows.int64_setting(getattr(self, "position_ids_start", 0), "position_ids_start")
            _rows.int64_setting(
                start + int(ids.lengths.max()) - 1, "position_ids_start + the longest length - 1"
            )
            batch["position_ids"] = _rows.positions(ids, start)[None]
        if self.return_seq_idx:
            batch["seq_idx"] = np.repeat(np.arange(len(kept), dtype=np.int32), ids.lengths)[None]
        if self.return_flash_attn_kwargs:
            if total > np.iinfo(np.int32).max:
                raise ValueError(f"the flattened batch has {total} tokens; cu_seq_lens are int32")
            cu_seq_lens = np.concatenate([[0], np.cumsum(ids.lengths)]).astype(np.int32)
            batch["cu_seq_lens_q"] = cu_seq_lens
            batch["cu_seq_lens_k"] = cu_seq_lens.copy()
            batch["max_length_q"] = batch["max_length_k"] = int(ids.lengths.max())
        return _tensors(batch, return_tensors)


_EQUIVALENTS: dict[type, type] = {
    hf.DataCollatorWithPadding: DataCollatorWithPadding,
    hf.DataCollatorForLanguageModeling: DataCollatorForLanguageModeling,
    hf.DataCollatorForSeq2Seq: DataCollatorForSeq2Seq,
    hf.DataCollatorWithFlattening: DataCollatorWithFlattening,
}
_NATIVE = frozenset(_EQUIVALENTS.values())  # the classes whose batches collator_probe checks


def _qualified(obj: Any) -> str:
    """``module.QualName`` of a class or function, else of the object's class."""
    target = obj if isinstance(obj, type) or inspect.isroutine(obj) else type(obj)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def _trl_equivalents() -> dict[type, type]:
    """TRL's collators and ours; TRL is imported only once one of its objects exists. Empty when this TRL has
    other collators, or ones that make other batches than ours (checked once, logged)."""
    try:
        from . import trl_collators
    except (ImportError, AttributeError) as err:
        log_once(
            "trl-collators-import", f"fasttrain: TRL's collators are kept (this TRL does not fit: {err})"
        )
        return {}
    return trl_collators.EQUIVALENTS if trl_collators.agrees_with_trl() else {}


def _equivalents_for(cls: type) -> dict[type, type]:
    return {**_EQUIVALENTS, **_trl_equivalents()} if from_package(cls, "trl") else _EQUIVALENTS


def native_equivalent(collator: object) -> object | None:
    """fasttrain's collator with the same settings as ``collator``, or None (``why_no_native_equivalent``
    says why).

    ``collator`` must be an instance of exactly one of the replaced classes (transformers' four, TRL's
    language-modeling and preference collators); a user subclass may change behaviour, so it is left
    alone. Ours are returned as they are. A masked-LM collator (``mlm=True``) gives None: transformers'
    object does that work. So does a transformers collator that ``collator_probe.refusal`` refuses (a field
    the native path does not know, or a transformers release whose batches differ from ours on the probes).
    """
    if getattr(type(collator), "fasttrain_native", False):
        return collator
    ours = _equivalents_for(type(collator)).get(type(collator))
    if ours is None or (ours is DataCollatorForLanguageModeling and collator.mlm):
        return None
    twin = _twin(ours, collator)
    if ours in _NATIVE and collator_probe.refusal(twin) is not None:
        return None  # a field we do not know, or this transformers makes other batches: keep its collator
    return twin


def _twin(ours: type, collator: object) -> object:
    """An instance of ``ours`` with ``collator``'s settings as they are after ``__post_init__`` (no second
    validation, no re-derivation)."""
    twin = ours.__new__(ours)
    twin.__dict__.update(vars(collator))
    return twin


def replaced_in_kind(collator: object) -> bool:
    """Whether ``collator`` is exactly one of the classes fasttrain replaces (so keeping it is a fallback, not a
    user's own collator left alone)."""
    return type(collator) in _equivalents_for(type(collator))


def why_no_native_equivalent(collator: object) -> str:
    """Why ``native_equivalent(collator)`` is None, naming the class (or function) with its module."""
    name = _qualified(collator)
    cls = type(collator)
    equivalents = _equivalents_for(cls)
    if equivalents.get(cls) is DataCollatorForLanguageModeling and getattr(collator, "mlm", False):
        return f"{name} with mlm=True (masked LM) keeps transformers' masking"
    ours = equivalents.get(cls)
    why = collator_probe.refusal(_twin(ours, collator)) if ours in _NATIVE else None
    if why is not None:
        return why
    replaced = next((base for base in cls.__mro__[1:] if base in equivalents), None)
    if replaced is not None and not inspect.isroutine(collator):
        return f"{name} subclasses {_qualified(replaced)} and may change what it does, so it is kept"
    return f"{name} has no native equivalent"
