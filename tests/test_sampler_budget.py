"""Token-budget batches (``fasttrain.TokenBudgetBatchSampler``) against a plain-Python reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fasttrain
from fasttrain.data.sampler import length_grouped_indices, token_budget_batches


def reference_batches(order: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Next fit, written the obvious way: a batch takes examples while their lengths fit the budget."""
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order:
        if current and tokens + lengths[i] > budget:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    if current:
        batches.append(current)
    return batches


@st.composite
def lengths_and_budget(draw, max_n: int = 400):
    n = draw(st.integers(0, max_n))
    top = draw(st.sampled_from([0, 1, 5, 300, 2000]))
    lengths = draw(st.lists(st.integers(0, top), min_size=n, max_size=n))
    budget = draw(st.one_of(st.integers(1, 8), st.integers(1, 5000)))
    return lengths, budget


@settings(max_examples=150, deadline=None)
@given(case=lengths_and_budget(), seed=st.integers(0, 2**32))
def test_batches_match_the_reference(case, seed):
    lengths, budget = case
    order = np.random.default_rng(seed).permutation(len(lengths)).astype(np.int64)
    ours = [b.tolist() for b in token_budget_batches(lengths, budget, order)]
    assert ours == reference_batches(order.tolist(), lengths, budget)


@settings(max_examples=100, deadline=None)
@given(case=lengths_and_budget(), ranks=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_ranks_get_whole_batches_the_same_number_each_every_example_once(case, ranks, seed):
    lengths, budget = case
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    plain = len(reference_batches(order, lengths, budget))
    if -(-plain // ranks) * ranks > len(lengths):  # even one example a batch cannot reach a multiple of ranks
        with pytest.raises(ValueError, match="cannot be split into a multiple"):
            fasttrain.TokenBudgetBatchSampler(
                budget, lengths=lengths, seed=seed, num_replicas=ranks, rank=0
            ).batches()
        return
    per_rank = []
    for rank in range(ranks):
        sampler = fasttrain.TokenBudgetBatchSampler(
            budget, lengths=lengths, seed=seed, num_replicas=ranks, rank=rank
        )
        per_rank.append(list(sampler))
        assert len(sampler) == len(per_rank[-1])
    assert len({len(batches) for batches in per_rank}) == 1, "every rank runs the same number of batches"
    seen = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert seen == list(range(len(lengths))), "each example exactly once across the ranks"
    for batches in per_rank:
        for batch in batches:
            assert batch, "no empty batch"
            assert len(batch) == 1 or sum(lengths[i] for i in batch) <= budget


def test_splitting_for_ranks_keeps_the_order_and_only_cuts():
    lengths = [4, 4, 4, 4, 1, 1]
    whole = token_budget_batches(lengths, 16)
    assert [b.tolist() for b in whole] == [[0, 1, 2, 3], [4, 5]]
    split = token_budget_batches(lengths, 16, num_replicas=3)
    assert [b.tolist() for b in split] == [
        [0, 1],
        [2, 3],
        [4, 5],
    ]  # the largest batch, cut at half its tokens
    dropped = token_budget_batches(lengths, 16, num_replicas=3, drop_last=True)
    assert dropped == []
    # [0] [1] [2] [3, 4] [5]: five batches for two ranks, the last one is dropped
    cut = token_budget_batches(lengths, 5, num_replicas=2, drop_last=True)
    assert [b.tolist() for b in cut] == [[0], [1], [2], [3, 4]]


def test_too_few_examples_for_the_ranks_is_a_clear_error():
    with pytest.raises(
        ValueError, match="2 examples in 2 token-budget batches cannot be split into a multiple of 3"
    ):
        token_budget_batches([5, 5], 5, num_replicas=3)


def test_an_example_longer_than_the_budget_gets_its_own_batch():
    lengths = [3, 50, 2, 2, 70]
    batches = [b.tolist() for b in token_budget_batches(lengths, 10)]
    assert batches == [[0], [1], [2, 3], [4]]


def test_every_example_once_per_epoch_and_deterministic_for_a_seed():
    lengths = np.random.default_rng(0).lognormal(np.log(180), 0.8, size=500).astype(np.int64).clip(16, 1024)
    first = fasttrain.TokenBudgetBatchSampler(2048, lengths=lengths, seed=7)
    again = fasttrain.TokenBudgetBatchSampler(2048, lengths=lengths, seed=7)
    epoch0 = list(first)
    assert epoch0 == list(again), "same seed, same batches"
    assert sorted(i for b in epoch0 for i in b) == list(range(500))
    assert all(len(b) == 1 or lengths[b].sum() <= 2048 for b in epoch0)
    first.set_epoch(1)
    epoch1 = list(first)
    assert epoch1 != epoch0, "another epoch, another order"
    assert sorted(i for b in epoch1 for i in b) == list(range(500))
    # the order is torch.randperm from seed + epoch, cut greedily
    expected = reference_batches(
        torch.randperm(500, generator=torch.Generator().manual_seed(8)).tolist(), lengths.tolist(), 2048
    )
    assert epoch1 == expected


def test_a_generator_advances_once_per_epoch_like_the_length_grouped_sampler():
    lengths = list(range(1, 301))
    ours = fasttrain.TokenBudgetBatchSampler(600, lengths=lengths, generator=torch.Generator().manual_seed(3))
    ref = torch.Generator().manual_seed(3)
    for _epoch in range(3):
        count = len(ours)  # draws the epoch's order once; iter() then uses it
        batches = list(ours)
        assert count == len(batches)
        assert batches == reference_batches(torch.randperm(300, generator=ref).tolist(), lengths, 600)


def test_group_by_length_cuts_transformers_grouped_order():
    lengths = np.random.default_rng(1).integers(16, 1024, size=400)
    ours = fasttrain.TokenBudgetBatchSampler(
        4096, lengths=lengths, group_by_length=True, generator=torch.Generator().manual_seed(5)
    )
    typical = 4096 // round(float(lengths.mean()))
    order = length_grouped_indices(lengths, typical, generator=torch.Generator().manual_seed(5))
    assert list(ours) == reference_batches(order.tolist(), lengths.tolist(), 4096)


def test_without_shuffle_the_dataset_order_is_cut():
    assert list(fasttrain.TokenBudgetBatchSampler(5, lengths=[2, 2, 2, 9, 1], shuffle=False)) == [
        [0, 1],
        [2],
        [3],
        [4],
    ]


def test_lengths_come_from_a_dataset_and_batches_feed_a_dataloader():
    from datasets import Dataset
    from torch.utils.data import DataLoader

    rows = [[1] * n for n in (5, 9, 3, 12, 7, 2)]
    dataset = Dataset.from_dict({"input_ids": rows})
    sampler = fasttrain.TokenBudgetBatchSampler(16, dataset=dataset, seed=0)
    loader = DataLoader(
        dataset, batch_sampler=sampler, collate_fn=lambda feats: [len(f["input_ids"]) for f in feats]
    )
    sizes = list(loader)
    assert sorted(n for batch in sizes for n in batch) == [2, 3, 5, 7, 9, 12]
    assert all(sum(batch) <= 16 for batch in sizes)
    assert sampler.iterations_started == 1
    assert len(loader) == len(sizes)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, None, "4096"])
