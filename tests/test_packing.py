"""The packer (``fasttrain.data.packing``): a padded batch becomes one padding-free row only where that changes
no scored token, and the packed row is what the padding-free collators make (transformers'
``DataCollatorWithFlattening``, TRL's ``padding_free=True``).

Exactness is checked on the batches themselves: the causal-LM pairs (token ``p - 1`` -> label ``p``) the padded
batch scores, in order, are exactly the packed row's, and so is the count the Trainer takes for
``num_items_in_batch`` (``labels[..., 1:] != -100``). The model-level checks (every family, losses, gradients,
no attention across examples) are in test_packing_models.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import _tiny as tiny
import fasttrain
from fasttrain import _native
from fasttrain.data import packing
from fasttrain.integration import packing_policy

pytestmark = [pytest.mark.gpu_versions, pytest.mark.numeric]


def _examples(lengths, seed=0, eos_inside=False, prompt_masked=True):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(3, tiny.VOCAB, n).tolist()
        if eos_inside:
            ids[n // 2] = 0  # the pad id (pad == eos is common): the LM collator ignores it as a label
        example = {"input_ids": ids}
        if prompt_masked:
            prompt = int(rng.integers(0, n))  # 0: the first token labelled too
            example["labels"] = [-100] * prompt + ids[prompt:]
        out.append(example)
    return out


def _scored_pairs(batch):
    """(token, label) of every pair a causal-LM loss scores, row by row, in order."""
    ids, labels = batch["input_ids"], batch["labels"]
    pairs = []
    for row_ids, row_labels in zip(ids.tolist(), labels.tolist(), strict=True):
        pairs += [(t, y) for t, y in zip(row_ids[:-1], row_labels[1:], strict=True) if y != -100]
    return pairs


def _num_items(batch):
    return int((batch["labels"][..., 1:] != -100).sum())


def _assert_same_scored(padded, packed):
    assert _scored_pairs(packed) == _scored_pairs(padded)
    assert _num_items(packed) == _num_items(padded)
    assert packed["input_ids"].shape[0] == 1
    if "attention_mask" in padded:  # every token and nothing else
        assert packed["input_ids"].shape[1] == int(padded["attention_mask"].sum())


COLLATORS = {
    "lm": lambda tok: fasttrain.DataCollatorForLanguageModeling(tok, mlm=False),
    "lm-transformers": lambda tok: transformers.DataCollatorForLanguageModeling(tok, mlm=False),
    "seq2seq": lambda tok: fasttrain.DataCollatorForSeq2Seq(tok, padding=True),
    "seq2seq-multiple": lambda tok: fasttrain.DataCollatorForSeq2Seq(tok, padding=True, pad_to_multiple_of=8),
}


@pytest.mark.parametrize("name", sorted(COLLATORS))
@pytest.mark.parametrize("eos_inside", [False, True], ids=["plain", "pad-inside"])
def test_packed_row_scores_what_the_padded_batch_scores(name, eos_inside):
    tok = tiny.tokenizer()
    collator = COLLATORS[name](tok)
    examples = _examples([7, 1, 12, 3, 9], eos_inside=eos_inside, prompt_masked=name.startswith("seq2seq"))
    padded = collator([dict(e) for e in examples])
    packer = packing.PackingCollator(collator, flash=False)
    packed = packer([dict(e) for e in examples])
    assert isinstance(packed, packing.PackedBatch) and packer.packed_batches == 1
    assert list(packed) == ["input_ids", "labels", "position_ids", "use_cache"]
    assert packed["use_cache"] is False
    lengths = [len(e["input_ids"]) for e in examples]
    expected_ids = [t for e in examples for t in e["input_ids"]]
    assert packed["input_ids"].tolist() == [expected_ids]
    assert packed["position_ids"].tolist() == [[p for n in lengths for p in range(n)]]
    assert packed["input_ids"].dtype == packed["labels"].dtype == packed["position_ids"].dtype == torch.int64
    starts = np.cumsum([0, *lengths[:-1]])
    assert (packed["labels"][0, starts] == -100).all()
    _assert_same_scored(padded, packed)


def test_matches_transformers_flattening_with_flash_kwargs():
    """Without prompt masking and with pad != any token, the packed row is DataCollatorWithFlattening's."""
    tok = tiny.tokenizer()
    examples = _examples([5, 2, 8], prompt_masked=False)
    flat = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)([dict(e) for e in examples])
    packed = packing.PackingCollator(fasttrain.DataCollatorForLanguageModeling(tok, mlm=False), flash=True)(
        [dict(e) for e in examples]
    )
    assert list(packed) == [*flat.keys(), "use_cache"]
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            assert packed[key].dtype == value.dtype and torch.equal(packed[key], value), key
        else:
            assert packed[key] == value, key


