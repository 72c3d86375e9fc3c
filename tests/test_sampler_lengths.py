"""Lengths for the sampler: from Arrow for a datasets.Dataset, per row (logged) for anything else."""

from __future__ import annotations

import logging

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch
from transformers.trainer_pt_utils import LengthGroupedSampler as RefSampler

import fasttrain
from fasttrain import _logging
from fasttrain.data.lengths import lengths_from_dataset


def per_row(dataset, name="input_ids"):
    return [len(example[name]) for example in dataset]


def list_table(lengths, list_type=pa.list_, chunks=1, extra=None):
    """A table with a list column `input_ids` of the given lengths, split into `chunks` record batches."""
    rng = np.random.default_rng(0)
    batches = []
    for part in np.array_split(np.asarray(lengths, dtype=np.int64), chunks):
        offsets = np.concatenate([[0], np.cumsum(part)])
        values = pa.array(rng.integers(0, 1000, size=int(offsets[-1])), pa.int32())
        offsets_type = np.int64 if list_type is pa.large_list else np.int32
        array_type = pa.LargeListArray if list_type is pa.large_list else pa.ListArray
        column = array_type.from_arrays(pa.array(offsets.astype(offsets_type)), values)
        batches.append(pa.record_batch({"input_ids": column}))
    table = pa.Table.from_batches(batches)
    for name, values in (extra or {}).items():
        table = table.append_column(name, pa.array(values))
    return table


LENGTHS = np.random.default_rng(42).integers(0, 40, size=257)


@pytest.mark.parametrize("list_type", [pa.list_, pa.large_list])
@pytest.mark.parametrize("chunks", [1, 4])
def test_arrow_lengths_match_a_per_row_pass(list_type, chunks):
    ds = datasets.Dataset(list_table(LENGTHS, list_type, chunks))
    assert ds.data.column("input_ids").num_chunks == chunks
    got = lengths_from_dataset(ds)
    assert got.dtype == np.int64
    assert got.tolist() == per_row(ds) == LENGTHS.tolist()


def test_sampler_on_a_dataset_matches_transformers():
    ds = datasets.Dataset(list_table(LENGTHS, chunks=3))
    ours = fasttrain.LengthGroupedSampler(4, dataset=ds, generator=torch.Generator().manual_seed(0))
    ref = RefSampler(4, dataset=ds, generator=torch.Generator().manual_seed(0))
    assert list(ours) == list(ref)
    dist = fasttrain.DistributedLengthGroupedSampler(4, dataset=ds, num_replicas=2, rank=1)
    assert dist.lengths.tolist() == LENGTHS.tolist()


def test_model_input_name_and_fixed_size_lists():
    table = pa.table({"pixel_values": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(30.0)), 3)})
    ds = datasets.Dataset(table)
    assert lengths_from_dataset(ds, "pixel_values").tolist() == per_row(ds, "pixel_values") == [3] * 10


@pytest.mark.parametrize(
    "view",
    [
        lambda d: d.shuffle(seed=0),
        lambda d: d.select([5, 3, 3, 200, 0]),
        lambda d: d.filter(lambda e: len(e["input_ids"]) % 2 == 0),
        lambda d: d.shuffle(seed=1).select(range(10, 60)),
        lambda d: d.select(range(20, 40)),
    ],
    ids=["shuffle", "select-list", "filter", "shuffle-select", "select-range"],
)
def test_indices_mapping_is_followed(view):
    ds = view(datasets.Dataset(list_table(LENGTHS, chunks=2, extra={"length": LENGTHS})))
    assert lengths_from_dataset(ds, length_column=None).tolist() == per_row(ds)
    assert lengths_from_dataset(ds).tolist() == ds["length"][:] == per_row(ds)


def test_length_column_is_preferred_and_read_as_a_column():
    declared = (LENGTHS + 1).tolist()  # deliberately different from the list lengths
    ds = datasets.Dataset(list_table(LENGTHS, extra={"length": declared}))
    assert lengths_from_dataset(ds).tolist() == declared
    assert lengths_from_dataset(ds, length_column=None).tolist() == LENGTHS.tolist()
    # The Trainer passes ds["length"] (a datasets Column): read from Arrow, in row order.
    shuffled = ds.shuffle(seed=3)
    sampler = fasttrain.LengthGroupedSampler(2, dataset=shuffled, lengths=shuffled["length"])
    assert sampler.lengths.tolist() == shuffled["length"][:]


def test_null_lists_and_bad_length_columns_name_the_row():
    lists = pa.array([[1, 2], [3], None, [4]], pa.list_(pa.int64()))
    with pytest.raises(ValueError, match="column 'input_ids' is null at row 2"):
        lengths_from_dataset(datasets.Dataset(pa.table({"input_ids": lists})))
    # after a shuffle the row named is the dataset's row, not the table's
    shuffled = datasets.Dataset(pa.table({"input_ids": lists})).select([3, 1, 2, 0])
    with pytest.raises(ValueError, match="null at row 2"):
        lengths_from_dataset(shuffled)
    with pytest.raises(ValueError, match="row 1 has -5"):
        lengths_from_dataset(datasets.Dataset(pa.table({"input_ids": [[1]] * 3, "length": [1, -5, 2]})))
    with pytest.raises(ValueError, match="integer lengths, got Arrow type double"):
        lengths_from_dataset(datasets.Dataset(pa.table({"input_ids": [[1]] * 2, "length": [1.0, 2.0]})))
    with pytest.raises(ValueError, match="'labels' key"):
        lengths_from_dataset(datasets.Dataset(pa.table({"input_ids": [[1]]})), "labels")


def test_empty_dataset():
    ds = datasets.Dataset(list_table([]))
    assert lengths_from_dataset(ds).tolist() == []
    for cls in (fasttrain.LengthGroupedSampler, RefSampler):  # transformers reads ds[0]: IndexError
        with pytest.raises(IndexError):
            cls(4, dataset=ds)


@pytest.fixture
def fresh_log_once():
    saved = set(_logging._said)
    _logging._said.clear()
    yield
    _logging._said.clear()
    _logging._said.update(saved)


class TorchDataset(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"input_ids": torch.zeros(self.lengths[i])}


@pytest.mark.parametrize(
    "make",
    [
        lambda: [{"input_ids": [0] * n} for n in LENGTHS],
        lambda: TorchDataset(LENGTHS),
        lambda: datasets.Dataset.from_dict({"input_ids": ["x" * n for n in LENGTHS]}),  # not an Arrow list
    ],
    ids=["list-of-dicts", "torch-dataset", "string-column"],
)
def test_other_datasets_fall_back_to_a_logged_per_row_pass(make, fresh_log_once, caplog):
    dataset = make()
    with caplog.at_level(logging.WARNING, logger="fasttrain"):
        lengths = lengths_from_dataset(dataset)
        lengths_from_dataset(dataset)
    assert lengths.tolist() == LENGTHS.tolist()
    assert len([r for r in caplog.records if "per-row Python pass" in r.message]) == 1
    ref = RefSampler(8, dataset=dataset, generator=torch.Generator().manual_seed(2))
    ours = fasttrain.LengthGroupedSampler(8, dataset=dataset, generator=torch.Generator().manual_seed(2))
    assert list(ours) == list(ref)


def test_custom_format_falls_back(fresh_log_once):
    ds = datasets.Dataset(list_table(LENGTHS))
    ds.set_transform(lambda batch: {"input_ids": [ids[:1] for ids in batch["input_ids"]]})
    assert lengths_from_dataset(ds).tolist() == [min(n, 1) for n in LENGTHS]
