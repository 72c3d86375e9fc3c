"""KTOTrainer's collator, ``trl.trainer.kto_trainer.DataCollatorForUnpairedPreference``, with the rows read and
padded in Rust.

Per example, ``prompt_ids + completion_ids`` (and ``prompt_ids + KL_completion_ids`` when example 0 has KL
completions), cut to ``max_length`` by Python's slice (TRL's), padded to the longest row (raised to
``pad_to_multiple_of``) with an attention mask and a completion mask; then ``ref_logps``, ``ref_KL_logps`` and
``label`` through ``torch.tensor`` as TRL converts them. TRL casts every row to int64 itself, so empty rows are
int64 here too. The prompt and its completion are read by one Rust call over ``[prompt 0, completion 0,
prompt 1, ...]``: each joined row is two neighbouring runs of the flat values, no Python list is built.

Handed to TRL's own code (logged once): sequences that are not Python lists (TRL adds them with ``+``: numpy
arrays and tensors add element-wise), token ids TRL's ``torch.tensor(..., dtype=torch.int64)`` casts but that are
not integers (floats are truncated there) or that lie in a tail ``max_length`` cuts off, a ``pad_token_id`` that is a non-integer number (``torch.full`` casts
it). Bad input raises ValueError/TypeError/KeyError naming the example and the key.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any

import numpy as np
import torch
from trl.trainer import kto_trainer as trl_kto

from . import _rows
from ._rows import HandOver, Rows, column, native_or_reference, round_up

__all__ = ["PROBES", "DataCollatorForUnpairedPreference"]

_BIG = 2**62  # longer than any row: a max_length at least this long cuts nothing, a negative one everything


def _kept_lengths(lengths: np.ndarray, max_length: Any) -> np.ndarray:
    """``len(row[:max_length])`` for rows of ``lengths`` (Python's slice rules: a negative bound counts from the
    end), without making the slices."""
    if max_length is None:
        return lengths
    bound = max(-_BIG, min(_BIG, operator.index(max_length)))  # TypeError where a list slice raises one
    if bound >= 0:
        return np.minimum(lengths, bound)
    return np.maximum(lengths + bound, 0)


def _joined_rows(prompts: list, answers: list, ids_key: str, max_length: Any) -> Rows:
    """``prompts[i] + answers[i]`` as rows (uncut), read in one Rust call over the two lists interleaved."""
    interleaved = [row for pair in zip(prompts, answers, strict=True) for row in pair]
    try:
        flat = _rows.read(interleaved, "prompt_ids", [i for i in range(len(prompts)) for _ in (0, 1)])
    except (TypeError, ValueError):
        _refusal(prompts, answers, ids_key, max_length)
        raise
    lengths = flat.lengths.reshape(-1, 2).sum(axis=1)
    return Rows(flat.values, lengths)


def _refusal(prompts: list, answers: list, ids_key: str, max_length: Any) -> None:
    """After a read failed: hand over where TRL's own cast accepts every row as TRL cuts it (floats, which it
    truncates; anything in a tail it cuts off), else raise the error naming the key it came from."""
    bounds = slice(None) if max_length is None else slice(None, max_length)
    try:
        for p, a in zip(prompts, answers, strict=True):
            torch.tensor((p + a)[bounds], dtype=torch.int64)
    except Exception:  # TRL fails on this batch too: ours names the culprit
        for key, values in (("prompt_ids", prompts), (ids_key, answers)):
            _rows.read(values, key)
        return
    raise HandOver(
        "token ids that are not integers (TRL casts them with torch.tensor(..., dtype=torch.int64))"
    )


class DataCollatorForUnpairedPreference(trl_kto.DataCollatorForUnpairedPreference):
    """TRL's KTO ``DataCollatorForUnpairedPreference``, built in Rust (same arguments and outputs)."""

    fasttrain_native = True

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        return native_or_reference(self, self._native_call, super().torch_call, examples)

    def _native_call(self, examples: Any) -> dict[str, Any]:
        examples = _rows.example_mappings(examples)
        keys = [(p, k) for p, k in (("", "completion_ids"), ("KL_", "KL_completion_ids")) if k in examples[0]]
        values = {}
        for key in ["prompt_ids"] * bool(keys) + [k for _, k in keys]:
            values[key] = column(examples, key)
            if not all(type(v) is list for v in values[key]):
                raise HandOver(f"'{key}' values are not all lists (TRL joins them with +)")
        output: dict[str, Any] = {}
        if keys:
            pad_id = self._pad_id()
            prompt_lengths = np.array([len(p) for p in values["prompt_ids"]], dtype=np.int64)
        for prefix, ids_key in keys:
            rows = _joined_rows(values["prompt_ids"], values[ids_key], ids_key, self.max_length)
            kept = _kept_lengths(rows.lengths, self.max_length)
            if not np.array_equal(kept, rows.lengths):  # drop each row's cut tail
                rows = Rows(rows.values[_rows.positions(rows) < np.repeat(kept, rows.lengths)], kept)
            width = round_up(int(kept.max()), self.pad_to_multiple_of)
            settings = f"max_length={self.max_length}, pad_to_multiple_of={self.pad_to_multiple_of}"
            input_ids = _rows.pad(rows, width, pad_id, "right", f"{prefix}input_ids", settings)
            attention = _rows.mask(kept, width)
            # a completion token: past its prompt (and, by the attention mask, inside the kept row)
            completion = attention * (np.arange(width) >= prompt_lengths[:, None])
            output[f"{prefix}input_ids"] = torch.from_numpy(input_ids)
            output[f"{prefix}attention_mask"] = torch.from_numpy(attention)
            output[f"{prefix}completion_mask"] = torch.from_numpy(completion)
        for key in ("ref_logps", "ref_KL_logps"):
            if key in examples[0]:  # TRL's own conversion: whatever torch.tensor makes of them
                output[key] = torch.tensor(column(examples, key))
        output["label"] = torch.tensor(column(examples, "label"))
        return output

    def _pad_id(self) -> int:
        """The pad id as an int64 (TRL's ``torch.full`` casts a non-integer number: that case is TRL's)."""
        try:
            return _rows.int64_setting(self.pad_token_id, "pad_token_id")
        except TypeError:
            if isinstance(self.pad_token_id, numbers.Real):
                raise HandOver(
                    f"pad_token_id={self.pad_token_id!r} is not an integer (TRL's torch.full casts it)"
                ) from None
            raise


# Probe batches for ``trl_collators.agrees_with_trl``: every key and both truncation cases (an empty KL row too).
PROBES = [
    (
        trl_kto.DataCollatorForUnpairedPreference,
        dict(pad_token_id=0, max_length=max_length, pad_to_multiple_of=3),
        [
            {
                "prompt_ids": [1, 2, 3],
                "completion_ids": [4, 5],
                "KL_completion_ids": [6],
                "label": True,
                "ref_logps": -1.5,
                "ref_KL_logps": -0.5,
            },
            {
                "prompt_ids": [7],
                "completion_ids": [8, 9, 10],
                "KL_completion_ids": [],
                "label": False,
                "ref_logps": -2.0,
                "ref_KL_logps": -1.0,
            },
        ],
    )
    for max_length in (None, 3)
]