def test_left_padding_packs_only_when_no_padding_predicts_a_label():
    tok = tiny.tokenizer(padding_side="left")
    examples = _examples([4, 9, 6])
    # prompt-masked: every example's first token is -100, so no scored label is predicted by padding
    seq2seq = fasttrain.DataCollatorForSeq2Seq(tok, padding=True)
    padded = seq2seq([dict(e) for e in examples])
    packed = packing.PackingCollator(seq2seq, flash=False)([dict(e) for e in examples])
    assert isinstance(packed, packing.PackedBatch)
    _assert_same_scored(padded, packed)
    # the LM collator labels every token: left padding scores the first token from the last pad -> stays padded
    lm = fasttrain.DataCollatorForLanguageModeling(tok, mlm=False)
    packer = packing.PackingCollator(lm, flash=False)
    out = packer([{"input_ids": e["input_ids"]} for e in examples])
    assert not isinstance(out, packing.PackedBatch) and packer.padded_batches == 1
    assert "padding predicts or holds" in packer.last_refusal and packer.last_refusal.startswith("example 0:")
    reference = lm([{"input_ids": e["input_ids"]} for e in examples])
    assert all(torch.equal(out[k], reference[k]) for k in reference)


def test_scored_label_padding_stays_padded():
    tok = tiny.tokenizer()
    collator = fasttrain.DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=0)
    packer = packing.PackingCollator(collator, flash=False)
    out = packer([dict(e) for e in _examples([3, 6])])
    assert not isinstance(out, packing.PackedBatch)
    assert "label pad other than -100" in packer.last_refusal


def test_other_keys_and_missing_labels_stay_padded():
    tok = tiny.tokenizer()
    packer = packing.PackingCollator(fasttrain.DataCollatorWithPadding(tok), flash=False)
    with_types = [
        {"input_ids": [5, 6, 7], "token_type_ids": [0, 0, 1]},
        {"input_ids": [8], "token_type_ids": [0]},
    ]
    assert not isinstance(packer(with_types), packing.PackedBatch)
    assert "token_type_ids" in packer.last_refusal
    assert not isinstance(packer([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}]), packing.PackedBatch)
    assert packer.last_refusal == "the batch has no labels"
    same_length = [
        {"input_ids": [5, 6, 7], "labels": [5, 6, 7]},
        {"input_ids": [8, 9, 10], "labels": [8, 9, 10]},
    ]
    packed = packer(same_length)
    assert isinstance(packed, packing.PackedBatch)
    assert packed["labels"].tolist() == [[-100, 6, 7, -100, 9, 10]]


def test_position_ids_restarting_inside_an_example_stay_padded():
    """TRL's padded batches with packed documents (seq_lengths): the padded batch attends across documents."""
    trl = pytest.importorskip("trl")
    collator = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(
        pad_token_id=0, return_position_ids=True
    )
    packer = packing.PackingCollator(collator, flash=False)
    docs = [{"input_ids": [1, 2, 3, 4], "seq_lengths": [2, 2]}, {"input_ids": [5, 6], "seq_lengths": [2]}]
    assert not isinstance(packer(docs), packing.PackedBatch)
    assert "restart inside an example" in packer.last_refusal
    plain = [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6]}]
    assert isinstance(packer(plain), packing.PackedBatch)


