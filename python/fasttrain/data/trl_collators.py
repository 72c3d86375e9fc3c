"""Drop-in replacements for TRL's own collators, with the token rows read and padded in Rust.

- ``DataCollatorForLanguageModeling`` subclasses ``trl.trainer.sft_trainer.DataCollatorForLanguageModeling``
  (SFTTrainer's): padded batches with an attention mask (and ``position_ids`` on request), or padding-free
  batches (``padding_free=True``: one row, ``position_ids``, ``cu_seq_lens_*``, ``max_length_*``, ``seq_idx``),
  packed examples (``seq_lengths``) and ``pad_to_multiple_of``. Completion and assistant masks are folded into
  ``labels`` by SFTTrainer before the collator, which ignores them; so does this one.
- ``DataCollatorForPreference`` subclasses ``trl.trainer.dpo_trainer.DataCollatorForPreference``
  (DPOTrainer's): prompt + chosen and prompt + rejected rows, truncated to ``max_length`` (``keep_start`` /
  ``keep_end``), with attention and completion masks and the optional reference log-probs.
- ``DataCollatorForUnpairedPreference`` (KTOTrainer's, in ``trl_kto_collator``): prompt + completion rows (and
  prompt + KL completion), cut at ``max_length``, with attention and completion masks, labels, reference log-probs.

All return the same keys in the same order, dtypes and values as TRL's classes, with TRL's arithmetic for the
settings (Python slices for the truncation, TRL's ``pad`` rounding). This module imports TRL, so it is only
imported once a TRL collator exists (``native_equivalent`` does that) or by a user who names it: TRL is never a
dependency of ``import fasttrain``. Written against TRL 1.16: ``native_equivalent`` first checks once per process
that the installed TRL's collators still make the same batches on a few probes (``agrees_with_trl``), and keeps
TRL's own otherwise (logged).

Handed to TRL's own code (logged once): batches whose first row TRL would turn into a non-int64 tensor (an
empty row is float32 to ``torch.tensor``; int32 arrays stay int32), padding-free batches with any such row
(``torch.cat`` promotes), preference examples that are not Python lists (TRL adds them with ``+``).
Bad input raises ValueError/TypeError/KeyError naming the example and the key, also where TRL would return
misaligned tensors (``seq_lengths`` that do not add up to the example's length, labels of another length
than ``input_ids`` in a padding-free batch).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import torch
import trl
from trl.trainer import dpo_trainer as trl_dpo
from trl.trainer import kto_trainer as trl_kto
from trl.trainer import sft_trainer as trl_sft

from .._logging import log_once
from ..labels import IGNORE_INDEX, ignore_example_starts
from . import _rows
from ._rows import HandOver, Rows, column, native_or_reference, read, round_up
from .collator_probe import batch_difference
from .trl_kto_collator import PROBES as KTO_PROBES
from .trl_kto_collator import DataCollatorForUnpairedPreference

__all__ = [
    "EQUIVALENTS",
    "DataCollatorForLanguageModeling",
    "DataCollatorForPreference",
    "DataCollatorForUnpairedPreference",
    "agrees_with_trl",
]


def _int64_row(value: Any) -> bool:
    """Whether ``torch.tensor(value)`` is a non-empty int64 tensor (checked on the first element for lists:
    a float further on is refused when the row is read, a bool further on becomes an int as in torch)."""
    if isinstance(value, (list, tuple)):
        return len(value) > 0 and type(value[0]) is int
    if isinstance(value, np.ndarray):
        return value.dtype == np.int64 and value.ndim == 1 and value.size > 0
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.int64 and value.ndim == 1 and value.numel() > 0
    return False


def _require_int64(values: list, key: str, every: bool) -> None:
    """Hands over unless TRL's tensor for ``key`` is int64: decided by the first row when padding (TRL's pad
    takes the first tensor's dtype), by every row when concatenating (``torch.cat`` promotes)."""
    for i, value in enumerate(values if every else values[:1]):
        if not _int64_row(value):
            raise HandOver(f"example {i}: '{key}' is not a non-empty int64 sequence (TRL keeps its dtype)")


