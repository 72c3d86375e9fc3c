"""fasttrain's length-grouped samplers against transformers' (same generator state -> same order)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.trainer_pt_utils import DistributedLengthGroupedSampler as RefDistributed
from transformers.trainer_pt_utils import LengthGroupedSampler as RefSampler
from transformers.trainer_pt_utils import get_length_grouped_indices as ref_indices

import fasttrain
from fasttrain.data.sampler import length_grouped_indices


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@st.composite
def lengths_and_batch(draw, max_n: int = 1500):
    """Lengths drawn from a small or a large range (a small one means many ties), and a batch size
    that can be 1, around n / 4 (mega_batch_mult 0 -> 1) or beyond n."""
    n = draw(st.integers(1, max_n))
    top = draw(st.sampled_from([0, 1, 3, 20, 1000, 2**40]))
    lengths = draw(st.lists(st.integers(0, top), min_size=n, max_size=n))
    batch_size = draw(st.one_of(st.integers(1, 8), st.integers(1, n + 10)))
    return lengths, batch_size


@settings(max_examples=150, deadline=None)
@given(case=lengths_and_batch(), seed=st.integers(0, 2**32))
def test_order_matches_transformers(case, seed):
    lengths, batch_size = case
    ours = fasttrain.LengthGroupedSampler(batch_size, lengths=lengths, generator=gen(seed))
    ref = RefSampler(batch_size, lengths=lengths, generator=gen(seed))
    for _epoch in range(2):  # the generator advances identically, so the next epoch matches too
        assert list(ours) == list(ref)
    assert len(ours) == len(ref)


@settings(max_examples=60, deadline=None)
@given(case=lengths_and_batch(max_n=600), mult=st.integers(1, 7), seed=st.integers(0, 2**32))
def test_explicit_mega_batch_mult_matches(case, mult, seed):
    lengths, batch_size = case
    ours = length_grouped_indices(lengths, batch_size, mega_batch_mult=mult, generator=gen(seed))
    assert ours.dtype == np.int64
    assert ours.tolist() == ref_indices(lengths, batch_size, mega_batch_mult=mult, generator=gen(seed))


def test_default_generator_is_the_global_torch_rng():
    lengths = np.random.default_rng(0).integers(0, 9, size=3000).tolist()
    torch.manual_seed(1234)
    ref = list(RefSampler(16, lengths=lengths))
    torch.manual_seed(1234)
    assert list(fasttrain.LengthGroupedSampler(16, lengths=lengths)) == ref


def test_many_ties_and_several_maximal_megabatches():
    # Only two distinct lengths over many megabatches: several megabatches start with the
    # maximum, and the swap must pick the first of them, as torch.argmax does.
    lengths = ([5] * 7 + [2] * 93) * 40
    for seed in range(20):
        assert list(fasttrain.LengthGroupedSampler(4, lengths=lengths, generator=gen(seed))) == list(
            RefSampler(4, lengths=lengths, generator=gen(seed))
        )


def test_yields_python_ints_and_a_permutation():
    lengths = list(range(1000))
    order = list(fasttrain.LengthGroupedSampler(8, lengths=lengths, generator=gen(0)))
    assert all(type(i) is int for i in order)
    assert sorted(order) == lengths
    assert order[0] == 999  # the longest example comes first


@pytest.mark.parametrize(
    "lengths",
    [np.arange(50, dtype=np.int32), np.arange(50, dtype=np.uint16), torch.arange(50), list(range(50))],
    ids=["int32", "uint16", "tensor", "list"],
)
def test_length_containers(lengths):
    ref = list(RefSampler(3, lengths=list(range(50)), generator=gen(5)))
    assert list(fasttrain.LengthGroupedSampler(3, lengths=lengths, generator=gen(5))) == ref


@pytest.mark.parametrize("n", [0, 1, 2, 5])
@pytest.mark.parametrize("batch_size", [1, 3, 1000, 2**70])
def test_tiny_datasets_and_huge_batches(n, batch_size):
    lengths = [3, 1, 4, 1, 5][:n]
    ours = fasttrain.LengthGroupedSampler(batch_size, lengths=lengths, generator=gen(0))
    ref = RefSampler(batch_size, lengths=lengths, generator=gen(0))
    assert len(ours) == len(ref) == n
    if n == 0:  # transformers raises IndexError (torch.argmax of an empty tensor) on iteration
        with pytest.raises(IndexError):
            list(ref)
        with pytest.raises(IndexError, match="empty dataset"):
            list(ours)
    else:
        assert list(ours) == list(ref)


def test_empty_dataset_raises_like_transformers_and_advances_the_generator_alike():
    import datasets

    empty = [
        datasets.Dataset.from_dict({"input_ids": []}),
        datasets.Dataset.from_dict({"input_ids": [[1, 2]]}).select([]),
        [],
    ]
    for ds in empty:  # lengths read from the dataset: transformers' dataset[0] raises at construction
        for cls in (fasttrain.LengthGroupedSampler, RefSampler):
            with pytest.raises(IndexError):
                cls(4, dataset=ds)
        for cls in (fasttrain.DistributedLengthGroupedSampler, RefDistributed):
            with pytest.raises(IndexError):
                cls(4, dataset=ds, num_replicas=2, rank=0)
    # lengths given: both construct, and raise on iteration after drawing the same permutation
    ours = fasttrain.LengthGroupedSampler(4, lengths=[], generator=gen(3))
    ref = RefSampler(4, lengths=[], generator=gen(3))
    for sampler in (ours, ref):
        with pytest.raises(IndexError):
            iter(sampler)
    assert torch.equal(ours.generator.get_state(), ref.generator.get_state())
    for cls in (fasttrain.DistributedLengthGroupedSampler, RefDistributed):
        with pytest.raises(IndexError):
            iter(cls(4, lengths=[], num_replicas=2, rank=0))


def test_iterations_started_counts_each_epoch():
    s = fasttrain.LengthGroupedSampler(2, lengths=[1, 2, 3], generator=gen(0))
    d = fasttrain.DistributedLengthGroupedSampler(2, lengths=[1, 2, 3], num_replicas=2, rank=0)
    for sampler in (s, d):
        assert sampler.iterations_started == 0
        list(sampler)
        iter(sampler)
        assert sampler.iterations_started == 2


# --- distributed ---


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("n", [1, 2, 3, 96, 97, 1001])
@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_matches_and_partitions(world_size, n, drop_last):
    lengths = np.random.default_rng(n).integers(0, 30, size=n).tolist()
    for epoch in (0, 3):
        union = []
        for rank in range(world_size):
            kwargs = dict(num_replicas=world_size, rank=rank, seed=7, drop_last=drop_last, lengths=lengths)
            ours = fasttrain.DistributedLengthGroupedSampler(4, **kwargs)
            ours.set_epoch(epoch)
            ref = RefDistributed(4, **kwargs)
            ref.set_epoch(epoch)
            assert len(ours) == len(ref)
            padding = -n % world_size
            if not drop_last and padding > n:  # padding longer than the order: transformers asserts
                with pytest.raises(AssertionError):
                    list(ref)
                with pytest.raises(ValueError, match="too few to pad"):
                    list(ours)
                return
            got = list(ours)
            assert got == list(ref)
            assert len(got) == len(ours)
            union += got
        if n % world_size == 0:  # no padding, nothing dropped: every index exactly once
            assert sorted(union) == list(range(n))
        elif drop_last:
            assert len(set(union)) == len(union) == n - n % world_size
        else:
            assert set(union) == set(range(n))


def test_distributed_epochs_differ_and_repeat():
    lengths = list(range(500))
    s = fasttrain.DistributedLengthGroupedSampler(8, num_replicas=2, rank=1, lengths=lengths)
    first = list(s)
    assert list(s) == first  # the same epoch gives the same order
    s.set_epoch(1)
    assert list(s) != first


def test_distributed_is_a_distributed_sampler():
    s = fasttrain.DistributedLengthGroupedSampler(2, num_replicas=2, rank=0, lengths=[1, 2, 3])
    assert isinstance(s, torch.utils.data.DistributedSampler)


# --- bad input: a ValueError naming the problem, never a crash ---


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(batch_size=0, lengths=[1, 2]), "batch_size must be at least 1, got 0"),
        (dict(batch_size=-3, lengths=[1, 2]), "batch_size must be at least 1"),
        (dict(batch_size=2.0, lengths=[1, 2]), "batch_size must be a positive integer"),
        (dict(batch_size=True, lengths=[1, 2]), "batch_size must be a positive integer"),
        (dict(batch_size=2, lengths=[1, -2, 3]), r"lengths\[1\] = -2"),
        (dict(batch_size=2, lengths=[1, 2.5]), r"lengths\[1\] = 2.5 \(float\)"),
        (dict(batch_size=2, lengths=[1, "3"]), r"lengths\[1\] = '3' \(str\)"),
        (dict(batch_size=2, lengths=[1, None]), r"lengths\[1\] = None"),
        (dict(batch_size=2, lengths=[True, False]), r"lengths\[0\] = True \(bool\)"),
        (dict(batch_size=2, lengths=np.array([1.0, 2.0])), r"lengths\[0\] = 1.0"),
        (dict(batch_size=2, lengths=[[1, 2], [3, 4]]), "must be 1-D"),
        (dict(batch_size=2, lengths=[1, 2**70]), "does not fit in int64"),
        (dict(batch_size=2, lengths=np.array([1, 2**63], dtype=np.uint64)), "does not fit in int64"),
        (
            dict(batch_size=2, dataset=[{"input_ids": [1]}] * 3, lengths=[1, 2]),
            "2 lengths for a dataset of 3",
        ),
        (dict(batch_size=2), "One of dataset and lengths must be provided"),
        (dict(batch_size=2, dataset=[[1, 2]]), "'input_ids' key"),
    ],
)
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fasttrain.LengthGroupedSampler(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_replicas=2, rank=2), r"rank must be an integer in \[0, 2\)"),
        (dict(num_replicas=2, rank=-1), "rank must be"),
        (dict(num_replicas=0, rank=0), "num_replicas must be at least 1"),
        (dict(num_replicas=2, rank=0, lengths=[4, -1]), r"lengths\[1\] = -1"),
    ],
)
def test_distributed_bad_input(kwargs, message):
    kwargs = {"lengths": [1, 2, 3], **kwargs}
    with pytest.raises(ValueError, match=message):
        fasttrain.DistributedLengthGroupedSampler(2, **kwargs)


def test_mega_batch_mult_must_be_positive():
    with pytest.raises(ValueError, match="mega_batch_mult must be at least 1"):
        length_grouped_indices([1, 2], 1, mega_batch_mult=0)


# --- pickling ---


def test_pickle_keeps_lengths_and_generator_state():
    lengths = np.random.default_rng(1).integers(0, 100, size=2000)
    s = fasttrain.LengthGroupedSampler(8, lengths=lengths, generator=gen(3))
    list(s)  # advance the generator by one epoch
    clone = pickle.loads(pickle.dumps(s))
    assert list(clone) == list(s)
    assert len(clone) == len(s) and clone.batch_size == 8


def test_pickle_distributed():
    s = fasttrain.DistributedLengthGroupedSampler(4, num_replicas=3, rank=2, seed=9, lengths=list(range(100)))
    s.set_epoch(4)
    clone = pickle.loads(pickle.dumps(s))
    assert list(clone) == list(s) and clone.epoch == 4 and len(clone) == len(s)


def test_native_bad_arrays_raise_value_errors():
    from fasttrain import _native

    with pytest.raises(ValueError, match=r"permutation\[0\] = 5"):
        _native.length_grouped_indices(np.array([5, 0]), np.array([1, 2]), 1)
    with pytest.raises(ValueError, match="contiguous"):
        _native.length_grouped_indices(np.arange(4)[::2], np.array([1, 2]), 1)
    with pytest.raises(ValueError, match="2 entries but there are 3 lengths"):
        _native.length_grouped_indices(np.array([1, 0]), np.array([1, 2, 3]), 1)
