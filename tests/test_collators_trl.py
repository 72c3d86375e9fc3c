"""fasttrain's TRL collators against TRL's own classes (trl is a test dependency only).

Same contract as the transformers collators: for each drawn batch and settings, both return the same batch
(keys in the same order, dtypes, shapes, values) or both raise (ours a catchable Exception). Batches are what
SFTTrainer, DPOTrainer and KTOTrainer feed their collators: token lists (or numpy/torch rows), prebuilt labels, the
completion/assistant masks SFTTrainer leaves in (ignored by both), packed examples with ``seq_lengths``, KTO's
unpaired examples (prompt, completion, KL completion, label, reference log-probs).
"""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

trl_sft = pytest.importorskip("trl.trainer.sft_trainer")
trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
trl_kto = pytest.importorskip("trl.trainer.kto_trainer")

import trl  # noqa: E402

import _tiny as tiny  # noqa: E402
import fasttrain  # noqa: E402
from _collator_cases import as_container  # noqa: E402
from fasttrain.data import _rows  # noqa: E402
from fasttrain.data import collators as ft  # noqa: E402
from fasttrain.data import trl_collators as ours_trl  # noqa: E402

pytestmark = pytest.mark.trl

SETTINGS = settings(
    max_examples=int(os.environ.get("FASTTRAIN_HYPOTHESIS_EXAMPLES", "80")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
token = st.integers(0, 39)
# Huge multiples only where torch refuses before allocating (2**62 int64 elements overflow the byte count).
multiples = st.one_of(st.none(), st.sampled_from([-3, -1, 0, 1, 2, 3, 8, 2**62, 2**70]))
pad_ids = st.sampled_from([0, 3, -1, 2**63 - 1, 2**63, None])


def assert_same(got: dict, expected: dict) -> None:
    assert type(got) is type(expected)
    assert list(got) == list(expected)
    for key, want in expected.items():
        have = got[key]
        assert type(have) is type(want), key
        if isinstance(want, torch.Tensor):
            assert (have.dtype, have.shape) == (want.dtype, want.shape), key
            assert torch.equal(have, want), key
        else:
            assert have == want, key


def copy(batch: list) -> list:
    def one(v):
        if isinstance(v, (torch.Tensor, np.ndarray)):
            return v.copy() if isinstance(v, np.ndarray) else v.clone()
        return list(v) if isinstance(v, list) else v

    return [{k: one(v) for k, v in e.items()} for e in batch]


def tokens_in(batch: dict) -> int:
    return sum(v.numel() for k, v in batch.items() if k in ("input_ids",) and isinstance(v, torch.Tensor))


def compare(ours, ref, examples, total_tokens: int) -> None:
    """Same batch, or both raise. The one allowed difference: a negative pad_to_multiple_of can make TRL's
    tensor narrower than a 1-token row, which torch broadcasts into nothing (tokens silently dropped); ours
    raises a ValueError there."""
    assert isinstance(ours, type(ref))
    handovers = []
    quiet = mock.patch.object(_rows, "hand_over", lambda _c, why: handovers.append(why))
    try:
        expected = ref(copy(examples))
    except Exception:
        with quiet, pytest.raises(Exception):  # noqa: B017 - the contract is "catchable", any type
            ours(copy(examples))
        event("both raised" + (" (handed over)" if handovers else ""))
        return
    with quiet:
        try:
            got = ours(copy(examples))
        except ValueError as err:
            assert tokens_in(expected) < total_tokens, f"ours raised where TRL did not: {err}"
            event("ours raised: TRL dropped tokens")
            return
    assert_same(got, expected)
    event("same batch" + (" (handed over)" if handovers else " (native)"))


@st.composite
def partitions(draw, n: int) -> list[int]:
    """A packed example's document lengths: positive, adding up to n."""
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=4))) if n > 1 else []
    return [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]