def _width(rows: Rows, multiple: Any) -> int:
    """TRL's ``pad``: the longest row, raised to ``pad_to_multiple_of`` (it never truncates)."""
    return round_up(int(rows.lengths.max()), multiple)


def _document_positions(ids: Rows, seq_lengths: Rows) -> np.ndarray:
    """Positions of packed examples, restarting at every document (TRL's
    ``get_position_ids_from_packed_seq_lengths``), after checking the documents tile each example."""
    if len(seq_lengths.values) and seq_lengths.values.min() <= 0:
        doc = int(np.flatnonzero(seq_lengths.values <= 0)[0])
        example = int(np.searchsorted(np.cumsum(seq_lengths.lengths), doc, side="right"))
        raise ValueError(
            f"example {example}: 'seq_lengths' holds {seq_lengths.values[doc]}; lengths must be >= 1"
        )
    running = np.concatenate([[0], np.cumsum(seq_lengths.values)])
    sums = running[seq_lengths.starts + seq_lengths.lengths] - running[seq_lengths.starts]
    if not np.array_equal(sums, ids.lengths):
        i = int(np.flatnonzero(sums != ids.lengths)[0])
        raise ValueError(
            f"example {i}: 'seq_lengths' add up to {sums[i]} but 'input_ids' has length {ids.lengths[i]}"
        )
    return _rows.positions(Rows(ids.values, seq_lengths.values))


class DataCollatorForLanguageModeling(trl_sft.DataCollatorForLanguageModeling):
    """TRL's SFT ``DataCollatorForLanguageModeling``, built in Rust (same arguments and outputs)."""

    fasttrain_native = True

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        return native_or_reference(self, self._native_call, super().torch_call, examples)

    def _native_call(self, examples: Any) -> dict[str, Any]:
        examples = _rows.example_mappings(examples)
        ids_values = column(examples, "input_ids")
        label_values = [e.get("labels", ids) for e, ids in zip(examples, ids_values, strict=True)]
        seq_values = column(examples, "seq_lengths") if "seq_lengths" in examples[0] else None
        _require_int64(ids_values, "input_ids", every=self.padding_free)
        _require_int64(label_values, "labels", every=self.padding_free)
        want_positions = self.padding_free or self.return_position_ids
        if want_positions and seq_values is not None:
            _require_int64(seq_values, "seq_lengths", every=True)  # torch.tensor of all of them, flattened
        pad_id = _rows.int64_setting(self.pad_token_id, "pad_token_id")  # TRL's torch.full always uses it

        ids = read(ids_values, "input_ids")
        if all(label is value for label, value in zip(label_values, ids_values, strict=True)):
            labels = Rows(ids.values.copy(), ids.lengths)  # no labels: a copy of input_ids (TRL's default)
        else:
            labels = read(label_values, "labels")
        positions = None
        if want_positions:
            if seq_values is None:
                positions = _rows.positions(ids)
            else:
                positions = _document_positions(ids, read(seq_values, "seq_lengths"))
        multiple = self.pad_to_multiple_of
        settings = f"pad_to_multiple_of={multiple}"
        if self.padding_free:
            return self._padding_free(ids, labels, positions, pad_id, multiple, settings)

        width = _width(ids, multiple)
        output = {
            "input_ids": _rows.pad(ids, width, pad_id, "right", "input_ids", settings),
            "labels": _rows.pad(labels, _width(labels, multiple), IGNORE_INDEX, "right", "labels", settings),
        }
        if self.return_position_ids:
            output["position_ids"] = _rows.pad(
                Rows(positions, ids.lengths), width, 0, "right", "position_ids", settings
            )
        output["attention_mask"] = _rows.mask(ids.lengths, width)
        return {k: torch.from_numpy(v) for k, v in output.items()}

    @staticmethod
    def _padding_free(
        ids: Rows, labels: Rows, positions: np.ndarray, pad_id: int, multiple: Any, settings: str
    ) -> dict[str, Any]:
        """One row: every example concatenated, padded at the end; a label of -100 at every position 0
        (each sequence start, and the padding); boundaries wherever the position is 0, as TRL finds them."""
        if not np.array_equal(labels.lengths, ids.lengths):
            i = int(np.flatnonzero(labels.lengths != ids.lengths)[0])
            raise ValueError(
                f"example {i}: 'labels' has length {labels.lengths[i]} but 'input_ids' has length "
                f"{ids.lengths[i]}; a padding-free batch needs them aligned"
            )
        total = np.array([len(ids.values)], dtype=np.int64)
        width = round_up(int(total[0]), multiple)
        if width < total[0]:  # a negative pad_to_multiple_of: TRL's pad fails to fit the row
            raise ValueError(
                f"pad_to_multiple_of={multiple} gives width {width}, shorter than the {total[0]} tokens of the "
                "padding-free batch"
            )
        input_ids = _rows.pad(Rows(ids.values, total), width, pad_id, "right", "input_ids", settings)
        flat_labels = _rows.pad(Rows(labels.values, total), width, IGNORE_INDEX, "right", "labels", settings)
        position_ids = _rows.pad(Rows(positions, total), width, 0, "right", "position_ids", settings)
        ignore_example_starts(flat_labels, position_ids)
        if width > np.iinfo(np.int32).max:
            raise ValueError(f"the padding-free batch has {width} tokens; cu_seq_lens are int32")
        cu_seq_lens = torch.from_numpy(
            np.concatenate([np.flatnonzero(position_ids[0] == 0), [width]]).astype(np.int32)
        )
        sizes = np.diff(cu_seq_lens.numpy())
        max_length = int(sizes.max())
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(flat_labels),
            "position_ids": torch.from_numpy(position_ids),
            "cu_seq_lens_q": cu_seq_lens,  # one tensor under both names, as TRL does
            "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": max_length,
            "max_length_k": max_length,
            "seq_idx": torch.from_numpy(np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)[None]),
        }


