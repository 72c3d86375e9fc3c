"""``fasttrain bench --trainer sft|dpo``: the TRL data, and plain TRL against TRL under ``patch()`` (2 steps)."""

from __future__ import annotations

import json

import pytest

import _tiny
from _bench_helpers import full_data
from fasttrain.bench import summary, trl_runs, worker
from fasttrain.bench.config import Contender

pytest.importorskip("trl")

pytestmark = pytest.mark.trl

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
        within = d["max_abs"] <= ABS_FLOOR or (d["max_rel"] is not None and d["max_rel"] <= RTOL)
        assert within, (name, d, reference["metrics"][name])


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


def test_unpaired_rows_alternate_desirable_and_undesirable():
    examples = [[i] * n for i, n in enumerate((16, 30, 32, 20), start=3)]
    paired = trl_runs.preference_rows(examples, _ListTokenizer(), seq_len=32, seed=0)
    rows = trl_runs.unpaired_rows(examples, _ListTokenizer(), seq_len=32, seed=0)
    assert rows["prompt"] == paired["prompt"] and rows["label"] == [True, False, True, False]
    assert rows["completion"] == [
        paired["chosen"][0],
        paired["rejected"][1],
        paired["chosen"][2],
        paired["rejected"][3],
    ]


def test_rewards_are_deterministic_functions_of_the_ids():
    from fasttrain.bench import rewards

    ids = [[5] * rewards.TARGET_LENGTH, [5, 6, 7, 7], []]
    assert rewards.length_reward(ids) == [1.0, 1.0 - (rewards.TARGET_LENGTH - 4) / rewards.TARGET_LENGTH, 0.0]
    assert rewards.distinct_tokens_reward(ids) == [1 / rewards.TARGET_LENGTH, 0.75, 0.0]
    assert rewards.length_reward(completion_ids=ids, prompts=["x"] * 3) == rewards.length_reward(ids)


def test_synthetic_completions_look_generated():
    import torch

    from fasttrain.bench import rl_runs

    tok = _tiny.tokenizer()
    config = _tiny.bench_config(trainer_type="grpo", max_completion_length=300, seed=3)
    prompts = torch.full((64, 5), 7)
    first = rl_runs.synthetic_generate(config, tok, tok.pad_token_id)
    out = first(input_ids=prompts, attention_mask=torch.ones_like(prompts))
    assert torch.equal(out[:, :5], prompts)
    completions = out[:, 5:]
    lengths = []
    for row in completions.tolist():
        ended = tok.eos_token_id in row
        length = row.index(tok.eos_token_id) + 1 if ended else len(row) - row.count(tok.pad_token_id)
        assert set(row[length:]) <= {tok.pad_token_id}  # pad after the end
        assert tok.pad_token_id not in row[:length] and tok.eos_token_id not in row[: length - 1]
        assert ended or length == 300  # only a completion cut at the limit has no end-of-text id
        lengths.append(length)
    assert max(lengths) <= 300 and len(set(lengths)) > 20  # log-normal: varied lengths
    again = rl_runs.synthetic_generate(config, tok, tok.pad_token_id)(input_ids=prompts)
    assert torch.equal(again, out)  # the same on both sides
    assert not torch.equal(first(input_ids=prompts), out)  # the next call draws anew


def test_completion_tokens_count_up_to_the_first_end():
    import torch

    from fasttrain.bench.phases import completion_tokens

    out = torch.tensor([[9, 9, 4, 0, 4, 1], [9, 9, 4, 4, 4, 4], [9, 9, 2, 1, 1, 1]])
    assert completion_tokens(out, prompt_width=2, eos_ids=[0, 2]) == 2 + 4 + 1
    assert completion_tokens(out, prompt_width=2, eos_ids=[]) == 12


_RL_TINY = dict(batch_size=4, num_generations=4, max_completion_length=16, group_by_length=False)