@st.composite
def sft_batches(draw):
    n = draw(st.integers(1, 6))
    kind = draw(st.sampled_from(["list", "list", "list", "tuple", "np64", "np32", "torch"]))
    with_labels = draw(st.sampled_from(["none", "all", "some"]))
    packed = draw(st.booleans())
    masks = draw(st.booleans())
    examples = []
    for _ in range(n):
        ids = draw(st.lists(token, min_size=0 if not packed else 1, max_size=12))
        e = {"input_ids": as_container(ids, kind)}
        if with_labels == "all" or (with_labels == "some" and draw(st.booleans())):
            same_length = draw(st.integers(0, 9)) > 0
            size = len(ids) if same_length else draw(st.integers(0, 12))
            e["labels"] = as_container(
                draw(st.lists(st.integers(-100, 39), min_size=size, max_size=size)), kind
            )
        if masks:  # what SFTTrainer may leave in: the collator ignores them
            e["completion_mask"] = [1] * len(ids)
            e["assistant_masks"] = [0] * len(ids)
        if packed:
            e["seq_lengths"] = draw(partitions(len(ids)))
        examples.append(e)
    return examples


@SETTINGS
@given(sft_batches(), pad_ids, st.booleans(), st.booleans(), multiples, st.sampled_from(["pt", "np"]))
def test_sft_collator_matches_trl(examples, pad_id, padding_free, position_ids, multiple, rt):
    args = dict(
        pad_token_id=pad_id,
        padding_free=padding_free,
        return_position_ids=position_ids,
        pad_to_multiple_of=multiple,
        return_tensors=rt,
    )
    total = sum(len(e["input_ids"]) for e in examples)
    compare(
        ours_trl.DataCollatorForLanguageModeling(**args),
        trl_sft.DataCollatorForLanguageModeling(**args),
        examples,
        total,
    )


@st.composite
def preference_batches(draw):
    n = draw(st.integers(1, 5))
    logps = draw(st.sampled_from([(), ("ref_chosen_logps",), ("ref_chosen_logps", "ref_rejected_logps")]))
    examples = []
    for _ in range(n):
        e = {key: draw(st.lists(token, max_size=8)) for key in ("prompt_ids", "chosen_ids", "rejected_ids")}
        for key in logps:
            e[key] = draw(st.floats(-50, 0, width=32))
        examples.append(e)
    return examples


@SETTINGS
@given(
    preference_batches(),
    pad_ids,
    st.one_of(st.none(), st.sampled_from([-3, -1, 0, 1, 2, 5, 9, 2**70])),
    st.sampled_from(["keep_start", "keep_end", "keep_middle"]),
    multiples,
)
def test_preference_collator_matches_trl(examples, pad_id, max_length, mode, multiple):
    args = dict(pad_token_id=pad_id, max_length=max_length, truncation_mode=mode, pad_to_multiple_of=multiple)
    total = 2 * sum(len(e["prompt_ids"]) for e in examples) + sum(
        len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in examples
    )
    compare(
        ours_trl.DataCollatorForPreference(**args), trl_dpo.DataCollatorForPreference(**args), examples, total
    )


