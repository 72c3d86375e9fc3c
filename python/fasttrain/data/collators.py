"""Drop-in replacements for transformers' padding collators, with the padding done in Rust.

Each class subclasses the transformers class of the same name, so it takes the same constructor
arguments (same names, same defaults, same validation), passes ``isinstance`` checks, pickles the
same way, and returns the same type with the same keys in the same order, dtypes and values.

What runs natively: the token keys that ``tokenizer.pad`` pads (the model's main input,
``attention_mask``, ``token_type_ids``, ``special_tokens_mask``), the labels of the LM and seq2seq
collators, and the whole of ``DataCollatorWithFlattening``. Each sequence crosses into Rust once
(lists are walked in Rust, numpy arrays and torch tensors are read from their buffer), padding runs
with the GIL released, and the arrays come back without a copy (``torch.from_numpy``).

What stays in transformers' code: keys that are not padded (``label``, float features, ...) are
converted by transformers' own ``BatchEncoding`` exactly as ``tokenizer.pad`` converts them, and a
whole batch is handed to the transformers class when it needs something the native path does not
model (``mlm=True``, a tokenizer that overrides ``pad``, examples that are neither mappings nor
bare token lists, ``return_tensors`` other than "pt"/"np", 4-d attention masks, ragged batches with
``return_tensors="np"``). Each such hand-over is logged once.

Bad input raises ValueError/TypeError/KeyError naming the example and the key; where transformers
would fail later with a generic message or return mismatched shapes, these raise up front.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from transformers.data import data_collator as hf
from transformers.tokenization_utils_base import BatchEncoding, PreTrainedTokenizerBase
from transformers.utils import PaddingStrategy
from transformers.utils.generic import to_py_obj

from .. import _native
from .._logging import log_once

__all__ = [
    "DataCollatorForLanguageModeling",
    "DataCollatorForSeq2Seq",
    "DataCollatorWithFlattening",
    "DataCollatorWithPadding",
    "native_equivalent",
]

_NATIVE_TENSORS = ("pt", "np")
# tokenizer.pad's padding values besides the main input (model_input_names[0]) and the mask.
_PAD_VALUE_ATTR = {"token_type_ids": "pad_token_type_id"}
_PAD_VALUE_CONST = {"special_tokens_mask": 1}


class _HandOver(Exception):
    """This batch needs transformers' own code path (the message says why)."""


def _hand_over(collator: object, why: _HandOver) -> None:
    name = type(collator).__name__
    log_once(
        f"collate-handover:{name}:{why}",
        f"fasttrain.{name}: {why}; this case runs through transformers' {name} (logged once)",
    )


def _has_standard_pad(tokenizer: Any) -> bool:
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerBase)
        and getattr(cls, "pad", None) is PreTrainedTokenizerBase.pad
        and getattr(cls, "_pad", None) is PreTrainedTokenizerBase._pad
    )


def _as_example_list(features: Any) -> list:
    if isinstance(features, list):
        return features
    if isinstance(features, tuple):
        return list(features)
    raise _HandOver(f"features is a {type(features).__name__}, not a list of examples")


def _column(features: list, key: str) -> list:
    """``[f[key] for f in features]`` with a KeyError that names the example."""
    try:
        return [f[key] for f in features]
    except KeyError:
        for i, f in enumerate(features):
            if key not in f:
                raise KeyError(f"example {i} has no key '{key}'") from None
        raise


def _padding_name(strategy: PaddingStrategy) -> str:
    return PaddingStrategy(strategy).value


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
        raise _HandOver(f"return_tensors={return_tensors!r}")
    if not _has_standard_pad(tokenizer):
        raise _HandOver(f"{type(tokenizer).__name__} has its own pad()")
    features = _as_example_list(features)
    if not features:
        raise ValueError("cannot collate an empty batch (no examples)")
    first = features[0]
    if not isinstance(first, Mapping):
        raise _HandOver(f"examples are {type(first).__name__}, not mappings")
    main = tokenizer.model_input_names[0]
    if main not in first:
        raise ValueError(
            "You should supply an encoding or a list of encodings to this method "
            f"that includes {main}, but you provided {list(first.keys())} (example 0)"
        )
    if getattr(first.get("attention_mask"), "ndim", 0) > 1:
        raise _HandOver("4-d attention masks")

    strategy, _, max_length, _ = tokenizer._get_padding_truncation_strategies(
        padding=padding, max_length=max_length, verbose=True
    )
    if return_tensors == "np" and strategy != PaddingStrategy.LONGEST:
        _refuse_ragged_numpy(
            features, main, max_length if strategy == PaddingStrategy.MAX_LENGTH else None, pad_to_multiple_of
        )
    return_attention_mask = "attention_mask" in tokenizer.model_input_names
    keys = [k for k in first.keys() if k != exclude]  # noqa: SIM118 - .keys() as transformers (Mapping subclasses)

    pad_values = {main: tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0}
    if return_attention_mask:
        pad_values["attention_mask"] = 0
    for key, attr in _PAD_VALUE_ATTR.items():
        pad_values[key] = getattr(tokenizer, attr)
    pad_values.update(_PAD_VALUE_CONST)
    padded_keys = [main] + [k for k in keys if k != main and k in pad_values]
    make_mask = return_attention_mask and "attention_mask" not in first
    for key in padded_keys:
        if _starts_with_bool(features, key):
            raise _HandOver(f"'{key}' holds booleans (torch.tensor keeps them as bool)")

    arrays = _native.pad_features(
        features,
        [(k, int(pad_values[k])) for k in padded_keys],
        padding=_padding_name(strategy),
        max_length=max_length,
        pad_to_multiple_of=pad_to_multiple_of,
        padding_side=tokenizer.padding_side,
        attention_mask=make_mask,
    )
    padded = dict(zip(padded_keys, arrays, strict=False))
    if make_mask:
        padded["attention_mask"] = arrays[-1]

    # Keys tokenizer.pad does not pad go through transformers' own tensor conversion. It first
    # turns every value into Python objects when the main input is an array or tensor.
    others = {k: _column(features, k) for k in keys if k not in padded}
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


