"""The label rule, written once in ``fasttrain.labels``, and the Rust packer held to it.

A padded batch scores, in each row, the pair (hidden state at ``p``, ``shift_labels(labels)[p]``). The packed row
``_native.pack_padded`` makes must score exactly the same pairs: for every example, the same offsets within the
example with the same labels, and nothing across a boundary. And TRL's padding-free labels are the concatenated
labels with ``ignore_example_starts`` applied, which is what the packer's labels are too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fasttrain import _native
from fasttrain.labels import IGNORE_INDEX, ignore_example_starts, shift_labels


def test_shift_labels_is_transformers_rule():
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)  # fp32: ForCausalLMLoss computes in fp32
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 4, 5], [IGNORE_INDEX, 6, 0, 3, IGNORE_INDEX]])
    shifted = shift_labels(labels)
    assert shifted.tolist() == [[2, IGNORE_INDEX, 4, 5, IGNORE_INDEX], [6, 0, 3, IGNORE_INDEX, IGNORE_INDEX]]
    ours = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), shifted.flatten(), ignore_index=IGNORE_INDEX
    )
    assert torch.equal(ours, ForCausalLMLoss(logits, labels, vocab_size=7))


def _padded_batch(rng: np.random.Generator, rows: int, width: int, left: bool):
    lengths = rng.integers(1, width + 1, size=rows)
    ids = np.zeros((rows, width), dtype=np.int64)
    labels = np.full((rows, width), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((rows, width), dtype=np.int64)
    for r, n in enumerate(lengths):
        span = slice(width - n, width) if left else slice(0, n)
        ids[r, span] = rng.integers(3, 50, size=n)
        labels[r, span] = ids[r, span]
        prompt = int(rng.integers(0, n))  # a prompt-masked fine-tuning example: the prompt is not scored
        labels[r, span.start : span.start + prompt] = IGNORE_INDEX
        if left:
            labels[r, span.start] = IGNORE_INDEX  # left padding with a scored first token stays padded
        mask[r, span] = 1
    return ids, labels, mask


def _scored_pairs_padded(ids, labels, mask):
    shifted = shift_labels(torch.from_numpy(labels)).numpy()
    pairs = []
    for r in range(ids.shape[0]):
        start = int(np.flatnonzero(mask[r])[0])
        for p in np.flatnonzero(mask[r]):
            if shifted[r, p] != IGNORE_INDEX:
                pairs.append((r, int(p) - start, int(shifted[r, p])))
    return pairs


def _scored_pairs_packed(labels, positions):
    shifted = shift_labels(torch.from_numpy(labels)).numpy()
    example = np.cumsum(positions == 0) - 1
    return [
        (int(example[p]), int(positions[p]), int(shifted[p]))
        for p in range(len(labels))
        if shifted[p] != IGNORE_INDEX
    ]


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_the_packer_scores_exactly_the_pairs_the_padded_batch_scores(seed, left):
    rng = np.random.default_rng(seed)
    ids, labels, mask = _padded_batch(
        rng, rows=int(rng.integers(1, 7)), width=int(rng.integers(1, 12)), left=left
    )
    flat_ids, flat_labels, positions, lengths, refusal = _native.pack_padded(ids, labels, mask)
    assert refusal is None
    assert _scored_pairs_packed(flat_labels, positions) == _scored_pairs_padded(ids, labels, mask)
    # the packer's labels are the examples' labels with each start ignored: ignore_example_starts
    concatenated = labels[mask.astype(bool)].copy()
    assert np.array_equal(flat_labels, ignore_example_starts(concatenated, positions))
    assert np.array_equal(flat_ids, ids[mask.astype(bool)]) and lengths.sum() == mask.sum()


def test_a_pair_the_packed_row_cannot_score_is_refused_not_dropped():
    ids = np.array([[0, 5, 6]], dtype=np.int64)
    labels = np.array([[IGNORE_INDEX, 5, 6]], dtype=np.int64)  # the first real token is scored from a pad
    mask = np.array([[0, 1, 1]], dtype=np.int64)
    *_, refusal = _native.pack_padded(ids, labels, mask)
    assert refusal is not None and "padding" in refusal