def test_sft_padding_free_packed_example_by_hand():
    """TRL's docstring example, packed: positions restart per document, labels -100 at each start."""
    examples = [
        {"input_ids": [1, 2, 3, 4], "seq_lengths": [3, 1]},
        {"input_ids": [5, 6], "labels": [-100, 6], "seq_lengths": [2]},
    ]
    args = dict(pad_token_id=0, padding_free=True, pad_to_multiple_of=4)
    got = ours_trl.DataCollatorForLanguageModeling(**args)(copy(examples))
    assert_same(got, trl_sft.DataCollatorForLanguageModeling(**args)(copy(examples)))
    assert got["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 0, 0]]
    assert got["labels"].tolist() == [[-100, 2, 3, -100, -100, 6, -100, -100]]
    assert got["cu_seq_lens_q"] is got["cu_seq_lens_k"]  # one tensor under both names, as in TRL


@pytest.mark.parametrize(
    ("example", "message"),
    [
        ({"input_ids": [1, 2, 3], "seq_lengths": [2, 2]}, r"example 1: 'seq_lengths' add up to 4"),
        ({"input_ids": [1, 2, 3], "seq_lengths": [3, 0]}, r"example 1: 'seq_lengths' holds 0"),
        ({"input_ids": [1, 2.5, 3], "seq_lengths": [3]}, r"example 1: 'input_ids'\[1\] is a float"),
        ({"input_ids": [1, 2, 3], "labels": [1, "x", 3], "seq_lengths": [3]}, r"example 1: 'labels'\[1\]"),
        ({"labels": [1]}, r"example 1 has no key 'input_ids'"),
    ],
)
def test_sft_bad_input_names_example_and_key(example, message):
    """Where TRL would fail later or return misaligned tensors (seq_lengths that do not tile the example:
    TRL's position_ids then have another width than input_ids), ours raises naming the culprit."""
    examples = [{"input_ids": [7, 8], "seq_lengths": [2]}, example]
    collator = ours_trl.DataCollatorForLanguageModeling(pad_token_id=0, return_position_ids=True)
    with pytest.raises((ValueError, TypeError, KeyError), match=message):
        collator(copy(examples))


def test_preference_bad_input_names_example_and_key():
    collator = ours_trl.DataCollatorForPreference(pad_token_id=0)
    good = {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}
    with pytest.raises(TypeError, match=r"example 1: 'rejected_ids'\[0\] is a str"):
        collator([good, {**good, "rejected_ids": ["a"]}])
    with pytest.raises(KeyError, match=r"example 1 has no key 'chosen_ids'"):
        collator([good, {"prompt_ids": [1], "rejected_ids": [3]}])


@st.composite
def unpaired_batches(draw):
    """What KTOTrainer hands its collator (lists; KL completions rotated within the batch), now and then with
    one odd sequence: another container, or an element that is a float, a bool, a str or outside int64."""
    n = draw(st.integers(1, 5))
    kl = draw(st.booleans())
    logps = draw(st.sampled_from([(), ("ref_logps",), ("ref_logps", "ref_KL_logps")]))
    examples = []
    for _ in range(n):
        e = {key: draw(st.lists(token, max_size=8)) for key in ("prompt_ids", "completion_ids")}
        if kl:
            e["KL_completion_ids"] = draw(st.lists(token, max_size=8))
        for key in logps:
            e[key] = draw(st.floats(-50, 0, width=32))
        e["label"] = draw(st.booleans())
        examples.append(e)
    odd = draw(st.sampled_from(["none"] * 8 + ["tuple", "np64", "float", "bool", "str", "big"]))
    if odd != "none":
        e = examples[draw(st.integers(0, n - 1))]
        key = draw(st.sampled_from([k for k in e if k.endswith("_ids")]))
        if odd in ("tuple", "np64"):
            e[key] = as_container(e[key], odd)
        else:
            item = {"float": 2.5, "bool": True, "str": "x", "big": 2**63}[odd]
            e[key].insert(draw(st.integers(0, len(e[key]))), item)
        event(f"odd: {odd}")
    return examples


def kept_tokens(examples: list, max_length) -> int:
    """The tokens of TRL's input_ids: prompt + completion, cut at max_length."""
    bounds = slice(None, max_length)
    try:
        return sum(len((list(e["prompt_ids"]) + list(e["completion_ids"]))[bounds]) for e in examples)
    except TypeError:
        return 0


@SETTINGS
@given(
    unpaired_batches(),
    st.sampled_from([0, 3, -1, 2**63 - 1, 2**63, None, 1.5]),
    st.one_of(st.none(), st.sampled_from([-3, -1, 0, 1, 2, 5, 9, 2**70])),
    multiples,
)
def test_unpaired_preference_collator_matches_trl(examples, pad_id, max_length, multiple):
    args = dict(pad_token_id=pad_id, max_length=max_length, pad_to_multiple_of=multiple)
    compare(
        ours_trl.DataCollatorForUnpairedPreference(**args),
        trl_kto.DataCollatorForUnpairedPreference(**args),
        examples,
        kept_tokens(examples, max_length),
    )


def _unpaired(prompt, completion, label=True, **extra) -> dict:
    return {"prompt_ids": prompt, "completion_ids": completion, **extra, "label": label}


@pytest.mark.parametrize(
    ("examples", "args"),
    [
        ([_unpaired([1, 2, 3], [4, 5])], {}),  # a single example
        ([_unpaired([], [4, 5]), _unpaired([6], [7])], {}),  # an empty prompt
        ([_unpaired([1, 2], []), _unpaired([6], [7])], {}),  # an empty completion
        ([_unpaired([], []), _unpaired([], [])], {"pad_to_multiple_of": 4}),  # every row empty: width 0
        ([_unpaired([1, 2, 3], [4, 5]), _unpaired([6], [7])], {"pad_to_multiple_of": 4}),
        ([_unpaired([1, 2, 3], [4, 5]), _unpaired([6], [7, 8, 9])], {"max_length": 2}),  # cut in the prompt
        ([_unpaired([1, 2, 3], [4, 5]), _unpaired([6], [7, 8, 9])], {"max_length": -2}),  # Python's slice
        ([_unpaired([1, 2, 3], [4, 5]), _unpaired([6], [7, 8, 9])], {"max_length": 0}),
        (
            [
                _unpaired([1], [2], KL_completion_ids=[], label=0),
                _unpaired([3], [4], KL_completion_ids=[5, 6]),
            ],
            {},
        ),
        ([{"prompt_ids": [1], "KL_completion_ids": [2], "label": False}], {}),  # KL rows only
        ([{"label": True}, {"label": False}], {}),  # no sequences: the labels alone
        ([_unpaired([np.int32(5), True], [np.int64(7), torch.tensor(8)], ref_logps=-1.0)], {}),  # int types
        (
            [_unpaired([1], [2], ref_logps=-1.0, ref_KL_logps=2, label=1.0)],
            {},
        ),  # TRL's own tensor conversions
    ],
)
def test_unpaired_preference_odd_shapes_run_natively(examples, args):
    args = {"pad_token_id": 9, **args}
    handovers = []
    with mock.patch.object(_rows, "hand_over", lambda _c, why: handovers.append(why)):
        got = ours_trl.DataCollatorForUnpairedPreference(**args)(copy(examples))
    assert not handovers
    assert_same(got, trl_kto.DataCollatorForUnpairedPreference(**args)(copy(examples)))


def test_unpaired_preference_by_hand():
    """TRL's docstring example, cut at max_length=4 and padded to a multiple of 3."""
    examples = [
        {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "KL_completion_ids": [6], "label": True},
        {"prompt_ids": [7, 8], "completion_ids": [9], "KL_completion_ids": [10, 11], "label": False},
    ]
    got = ours_trl.DataCollatorForUnpairedPreference(pad_token_id=0, max_length=4, pad_to_multiple_of=3)(
        copy(examples)
    )
    assert list(got) == [
        "input_ids",
        "attention_mask",
        "completion_mask",
        "KL_input_ids",
        "KL_attention_mask",
        "KL_completion_mask",
        "label",
    ]
    assert got["input_ids"].tolist() == [[1, 2, 3, 4, 0, 0], [7, 8, 9, 0, 0, 0]]
    assert got["completion_mask"].tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 1, 0, 0, 0]]
    assert got["KL_attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert got["label"].tolist() == [True, False]


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ({"completion_ids": ["a"]}, TypeError, r"example 1: 'completion_ids'\[0\] is a str"),
        ({"KL_completion_ids": [3, [4]]}, TypeError, r"example 1: 'KL_completion_ids'\[1\] is a nested"),
        ({"prompt_ids": [1, 2**64]}, ValueError, r"example 1: 'prompt_ids'\[1\] = \d+ is outside the int64"),
        ({"label": None}, KeyError, r"example 1 has no key 'label'"),
        ({"KL_completion_ids": None}, KeyError, r"example 1 has no key 'KL_completion_ids'"),
        ({"ref_logps": None}, KeyError, r"example 1 has no key 'ref_logps'"),
    ],
)
def test_unpaired_preference_bad_input_names_example_and_key(bad, error, message):
    good = {
        "prompt_ids": [1],
        "completion_ids": [2],
        "KL_completion_ids": [3],
        "ref_logps": -1.0,
        "label": True,
    }
    example = {k: v for k, v in {**good, **bad}.items() if v is not None}
    collator = ours_trl.DataCollatorForUnpairedPreference(pad_token_id=0)
    with pytest.raises(error, match=message):
        collator([dict(good), example])
    with pytest.raises(Exception):  # noqa: B017 - TRL fails on these too (or, for the nested list, later)
        trl_kto.DataCollatorForUnpairedPreference(pad_token_id=0)([dict(good), example])