class DataCollatorForPreference(trl_dpo.DataCollatorForPreference):
    """TRL's DPO ``DataCollatorForPreference``, built in Rust (same arguments and outputs)."""

    fasttrain_native = True

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        return native_or_reference(self, self._native_call, super().torch_call, examples)

    def _native_call(self, examples: Any) -> dict[str, Any]:
        examples = _rows.example_mappings(examples)
        keys = ("prompt_ids", "chosen_ids", "rejected_ids")
        values = {key: column(examples, key) for key in keys}
        for key in keys:
            if not all(type(v) is list for v in values[key]):
                raise HandOver(f"'{key}' values are not all lists (TRL joins them with +)")
        bounds = None
        if self.max_length is not None:
            if self.truncation_mode == "keep_start":
                bounds = slice(None, self.max_length)
            elif self.truncation_mode == "keep_end":
                bounds = slice(-self.max_length, None)
            else:
                raise HandOver(f"truncation_mode={self.truncation_mode!r} (TRL raises its own error)")
        first = (values["prompt_ids"][0] + values["chosen_ids"][0])[bounds or slice(None)]
        if not first or type(first[0]) is not int:
            raise HandOver("the first row is empty or does not start with an int (TRL keeps its dtype)")
        pad_id = _rows.int64_setting(self.pad_token_id, "pad_token_id")  # TRL's torch.full always uses it
        rows, starts = self._rows(values, bounds)
        width = _width(rows, self.pad_to_multiple_of)
        settings = f"max_length={self.max_length}, pad_to_multiple_of={self.pad_to_multiple_of}"
        input_ids = _rows.pad(rows, width, pad_id, "right", "input_ids", settings)
        # The masks from each row's length, its start in prompt + answer (keep_end cuts the head) and its
        # prompt's length: a token is a completion token when it lies past the prompt.
        prompt_lengths = np.array([len(p) for p in values["prompt_ids"]] * 2, dtype=np.int64)
        columns = np.arange(width)
        attention = columns < rows.lengths[:, None]
        completion = attention & (columns + starts[:, None] >= prompt_lengths[:, None])
        output = {
            "input_ids": input_ids,
            "attention_mask": attention.astype(np.int64),
            "completion_mask": completion.astype(np.int64),
        }
        output = {k: torch.from_numpy(v) for k, v in output.items()}
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in examples[0]:  # TRL's own conversion: floats stay whatever torch.tensor makes them
                output[key] = torch.tensor(column(examples, key))
        return output

    @staticmethod
    def _rows(values: dict[str, list], bounds: slice | None) -> tuple[Rows, np.ndarray]:
        """prompt + chosen rows then prompt + rejected rows, truncated by Python's own list operations (TRL's),
        read in Rust; and where each kept row starts in its untruncated row."""
        prompts = values["prompt_ids"]
        joined = [
            p + a for key in ("chosen_ids", "rejected_ids") for p, a in zip(prompts, values[key], strict=True)
        ]
        starts = np.zeros(len(joined), dtype=np.int64)
        if bounds is not None:
            starts[:] = [bounds.indices(len(row))[0] for row in joined]
            joined = [row[bounds] for row in joined]
        try:
            return read(joined, "input_ids", list(range(len(prompts))) * 2), starts
        except (TypeError, ValueError):
            for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
                read(values[key], key)  # the same error, naming the key it came from
            raise


