"""``fasttrain bench --trainer sft|dpo``: the TRL data, and plain TRL against TRL under ``patch()`` (2 steps)."""

from __future__ import annotations

import json

import pytest

import _tiny
from fasttrain.bench import summary, trl_runs, worker
from fasttrain.bench.config import Contender

pytest.importorskip("trl")

# fp32, same weights, data and seed: per-step loss and every logged metric agree within this (issue 10's bar),
# or within ABS_FLOOR where the reference value itself is about zero (DPO's rewards start at exactly 0)
RTOL = 1e-4
ABS_FLOOR = 1e-6


def test_sft_rows_mask_the_prompt_only():
    examples = [list(range(2, 2 + n)) for n in (2, 5, 16, 40)]
    rows = trl_runs.sft_rows(examples, seed=0)
    assert rows["input_ids"] == examples
    for ids, mask in zip(rows["input_ids"], rows["completion_mask"], strict=True):
        assert len(mask) == len(ids)
        prompt = mask.index(1)
        assert prompt >= 1 and mask == [0] * prompt + [1] * (len(ids) - prompt)  # one prompt, then completion
    assert rows == trl_runs.sft_rows(examples, seed=0)  # deterministic
    assert rows != trl_runs.sft_rows(examples, seed=1)


class _ListTokenizer:
    """decode() that keeps the ids, so that the test sees the lengths the rows were cut to."""

    def decode(self, ids):
        return list(ids)


def test_preference_rows_fit_and_differ():
    examples = [[i] * n for i, n in enumerate((16, 30, 32, 20), start=3)]
    rows = trl_runs.preference_rows(examples, _ListTokenizer(), seq_len=32, seed=0)
    for i, (prompt, chosen, rejected) in enumerate(
        zip(rows["prompt"], rows["chosen"], rows["rejected"], strict=True)
    ):
        assert prompt + chosen == examples[i]  # the chosen answer is the example's own continuation
        assert set(rejected) == {examples[(i + 1) % 4][0]}  # the rejected one continues the next example
        assert prompt and chosen and rejected
        assert len(prompt) + len(rejected) <= 32


@pytest.fixture
def unpatched():
    """The fasttrain side calls fasttrain.patch() in its (here: this) process: undo it after each test."""
    import fasttrain

    yield
    fasttrain.unpatch()


def _assert_same_metrics(reference: dict, ours: dict) -> None:
    differences = summary.metric_differences(reference["metrics"], ours["metrics"])
    for name, d in differences.items():
        assert d["steps_compared"] == 2, name
        assert d["max_rel"] <= RTOL or d["max_abs"] <= ABS_FLOOR, (name, d, reference["metrics"][name])


@pytest.mark.parametrize(
    ("trainer_type", "trl_metrics"),
    [
        ("sft", {"mean_token_accuracy", "entropy", "num_tokens"}),
        ("dpo", {"rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected", "entropy"}),
    ],
)
def test_plain_and_patched_trl_agree(trainer_type, trl_metrics, unpatched):
    config = _tiny.bench_config(steps=2, group_by_length=trainer_type != "dpo", trainer_type=trainer_type)
    reference = worker.run(config, Contender("reference", "reference"))
    ours = worker.run(config, Contender("fasttrain", "fasttrain"))
    for result in (reference, ours):
        assert result["steps"] == 2 and result["trainer_type"] == trainer_type
        assert result["trainer_class"].startswith("trl.")
        assert {"loss", "grad_norm", *trl_metrics} <= set(result["metrics"]), sorted(result["metrics"])
        assert all(len(values) == 2 for values in result["metrics"].values())
        assert result["tokens_per_s"] > 0 and result["timed_tokens"] > 0
        json.dumps(result, allow_nan=False)
    assert reference["trainer_class"] == ours["trainer_class"]
    assert not reference["patched"] and ours["patched"]
    assert not reference["hot_paths"] and ours["hot_paths"]  # only the patched side reports a status
    _assert_same_metrics(reference, ours)