@pytest.mark.parametrize(
    ("examples", "args", "why"),
    [
        ([_unpaired([1, 2.7], [3])], {}, "not integers"),  # TRL truncates floats
        ([_unpaired([1, 2], [3, "cut off"])], {"max_length": 3}, "not integers"),  # TRL never casts the tail
        ([_unpaired(np.array([1, 2]), [3, 4])], {}, "'prompt_ids' values are not all lists"),  # TRL adds them
        ([_unpaired([1, 2], [3])], {"pad_token_id": 0.5}, "pad_token_id=0.5 is not an integer"),
    ],
)
def test_unpaired_preference_hand_overs_are_logged_once(examples, args, why, caplog):
    from fasttrain import _logging

    saved = set(_logging._said)
    _logging._said.clear()
    args = {"pad_token_id": 0, **args}
    try:
        collator = ours_trl.DataCollatorForUnpairedPreference(**args)
        with caplog.at_level("WARNING", logger="fasttrain"):
            for _ in range(3):
                got = collator(copy(examples))
        assert_same(got, trl_kto.DataCollatorForUnpairedPreference(**args)(copy(examples)))
        messages = [r.getMessage() for r in caplog.records if "runs through the reference" in r.getMessage()]
        assert len(messages) == 1 and why in messages[0]
    finally:
        _logging._said.clear()
        _logging._said.update(saved)