EQUIVALENTS: dict[type, type] = {
    trl_sft.DataCollatorForLanguageModeling: DataCollatorForLanguageModeling,
    trl_dpo.DataCollatorForPreference: DataCollatorForPreference,
    trl_kto.DataCollatorForUnpairedPreference: DataCollatorForUnpairedPreference,
}

# A few batches that exercise every setting, to check at first use that this TRL's collators still make what
# ours make (written against TRL 1.16; another release may change them).
_PROBES = [
    (
        trl_sft.DataCollatorForLanguageModeling,
        dict(
            pad_token_id=0, padding_free=padding_free, return_position_ids=True, pad_to_multiple_of=multiple
        ),
        [
            {
                "input_ids": [1, 2, 3, 4],
                "labels": [-100, 2, 3, 4],
                "seq_lengths": [3, 1],
                "completion_mask": [1] * 4,
            },
            {"input_ids": [5, 6], "labels": [-100, 6], "seq_lengths": [2], "completion_mask": [1, 1]},
        ],
    )
    for padding_free in (False, True)
    for multiple in (None, 4)
] + [
    (
        trl_dpo.DataCollatorForPreference,
        dict(pad_token_id=0, max_length=max_length, truncation_mode=mode, pad_to_multiple_of=3),
        [
            {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6], "ref_chosen_logps": -1.5},
            {"prompt_ids": [7], "chosen_ids": [8, 9, 10], "rejected_ids": [11, 12], "ref_chosen_logps": -2.0},
        ],
    )
    for max_length, mode in ((None, "keep_start"), (3, "keep_start"), (3, "keep_end"))
]
_PROBES += KTO_PROBES


@functools.cache
def agrees_with_trl() -> bool:
    """Once per process: ours and this TRL's collators give the same batches on ``_PROBES``."""
    for theirs_cls, kwargs, examples in _PROBES:
        what = theirs_cls.__name__
        try:
            got = EQUIVALENTS[theirs_cls](**kwargs)(copy.deepcopy(examples))
            expected = theirs_cls(**kwargs)(copy.deepcopy(examples))
            difference = batch_difference(got, expected)
        except Exception as err:  # any failure means: keep TRL's collator
            difference = f"{type(err).__name__}: {err}"
        if difference is not None:
            what = f"{what} ({difference})"
            log_once(
                "trl-collators-disagree",
                f"fasttrain: TRL {trl.__version__}'s {what} makes other batches than fasttrain's equivalent "
                "(written against TRL 1.16): TRL's collators are kept",
            )
            return False
    return True