def _refuse_ragged_numpy(features: list, main: str, max_length: int | None, multiple: int | None) -> None:
    """With return_tensors="np", transformers returns a ragged batch as object arrays (by design).
    That layout is transformers' to build: such a batch is handed over."""
    target = max_length
    if target is not None and multiple and target % multiple:
        target = (target // multiple + 1) * multiple
    lengths = {len(v) if target is None else max(len(v), target) for v in _column(features, main)}
    if len(lengths) > 1:
        raise _HandOver("a ragged batch with return_tensors='np' (object arrays)")


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

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        try:
            padded = _pad(
                self.tokenizer,
                features,
                padding=self.padding,
                max_length=self.max_length,
                pad_to_multiple_of=self.pad_to_multiple_of,
                return_tensors=self.return_tensors,
            )
        except _HandOver as why:
            _hand_over(self, why)
            return super().__call__(features)
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

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        return self._call(examples, "pt")

    def numpy_call(self, examples: list[Any]) -> dict[str, Any]:
        return self._call(examples, "np")

    def _call(self, examples: list[Any], return_tensors: str) -> dict[str, Any]:
        try:
            if self.mlm:
                raise _HandOver("mlm=True (masked LM)")
            examples = _as_example_list(examples)
            if examples and not isinstance(examples[0], Mapping):
                batch = self._collate_sequences(examples, return_tensors)
            else:
                if self.tokenizer.model_input_names[:1] != ["input_ids"]:
                    raise _HandOver("the tokenizer's main input is not input_ids")
                batch = _pad(
                    self.tokenizer,
                    examples,
                    padding=True,
                    max_length=None,
                    pad_to_multiple_of=self.pad_to_multiple_of,
                    return_tensors=return_tensors,
                )
                batch = BatchEncoding(batch)
        except _HandOver as why:
            _hand_over(self, why)
            parent = super().torch_call if return_tensors == "pt" else super().numpy_call
            return parent(examples)
        batch.pop("special_tokens_mask", None)
        batch.pop("offset_mapping", None)
        batch["labels"] = _native.causal_lm_labels(batch["input_ids"], self.tokenizer.pad_token_id)
        return _tensors(batch, return_tensors)

    def _collate_sequences(self, examples: list[Any], return_tensors: str) -> dict[str, Any]:
        """Examples that are bare token sequences: transformers' ``_torch_collate_batch`` /
        ``_numpy_collate_batch`` (a plain dict with ``input_ids``; a pad token only when padding)."""
        first = examples[0]
        if isinstance(first, torch.Tensor):
            raise _HandOver("examples are tensors (transformers keeps their dtype)")
        if return_tensors == "np" and isinstance(first, np.ndarray):
            raise _HandOver(
                "examples are numpy arrays with return_tensors='np' (transformers keeps their dtype)"
            )
        if not isinstance(first, (list, tuple, np.ndarray)):
            raise _HandOver(f"examples are {type(first).__name__}")
        tok, multiple = self.tokenizer, self.pad_to_multiple_of
        lengths = {len(e) for e in examples}
        needs_padding = len(lengths) > 1 or (multiple is not None and len(first) % multiple != 0)
        if needs_padding and tok.pad_token is None:
            raise ValueError(
                "You are attempting to pad samples but the tokenizer you are using"
                f" ({tok.__class__.__name__}) does not have a pad token."
            )
        (input_ids,) = _native.pad_features(
            [{"input_ids": e} for e in examples],
            [("input_ids", int(tok.pad_token_id) if needs_padding else 0)],
            padding="longest" if needs_padding else "do_not_pad",
            max_length=None,
            pad_to_multiple_of=multiple if needs_padding else None,
            padding_side="right" if tok.padding_side == "right" else "left",
            attention_mask=False,
        )
        return {"input_ids": input_ids}


class DataCollatorForSeq2Seq(hf.DataCollatorForSeq2Seq):
    """transformers' ``DataCollatorForSeq2Seq``, inputs and labels padded in Rust.

    ``decoder_input_ids`` still come from ``model.prepare_decoder_input_ids_from_labels`` when a
    model is given, as in transformers.
    """

    def __call__(self, features: list[dict[str, Any]], return_tensors: str | None = None) -> dict[str, Any]:
        if return_tensors is None:
            return_tensors = self.return_tensors
        try:
            return self._native_call(features, return_tensors)
        except _HandOver as why:
            _hand_over(self, why)
            return super().__call__(features, return_tensors)

    def _native_call(self, features: Any, return_tensors: str) -> dict[str, Any]:
        features = _as_example_list(features)
        if not features:
            raise ValueError("cannot collate an empty batch (no examples)")
        first = features[0]
        if not isinstance(first, Mapping):
            raise _HandOver(f"examples are {type(first).__name__}, not mappings")
        label_name = "label" if "label" in first else "labels"
        has_labels = label_name in first and not all(v is None for v in _column(features, label_name))
        if not has_labels and label_name == "label" and "labels" in first:
            raise _HandOver("examples carry both 'label' and 'labels'")

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
            batch["labels"] = self._pad_labels(features, label_name)
            padded_keys.append("labels")
        else:
            batch["labels"] = None
        batch = BatchEncoding(_tensors(batch, return_tensors, padded_keys))

        model = self.model
        if has_labels and model is not None and hasattr(model, "prepare_decoder_input_ids_from_labels"):
            batch["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=batch["labels"])
        return batch

    def _pad_labels(self, features: list, label_name: str) -> np.ndarray:
        if self.padding is False or self.padding == PaddingStrategy.DO_NOT_PAD:
            padding, max_length = "do_not_pad", None
        elif self.padding == PaddingStrategy.MAX_LENGTH and self.max_length is not None:
            padding, max_length = "max_length", self.max_length
        else:
            padding, max_length = "longest", None
        # transformers pads labels on the right only when padding_side is "right".
        side = "right" if self.tokenizer.padding_side == "right" else "left"
        (labels,) = _native.pad_features(
            features,
            [(label_name, int(self.label_pad_token_id))],
            padding=padding,
            max_length=max_length,
            pad_to_multiple_of=self.pad_to_multiple_of if padding != "do_not_pad" else None,
            padding_side=side,
            attention_mask=False,
        )
        return labels


class DataCollatorWithFlattening(hf.DataCollatorWithFlattening):
    """transformers' ``DataCollatorWithFlattening`` (padding-free batches), built in Rust."""

    def __call__(
        self,
        features: list[dict[str, Any]],
        return_tensors: str | None = None,
        separator_id: int | None = None,
    ) -> dict[str, Any]:
        if return_tensors is None:
            return_tensors = self.return_tensors
        if separator_id is None:
            separator_id = self.separator_id
        try:
            if return_tensors not in _NATIVE_TENSORS:
                raise _HandOver(f"return_tensors={return_tensors!r}")
            features = _as_example_list(features)
        except _HandOver as why:
            _hand_over(self, why)
            return super().__call__(features, return_tensors, separator_id)

        input_ids, labels, position_ids, seq_idx, cu_seq_lens, max_length = _native.flatten_features(
            features,
            separator_id=int(separator_id),
            position_ids_start=int(getattr(self, "position_ids_start", 0)),
            position_ids=bool(self.return_position_ids),
            seq_idx=bool(self.return_seq_idx),
            flash_attn_kwargs=bool(self.return_flash_attn_kwargs),
        )
        batch: dict[str, Any] = {"input_ids": input_ids, "labels": labels}
        if position_ids is not None:
            batch["position_ids"] = position_ids
        if seq_idx is not None:
            batch["seq_idx"] = seq_idx
        if cu_seq_lens is not None:
            batch["cu_seq_lens_q"] = cu_seq_lens
            batch["cu_seq_lens_k"] = cu_seq_lens.copy()
            batch["max_length_q"] = batch["max_length_k"] = max_length
        return _tensors(batch, return_tensors)


_EQUIVALENTS: dict[type, type] = {
    hf.DataCollatorWithPadding: DataCollatorWithPadding,
    hf.DataCollatorForLanguageModeling: DataCollatorForLanguageModeling,
    hf.DataCollatorForSeq2Seq: DataCollatorForSeq2Seq,
    hf.DataCollatorWithFlattening: DataCollatorWithFlattening,
}


def native_equivalent(collator: object) -> object | None:
    """fasttrain's collator with the same settings as ``collator``, or None.

    ``collator`` must be an instance of exactly one of the four transformers classes (a user
    subclass may change behaviour, so it is left alone); ours are returned as they are. A masked-LM
    collator (``mlm=True``) gives None: transformers' object does that work.
    """
    if isinstance(collator, tuple(_EQUIVALENTS.values())):
        return collator
    ours = _EQUIVALENTS.get(type(collator))
    if ours is None:
        return None
    if ours is DataCollatorForLanguageModeling and collator.mlm:
        return None
    # Copy the settings as they are after __post_init__ (no second validation, no re-derivation).
    twin = ours.__new__(ours)
    twin.__dict__.update(vars(collator))
    return twin