@pytest.mark.parametrize("multiple", [None, 4])
def test_trl_packed_batch_is_trls_padding_free_batch(multiple):
    trl = pytest.importorskip("trl")
    from fasttrain.data import trl_collators

    sft = trl.trainer.sft_trainer.DataCollatorForLanguageModeling
    examples = [
        {"input_ids": [1, 2, 3, 4], "labels": [-100, 2, 3, 4]},
        {"input_ids": [5, 6], "labels": [-100, 6]},
        {"input_ids": [7, 8, 9], "labels": [7, 8, 9]},
    ]
    for padded in (sft(pad_token_id=0), trl_collators.DataCollatorForLanguageModeling(pad_token_id=0)):
        packed = packing.PackingCollator(padded, flash=False)([dict(e) for e in examples])
        expected = sft(pad_token_id=0, padding_free=True)([dict(e) for e in examples])
        assert isinstance(packed, packing.PackedBatch)
        assert list(packed) == list(expected)
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert packed[key].dtype == value.dtype and torch.equal(packed[key], value), key
            else:
                assert packed[key] == value, key
    # a user's padding_free=True (any pad_to_multiple_of): TRL's own batch, served natively and marked packed
    user = trl_collators.DataCollatorForLanguageModeling(
        pad_token_id=0, padding_free=True, pad_to_multiple_of=multiple
    )
    packed = packing.PackingCollator(user, flash=False)([dict(e) for e in examples])
    expected = sft(pad_token_id=0, padding_free=True, pad_to_multiple_of=multiple)(
        [dict(e) for e in examples]
    )
    assert isinstance(packed, packing.PackedBatch)
    assert all(
        torch.equal(packed[k], v) if isinstance(v, torch.Tensor) else packed[k] == v
        for k, v in expected.items()
    )


def test_native_pack_errors_name_the_key():
    ids = np.zeros((2, 3), dtype=np.int64)
    with pytest.raises(ValueError, match="'labels' has shape"):
        _native.pack_padded(ids, np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="'attention_mask' has shape"):
        _native.pack_padded(ids, ids.copy(), np.ones((1, 3), dtype=np.int64))
    out = _native.pack_padded(ids, ids.copy(), np.array([[1, 0, 1], [1, 1, 1]], dtype=np.int64))
    assert out[-1] == "example 0: 'attention_mask' has a gap (its tokens are not one block)"


def test_collator_and_model_problems_name_the_cause():
    tok = tiny.tokenizer()
    assert packing_policy.collator_problem(fasttrain.DataCollatorForSeq2Seq(tok)) is None
    masked = transformers.DataCollatorForLanguageModeling(tok, mlm=False)
    masked.mlm = True  # the tiny tokenizer has no mask token to construct one with
    assert "mlm=True" in packing_policy.collator_problem(masked)
    assert "already makes padding-free" in packing_policy.collator_problem(
        transformers.DataCollatorWithFlattening()
    )
    assert "not a padding collator" in packing_policy.collator_problem(transformers.default_data_collator)
    assert packing_policy.model_problem(tiny.model("llama")) is None
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)
    )
    assert "model_type='gpt2'" in packing_policy.model_problem(gpt2)
    eager = tiny.model("llama")
    eager.config._attn_implementation = "paged|sdpa"
    assert "attn_implementation='paged|sdpa'" in packing_policy.model_problem(eager)
    dynamic = tiny.model("llama")
    dynamic.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "'dynamic'" in packing_policy.model_problem(dynamic)


