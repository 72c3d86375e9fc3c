"""Padding-free training batches where they are exact: the ``packing`` hot path.

The Trainer's padding collator still makes its batch (``[rows, width]``, byte-identical to transformers' or
TRL's); ``_native.pack_padded`` then moves every row's tokens into one row, with the GIL released and no Python
work per token: ``input_ids``, ``position_ids`` restarting at 0 at each example, ``labels`` with each example's
first token ignored (so nothing predicts across a boundary: ``fasttrain.labels``), plus ``cu_seq_lens_q/k`` and ``max_length_q/k``
when the model runs flash attention. Starting from the padded batch keeps every quirk of the collator replaced
(the LM collator's ``labels[input_ids == pad] = -100`` with pad == eos, seq2seq's ``label_pad_token_id``, a user's
own ``labels``) and lets the packer prove, batch by batch, that the packed row scores exactly the padded batch's
tokens: the padded loss pairs token ``p - 1`` with label ``p`` inside a row, the packed one keeps the pairs whose
two positions are both tokens, so a padded batch that scores a label padding predicts or holds (left padding
with a labelled first token, a label pad other than -100), whose mask is not one block, or that carries other
keys (``token_type_ids``, ...) stays padded, the reason logged once. The labels the Trainer counts for
``num_items_in_batch`` (``labels[..., 1:] != -100``) are then the padded batch's too.

Attention is exact on a packed row only where the model keeps examples apart: sdpa, eager and flex build a
block-diagonal mask from ``position_ids`` when no ``attention_mask`` is passed and no cache exists
(``masking_utils.find_packed_sequence_indices``), flash attention takes ``cu_seq_lens``. A model whose config says
``use_cache=True`` builds a cache in a training forward too, and the packed mask is then silently not built
(every example attends to the ones before it): so the packed batch carries ``use_cache=False``. Which models,
attentions and trainers may pack, and whether a batch is worth packing, is the packing policy's
(``fasttrain.integration.packing_policy``); this module only makes the rows and refuses batches it cannot make
exactly.

Under TRL the packed batch is TRL's own padding-free batch (``padding_free=True``: ``seq_idx`` too, the same
``cu_seq_lens`` tensor under both names); TRL's ``compute_loss`` passes ``use_cache=False`` itself.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch
from transformers.data import data_collator as hf

from .. import _native
from .._logging import log_once
from . import collators as ours

__all__ = ["PackedBatch", "PackingCollator", "collator_kind", "pack"]

_PACKABLE_KEYS = frozenset({"input_ids", "attention_mask", "labels", "position_ids"})


class PackedBatch(dict):
    """A packed batch. Its type survives the loader's worker pickling, pinning and ``_prepare_inputs`` (they
    rebuild mappings with ``type(batch)(...)``): the Trainer's ``training_step`` seeing one is the evidence that
    packing ran."""


def _padding_collators() -> dict[type, str]:
    """The padding collators packing starts from (transformers' and fasttrain's), by kind."""
    kinds = {
        hf.DataCollatorForLanguageModeling: "lm",
        ours.DataCollatorForLanguageModeling: "lm",
        hf.DataCollatorForSeq2Seq: "seq2seq",
        ours.DataCollatorForSeq2Seq: "seq2seq",
        hf.DataCollatorWithPadding: "padding",
        ours.DataCollatorWithPadding: "padding",
    }
    if "trl" in sys.modules:  # a TRL collator cannot exist otherwise
        try:
            from trl.trainer import sft_trainer as trl_sft

            kinds[trl_sft.DataCollatorForLanguageModeling] = "trl"
            from . import trl_collators

            kinds[trl_collators.DataCollatorForLanguageModeling] = "trl"
        except (ImportError, AttributeError):  # another TRL: its collator is then not one we know
            pass
    return kinds


def collator_kind(collator: object) -> str | None:
    return _padding_collators().get(type(collator))


def _numpy(value: Any, key: str, batch_shape: tuple[int, ...] | None) -> np.ndarray:
    """A CPU int64 ``[rows, width]`` array viewing (or, for another integer dtype, converting) ``value``."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        raise _Refused(f"'{key}' is not a CPU torch tensor")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.ndim != 2:
        raise _Refused(f"'{key}' is a {value.ndim}-d {value.dtype} tensor, not 2-d integers")
    if batch_shape is not None and tuple(value.shape) != batch_shape:
        raise _Refused(f"'{key}' has shape {tuple(value.shape)}, 'input_ids' {batch_shape}")
    return np.ascontiguousarray(value.numpy(), dtype=np.int64)


class _Refused(Exception):
    """This batch stays padded (the message says why)."""

    def __init__(self, message: str, for_cost: bool = False) -> None:
        super().__init__(message)
        self.for_cost = for_cost