def test_a_bad_budget_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        fasttrain.TokenBudgetBatchSampler(bad, lengths=[1, 2, 3])
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        token_budget_batches([1, 2, 3], bad)


def test_other_bad_input_names_what_is_wrong():
    with pytest.raises(ValueError, match="pass seed"):
        fasttrain.TokenBudgetBatchSampler(
            8, lengths=[1, 2], num_replicas=2, rank=0, generator=torch.Generator()
        )
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 2\)"):
        fasttrain.TokenBudgetBatchSampler(8, lengths=[1, 2], num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="num_replicas must be at least 1"):
        fasttrain.TokenBudgetBatchSampler(8, lengths=[1, 2], num_replicas=0, rank=0)
    with pytest.raises(ValueError, match=r"lengths must be non-negative, but lengths\[1\] = -1"):
        fasttrain.TokenBudgetBatchSampler(8, lengths=[1, -1])
    with pytest.raises(ValueError, match=r"order\[1\] = 7 is not an index into 2 lengths"):
        token_budget_batches([1, 2], 8, order=np.array([0, 7]))
    with pytest.raises(ValueError, match="One of dataset and lengths"):
        fasttrain.TokenBudgetBatchSampler(8)


def test_empty_and_huge_inputs():
    assert list(fasttrain.TokenBudgetBatchSampler(8, lengths=[])) == []
    huge = np.array([2**62, 2**62, 1], dtype=np.int64)
    assert [b.tolist() for b in token_budget_batches(huge, 2**63)] == [[0, 1], [2]]
    assert [b.tolist() for b in token_budget_batches(huge, 10**30)] == [[0, 1, 2]]  # clamped, no overflow