@pytest.mark.parametrize(
    ("trainer_type", "settings", "trl_metrics"),
    [
        ("grpo", _RL_TINY, {"reward", "entropy", "completions/mean_length", "rewards/length_reward/mean"}),
        (
            "rloo",
            _RL_TINY,
            {"reward", "kl", "completions/mean_length", "rewards/distinct_tokens_reward/mean"},
        ),
        ("kto", dict(group_by_length=False), {"kl", "rewards/chosen", "logps/chosen", "logps/rejected"}),
    ],
)
def test_plain_and_patched_rl_and_kto_agree(trainer_type, settings, trl_metrics, unpatched, tmp_path):
    """GRPO and RLOO (generating with model.generate) and KTO through the bench's worker, plain TRL and under
    patch(): the same metrics at every step; the patched side's loss is fasttrain's; GRPO and RLOO report each
    phase's time, tokens and peak memory, and the report's table names the phase of each figure."""
    from fasttrain.bench import report

    config = _tiny.bench_config(steps=2, trainer_type=trainer_type, **settings)
    reference = worker.run(config, Contender("reference", "reference"))
    ours = worker.run(config, Contender("fasttrain", "fasttrain"))
    for result in (reference, ours):
        assert result["steps"] == 2 and result["trainer_type"] == trainer_type
        assert result["trainer_class"].startswith("trl.")
        assert {"loss", "grad_norm", *trl_metrics} <= set(result["metrics"]), sorted(result["metrics"])
        assert "step_time" not in result["metrics"]  # a timing, never compared
        assert result["tokens_per_s"] > 0 and result["timed_tokens"] > 0
        json.dumps(result, allow_nan=False)
    assert ours["hot_paths"]["loss"] == "on" and ours["patched"] and not reference["hot_paths"]
    _assert_same_metrics(reference, ours)
    if trainer_type == "kto":
        assert "phases" not in ours
        return
    for result in (reference, ours):
        assert result["generate_calls"] == 2  # one generation per optimizer step (grad-accum 1)
        assert all(t > 0 for t in result["generation_times_s"])
        assert all(
            0 < t < s for t, s in zip(result["training_phase_times_s"], result["step_times_s"], strict=True)
        )
        # every completion, 1 to 16 tokens, and each step's loss forward saw its prompt and its completions
        assert all(4 <= n <= 4 * 16 for n in result["generated_tokens_per_step"])
        assert all(
            t > n for t, n in zip(result["tokens_per_step"], result["generated_tokens_per_step"], strict=True)
        )
        if result["memory_kind"].startswith("peak RSS (VmHWM"):  # Linux: each phase's own peak
            assert result["training_peak_memory_mb"] > 0 and result["generation_peak_memory_mb"] > 0
            assert result["peak_memory_mb"] >= result["training_peak_memory_mb"]
    # the same completions on both sides: generated tokens, lengths and rewards agree exactly
    assert reference["generated_tokens_per_step"] == ours["generated_tokens_per_step"]
    for key in ("completions/mean_length", "reward"):
        assert reference["metrics"][key] == ours["metrics"][key], key
    data = full_data({"reference": [reference], "fasttrain": [ours]}, config=config)
    assert data["comparison"]["fasttrain_vs_reference"]["training_phase_time_s_ratio"] > 0
    _, rows = report.rows(data)
    labels = [row[0] for row in rows]
    for phase in (
        "training phase: scored tokens/s",
        "generation: completion tokens/s",
        "whole step: s per step",
    ):
        assert any(label.startswith(phase) for label in labels), labels
    text = report.markdown(config, data)
    assert "1 prompt x 4 completions" in text and "docs/method.md" in text


def test_the_report_says_how_loaded_the_machine_was_during_the_runs():
    from fasttrain.bench import report

    data = {"provenance": {"load_1min_at_start": 1.0, "machine": {"cores": 2}}, "load_average": {"end": 1.5}}
    assert "competed" not in report._load_note(data)[0]
    data["load_average"]["during_runs"] = {"mean": 3.4, "max": 6.6}
    note = report._load_note(data)[0]
    assert "during the runs: mean 3.4, highest 6.6" in note and "other processes competed for the CPU" in note