def pack(
    batch: Any, *, flash: bool, trl_pad_id: int | None = None, cost: Any = None
) -> tuple[dict[str, Any] | None, _Refused | None]:
    """(the packed batch, None) or (None, why the padded ``batch`` stays as it is). ``cost``: an object whose
    ``worth_it(rows, width, lengths)`` says whether the packed row costs no more than the padded batch
    (``fasttrain.integration.packing_policy.PackingCost``); None: always pack."""
    try:
        return _pack(batch, flash=flash, trl_pad_id=trl_pad_id, cost=cost), None
    except _Refused as why:
        return None, why


def _pack(batch: Any, *, flash: bool, trl_pad_id: int | None, cost: Any) -> dict[str, Any]:
    extra = sorted(set(batch) - _PACKABLE_KEYS)
    if extra:
        raise _Refused(f"the batch has {extra}, which a packed row cannot carry")
    if batch.get("labels") is None:
        raise _Refused("the batch has no labels")
    ids = _numpy(batch.get("input_ids"), "input_ids", None)
    shape = ids.shape
    labels = _numpy(batch["labels"], "labels", shape)
    mask = batch.get("attention_mask")
    mask = None if mask is None else _numpy(mask, "attention_mask", shape)
    flat_ids, flat_labels, positions, lengths, refusal = _native.pack_padded(ids, labels, mask)
    if refusal is not None:
        raise _Refused(refusal)
    if len(lengths) == 0:
        raise _Refused("every example is empty")
    if cost is not None and not cost.worth_it(shape[0], shape[1], lengths):
        # one reason for every such batch (the status line quotes the last one)
        raise _Refused("a packed row's dense attention costs more than the padding it saves", for_cost=True)
    given = batch.get("position_ids")
    if given is not None:
        # packed documents (position_ids restarting inside an example) attend to each other in the padded batch
        given = _numpy(given, "position_ids", shape)
        tokens = given.ravel() if mask is None else given[mask.astype(bool)]
        if not np.array_equal(tokens, positions):
            raise _Refused("'position_ids' restart inside an example (packed documents attend to each other)")
    if trl_pad_id is not None:
        from ._rows import Rows
        from .trl_collators import DataCollatorForLanguageModeling as TRLCollator

        return TRLCollator._padding_free(
            Rows(flat_ids, lengths), Rows(flat_labels, lengths), positions, trl_pad_id, None, "packing"
        )
    out = {
        "input_ids": torch.from_numpy(flat_ids)[None],
        "labels": torch.from_numpy(flat_labels)[None],
        "position_ids": torch.from_numpy(positions)[None],
    }
    if flash:  # as DataCollatorWithFlattening(return_flash_attn_kwargs=True) makes them
        if len(flat_ids) > np.iinfo(np.int32).max:
            raise _Refused(f"the packed row has {len(flat_ids)} tokens; cu_seq_lens are int32")
        cu_seq_lens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        out["cu_seq_lens_q"] = torch.from_numpy(cu_seq_lens)
        out["cu_seq_lens_k"] = torch.from_numpy(cu_seq_lens.copy())
        out["max_length_q"] = out["max_length_k"] = int(lengths.max())
    out["use_cache"] = False  # with a cache the model does not build the packed mask (see the module doc)
    return out


class PackingCollator:
    """The Trainer's training collator with packing: ``padded`` makes the batch, ``pack`` makes it one row.

    A batch that cannot be packed exactly is returned padded (why: logged once, and ``last_refusal``). Under TRL
    with ``padding_free=True`` the collator already packs: its batches are passed through, marked packed.
    """

    def __init__(self, padded: Any, *, flash: bool, cost: Any = None) -> None:
        self.padded = padded
        self.flash = flash
        self.cost = cost
        self.trl = collator_kind(padded) == "trl"
        self.packed_batches = 0
        self.padded_batches = 0
        self.last_refusal: str | None = None
        self.last_refusal_for_cost = False

    def __call__(self, features: Any, *args: Any, **kwargs: Any) -> Any:
        batch = self.padded(features, *args, **kwargs)
        if self.trl and self.padded.padding_free:
            self.packed_batches += 1
            return PackedBatch(batch)
        trl_pad_id = self.padded.pad_token_id if self.trl else None
        packed, refusal = pack(batch, flash=self.flash, trl_pad_id=trl_pad_id, cost=self.cost)
        if packed is None:
            self.padded_batches += 1
            self.last_refusal, self.last_refusal_for_cost = str(refusal), refusal.for_cost
            if not refusal.for_cost:  # a cost decision is per batch and expected: not worth a line each
                log_once(f"packing-refused:{refusal}", f"fasttrain packing: a batch stays padded ({refusal})")
            return batch
        self.packed_batches += 1
        return PackedBatch(packed)

    def __getattr__(self, name: str) -> Any:  # the wrapped collator's settings (tokenizer, ...) stay readable
        if name == "padded":
            raise AttributeError(name)
        return getattr(self.padded, name)