def test_hand_overs_are_logged_once(caplog):
    from fasttrain import _logging

    saved = set(_logging._said)
    _logging._said.clear()
    try:
        collator = ours_trl.DataCollatorForLanguageModeling(pad_token_id=0)
        examples = [
            {"input_ids": np.array([1, 2], dtype=np.int32)},
            {"input_ids": np.array([3], dtype=np.int32)},
        ]
        with caplog.at_level("WARNING", logger="fasttrain"):
            for _ in range(3):
                assert collator(copy(examples))["input_ids"].dtype == torch.int32  # TRL keeps int32
        assert sum("runs through the reference" in r.getMessage() for r in caplog.records) == 1
    finally:
        _logging._said.clear()
        _logging._said.update(saved)


def test_native_equivalent_of_trl_collators_and_reasons():
    sft = trl_sft.DataCollatorForLanguageModeling(pad_token_id=3, padding_free=True, pad_to_multiple_of=8)
    dpo = trl_dpo.DataCollatorForPreference(pad_token_id=0, max_length=6, truncation_mode="keep_end")
    kto = trl_kto.DataCollatorForUnpairedPreference(pad_token_id=2, max_length=4, pad_to_multiple_of=3)
    batches = [
        (sft, [{"input_ids": [5, 6, 7]}, {"input_ids": [8], "labels": [9]}]),
        (dpo, [{"prompt_ids": [1, 2], "chosen_ids": [3, 4, 5, 6, 7], "rejected_ids": [8]}]),
        (
            kto,
            [{"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "KL_completion_ids": [6], "label": True}]
            * 2,
        ),
    ]
    for theirs, examples in batches:
        ours = ft.native_equivalent(theirs)
        assert isinstance(ours, type(theirs)) and type(ours) is not type(theirs)
        assert getattr(type(ours), "fasttrain_native", False)
        assert vars(ours) == vars(theirs)
        assert_same(ours(copy(examples)), theirs(copy(examples)))
        assert ft.native_equivalent(ours) is ours

    class Custom(trl_sft.DataCollatorForLanguageModeling):
        pass

    assert ft.native_equivalent(Custom(pad_token_id=0)) is None
    reason = ft.why_no_native_equivalent(Custom(pad_token_id=0))
    assert "Custom subclasses trl.trainer.sft_trainer.DataCollatorForLanguageModeling" in reason
    vision = trl_sft.DataCollatorForVisionLanguageModeling.__new__(
        trl_sft.DataCollatorForVisionLanguageModeling
    )
    assert ft.native_equivalent(vision) is None
    assert ft.why_no_native_equivalent(vision) == (
        "trl.trainer.sft_trainer.DataCollatorForVisionLanguageModeling has no native equivalent"
    )
    kto_vision_cls = trl_kto.DataCollatorForVisionUnpairedPreference
    kto_vision = kto_vision_cls.__new__(kto_vision_cls)  # KTO's vision collator stays TRL's
    assert ft.native_equivalent(kto_vision) is None
    assert ft.why_no_native_equivalent(kto_vision) == (
        "trl.trainer.kto_trainer.DataCollatorForVisionUnpairedPreference has no native equivalent"
    )


def test_import_fasttrain_does_not_import_trl():
    code = (
        "import sys, fasttrain, fasttrain.data.collators as c, transformers\n"
        "from transformers import DataCollatorWithPadding\n"
        "assert c.native_equivalent(transformers.DefaultDataCollator()) is None\n"
        "assert 'trl' not in sys.modules, sorted(m for m in sys.modules if m.startswith('trl'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize(
    "extra",
    [{}, {"padding_free": True, "max_length": None}, {"packing": True}, {"completion_only_loss": True}],
    ids=["padded", "padding-free", "packed", "completion-only"],
)
def test_sft_trainer_under_patch_collates_natively(tmp_path, extra):
    """Under patch(), SFTTrainer's own collator becomes ours, with its settings, and on examples of the
    trainer's prepared dataset (what its data loader feeds the collator) it is byte-identical to TRL's."""
    dataset = tiny.text_dataset()
    columns = ["prompt", "completion"] if extra.get("completion_only_loss") else ["text"]
    if columns == ["prompt", "completion"]:
        dataset = dataset.rename_column("chosen", "completion")
    config = trl.SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **{"max_length": 32, **extra},
    )
    fasttrain.patch()
    try:
        trainer = trl.SFTTrainer(
            model=tiny.model("llama"),
            args=config,
            train_dataset=dataset.select_columns(columns),
            processing_class=tiny.tokenizer(),
        )
    finally:
        fasttrain.unpatch()
    assert type(trainer.data_collator) is ours_trl.DataCollatorForLanguageModeling
    reference = trl_sft.DataCollatorForLanguageModeling(**vars(trainer.data_collator))
    examples = [trainer.train_dataset[i] for i in range(4)]
    examples = [{k: v for k, v in e.items() if k in ("input_ids", "labels", "seq_lengths")} for e in examples]
    if extra.get("packing"):  # TRL packs best-fit, padding-free, with the document lengths
        assert trainer.data_collator.padding_free and all(len(e["seq_lengths"]) for e in examples)
    assert_same(trainer.data_collator(copy(examples)), reference(copy(examples)))


def test_dpo_trainer_under_patch_collates_natively(tmp_path):
    config = trl.DPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        max_length=12,
        disable_tqdm=True,
    )
    fasttrain.patch()
    try:
        trainer = trl.DPOTrainer(
            model=tiny.model("llama"),
            ref_model=tiny.model("llama"),
            args=config,
            train_dataset=tiny.text_dataset().select_columns(["prompt", "chosen", "rejected"]),
            processing_class=tiny.tokenizer(),
        )
    finally:
        fasttrain.unpatch()
    assert type(trainer.data_collator) is ours_trl.DataCollatorForPreference
    reference = trl_dpo.DataCollatorForPreference(**vars(trainer.data_collator))
    keys = ("prompt_ids", "chosen_ids", "rejected_ids")
    examples = [{k: trainer.train_dataset[i][k] for k in keys} for i in range(4)]
    assert_same(trainer.data_collator(copy(examples)), reference(copy(examples)))


