"""The Rust collators pickle, and run in DataLoader worker processes (fork and spawn)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import transformers

from _collator_cases import assert_same, clone, make_tokenizer
from fasttrain.data import collators as ft


def pairs():
    tok = make_tokenizer("left")
    return [
        (
            ft.DataCollatorWithPadding(tok, pad_to_multiple_of=8),
            transformers.DataCollatorWithPadding(tok, pad_to_multiple_of=8),
        ),
        (
            ft.DataCollatorForLanguageModeling(tok, mlm=False),
            transformers.DataCollatorForLanguageModeling(tok, mlm=False),
        ),
        (ft.DataCollatorForSeq2Seq(tok), transformers.DataCollatorForSeq2Seq(tok)),
        (
            ft.DataCollatorWithFlattening(return_flash_attn_kwargs=True),
            transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True),
        ),
    ]


def dataset(n: int = 24, seed: int = 0, container=list) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        ids = rng.integers(5, 40, int(rng.integers(1, 40)))
        rows.append({"input_ids": container(ids.tolist()), "labels": container(ids.tolist())})
    return rows


@pytest.mark.parametrize("index", range(4))
def test_pickle_round_trip(index):
    ours, ref = pairs()[index]
    copy = pickle.loads(pickle.dumps(ours))
    assert type(copy) is type(ours)
    features = dataset(6)
    if not isinstance(ours, (ft.DataCollatorForSeq2Seq, ft.DataCollatorWithFlattening)):
        features = [{"input_ids": f["input_ids"]} for f in features]  # labels would not pad there
    assert_same(copy(clone(features)), ref(clone(features)))


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_two_workers(context):
    tok = make_tokenizer("left")
    ours = ft.DataCollatorForSeq2Seq(tok, pad_to_multiple_of=8)
    ref = transformers.DataCollatorForSeq2Seq(tok, pad_to_multiple_of=8)
    data = dataset(container=np.array)
    loader = torch.utils.data.DataLoader(
        data, batch_size=5, num_workers=2, collate_fn=ours, multiprocessing_context=context
    )
    batches = list(loader)
    assert len(batches) == 5
    for i, batch in enumerate(batches):
        assert_same(batch, ref(clone(data[i * 5 : (i + 1) * 5])))