def _trainer(tmp_path, **overrides):
    tok = tiny.tokenizer()
    kwargs = dict(
        model=tiny.model("llama"),
        args=tiny.training_args(str(tmp_path), max_steps=1, gradient_accumulation_steps=1, **overrides),
        train_dataset=tiny.dataset(n=8),
        eval_dataset=tiny.dataset(n=4),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    return kwargs


def test_only_the_training_loader_packs(tmp_path):
    trainer = fasttrain.Trainer(**_trainer(tmp_path))
    assert isinstance(trainer.get_train_dataloader().collate_fn, packing.PackingCollator)
    assert not isinstance(trainer.get_eval_dataloader().collate_fn, packing.PackingCollator)
    # the Trainer's own collator is back once the loader is built
    assert type(trainer.data_collator) is fasttrain.DataCollatorForSeq2Seq


def test_packed_batches_from_loader_workers_are_seen(tmp_path):
    """The packer runs in the worker process: the evidence is the batch type training_step receives."""
    trainer = fasttrain.Trainer(**_trainer(tmp_path, dataloader_num_workers=1))
    trainer.train()
    assert trainer.fasttrain_status["packing"] == "on"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"data_collator": transformers.default_data_collator}, "is not a padding collator fasttrain knows"),
        ({"args": {"include_num_input_tokens_seen": "all"}}, "include_num_input_tokens_seen='all'"),
        ({"args": {"neftune_noise_alpha": 5.0}}, "neftune_noise_alpha"),
        # the LM collator labels every first token; left padding makes padding predict it
        ({"left_lm": True}, "every batch stayed padded (example 0: the padded batch scores the label"),
    ],
    ids=["own-collator", "tokens-seen", "neftune", "left-padded-lm"],
)
def test_status_says_why_batches_stay_padded(change, reason, tmp_path):
    kwargs = _trainer(tmp_path, **change.get("args", {}))
    kwargs.update({k: v for k, v in change.items() if k not in ("args", "left_lm")})
    if change.get("left_lm"):
        tok = tiny.tokenizer(padding_side="left")
        kwargs["processing_class"] = tok
        kwargs["data_collator"] = transformers.DataCollatorForLanguageModeling(tok, mlm=False)
        kwargs["train_dataset"] = tiny.dataset(n=8, min_len=6, max_len=12).select_columns(["input_ids"])
    if kwargs["data_collator"] is transformers.default_data_collator:
        kwargs["train_dataset"] = tiny.dataset(n=8, min_len=10, max_len=10)  # one length: no padding needed
    trainer = fasttrain.Trainer(**kwargs)
    trainer.train()
    status = trainer.fasttrain_status["packing"]
    assert status.startswith("off: ") and reason in status, status


def test_cost_keeps_near_equal_lengths_padded_under_a_dense_mask():
    """sdpa/eager attend over the packed row's dense [T, T] mask: B equal rows would cost B times the padded
    attention for no token saved. Flash attention and flex skip the pairs between examples."""
    config = tiny.model("llama").config
    dense, varlen = (
        packing_policy.PackingCost(config, "sdpa"),
        packing_policy.PackingCost(config, "flash_attention_2"),
    )
    equal = np.array([30, 30, 29, 30])
    assert not dense.worth_it(4, 30, equal) and varlen.worth_it(4, 30, equal)
    skewed = np.array([40, 3, 4, 2])  # most of the padded batch is padding
    assert dense.worth_it(4, 40, skewed) and varlen.worth_it(4, 40, skewed)
    # the packer keeps such a batch padded for cost (not logged as a fallback) and packs the next one
    collator = fasttrain.DataCollatorForSeq2Seq(tiny.tokenizer(), padding=True)
    packer = packing.PackingCollator(collator, flash=False, cost=dense)
    assert not isinstance(packer([dict(e) for e in _examples(equal.tolist())]), packing.PackedBatch)
    assert packer.last_refusal_for_cost
    assert isinstance(packer([dict(e) for e in _examples(skewed.tolist())]), packing.PackedBatch)