def test_kto_trainer_under_patch_collates_natively(tmp_path):
    """KTOTrainer's collator (its dataset unpaired, KL completions rotated within the batch) becomes ours."""
    config = trl.KTOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        max_length=12,
        train_sampling_strategy="sequential",  # KTO's KL term needs it
        disable_tqdm=True,
    )
    fasttrain.patch()
    try:
        trainer = trl.KTOTrainer(
            model=tiny.model("llama"),
            ref_model=tiny.model("llama"),
            args=config,
            train_dataset=tiny.text_dataset().select_columns(["prompt", "chosen", "rejected"]),
            processing_class=tiny.tokenizer(),
        )
    finally:
        fasttrain.unpatch()
    assert type(trainer.data_collator) is ours_trl.DataCollatorForUnpairedPreference
    reference = trl_kto.DataCollatorForUnpairedPreference(**vars(trainer.data_collator))
    keys = ("prompt_ids", "completion_ids", "KL_completion_ids", "label")
    examples = [{k: trainer.train_dataset[i][k] for k in keys} for i in range(4)]
    got = trainer.data_collator(copy(examples))
    assert "KL_input_ids" in got and got["input_ids"].shape[1] <= 12
    assert_same(got, reference(copy(examples)))


@pytest.mark.parametrize(
    ("theirs", "mask"),
    [
        (trl_dpo.DataCollatorForPreference, "input_ids"),
        (trl_kto.DataCollatorForUnpairedPreference, "completion_mask"),
        (trl_kto.DataCollatorForUnpairedPreference, "KL_attention_mask"),
    ],
    ids=["dpo", "kto", "kto-KL"],
)
def test_a_trl_that_makes_other_batches_keeps_its_collators(monkeypatch, caplog, theirs, mask):
    """native_equivalent checks once that this TRL's collators still make our batches; when one does not
    (a TRL release changed it), TRL's collators are kept and the log says why."""
    from fasttrain import _logging

    monkeypatch.setattr(_logging, "_said", set())
    ours_trl.agrees_with_trl.cache_clear()
    assert ours_trl.agrees_with_trl()
    original = theirs.torch_call

    def changed(self, examples):
        batch = original(self, examples)
        batch[mask] = batch[mask] + 1
        return batch

    monkeypatch.setattr(theirs, "torch_call", changed)
    ours_trl.agrees_with_trl.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="fasttrain"):
            sft = trl_sft.DataCollatorForLanguageModeling(pad_token_id=0)
            assert ft.native_equivalent(sft) is None
            assert ft.native_equivalent(trl_kto.DataCollatorForUnpairedPreference(pad_token_id=0)) is None
        assert f"{theirs.__name__} (" in caplog.text
        assert "makes other batches than fasttrain's equivalent" in caplog.text
    finally:
        ours_trl.agrees_with_trl.cache_clear()
