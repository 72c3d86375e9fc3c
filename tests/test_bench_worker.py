"""One training run (in process, for speed) and the whole command end to end (one child per contender)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

import _tiny
from fasttrain.bench import provenance, worker
from fasttrain.bench.config import Contender, dump


@pytest.fixture(scope="module")
def reference_result(tmp_path_factory):
    progress = tmp_path_factory.mktemp("w") / "progress"
    result = worker.run(_tiny.bench_config(), Contender("reference", "reference"), str(progress))
    result["progress_lines"] = progress.read_text().split()
    return result


def test_worker_result_schema(reference_result):
    r = reference_result
    assert r["steps"] == 3 and r["warmup_steps_excluded"] == 1
    assert len(r["losses"]) == 3 and all(isinstance(x, float) and 0 < x < 20 for x in r["losses"])
    # a randomly initialised model over Qwen3's vocabulary starts near ln(151936) = 11.93
    assert r["losses"][0] == pytest.approx(11.93, abs=0.3)
    assert len(r["step_times_s"]) == 3 and all(t > 0 for t in r["step_times_s"])
    assert len(r["tokens_per_step"]) == 3 and all(0 < n <= 2 * 32 for n in r["tokens_per_step"])
    assert r["timed_tokens"] == sum(r["tokens_per_step"][1:])
    assert r["tokens_per_s"] == pytest.approx(r["timed_tokens"] / (sum(r["step_times_s"][1:])), rel=1e-6)
    assert r["peak_memory_mb"] >= r["memory_after_setup_mb"] > 0
    assert r["memory_kind"].startswith("peak RSS")
    assert r["trainer_class"] == "transformers.trainer.Trainer"
    assert r["progress_lines"] == ["1", "2", "3"]
    assert r["model_shape"]["hidden_size"] == 32 and r["model_shape"]["vocab_size"] == 151_936
    json.dumps(r, allow_nan=False)


def test_same_seed_same_losses_and_grad_accum_counts_tokens(reference_result):
    again = worker.run(_tiny.bench_config(), Contender("reference", "reference"))
    assert again["losses"] == reference_result["losses"]  # identical weights, data and order
    accum = worker.run(_tiny.bench_config(grad_accum=2, steps=2), Contender("reference", "reference"))
    assert all(0 < n <= 2 * 2 * 32 for n in accum["tokens_per_step"])
    assert max(accum["tokens_per_step"]) > 2 * 32  # two micro-batches per optimizer step


def test_fasttrain_run_reads_the_ablation_switch(monkeypatch):
    monkeypatch.setenv("FASTTRAIN_DISABLE", "loss")
    r = worker.run(_tiny.bench_config(steps=2), Contender("fasttrain-no-loss", "fasttrain", "loss"))
    assert r["trainer_class"] == "fasttrain.trainer.Trainer"
    assert r["fasttrain_disable"] == "loss"
    assert r["hot_paths_requested"]["loss"] is False
    assert r["hot_paths_requested"]["optimizer"] is True
    assert isinstance(r["hot_paths"], dict)


def test_worker_main_reports_a_data_error_as_exit_2(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "no text column"}) + "\n")
    job = tmp_path / "job.json"
    result = tmp_path / "result.json"
    dump(
        job,
        {
            "config": _tiny.bench_config(dataset=str(bad)).to_json(),
            "contender": Contender("reference", "reference").to_json(),
            "result_path": str(result),
        },
    )
    assert worker.main([str(job)]) == 2
    assert "no 'text' or 'input_ids' column" in json.loads(result.read_text())["error"]


def test_python_m_fasttrain_bench_end_to_end(tmp_path):
    """The real command: two child processes, progress bar, table, --json, --markdown, --plot."""
    out = tmp_path / "r"
    env = dict(os.environ, FASTTRAIN_DISABLE="optimizer")  # inherited by the parent, must not reach fasttrain
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fasttrain",
            "bench",
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--steps",
            "2",
            "--warmup-steps",
            "1",
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--json",
            f"{out}.json",
            "--markdown",
            f"{out}.md",
            "--plot",
            f"{out}.png",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens/s" in proc.stdout and "largest per-step loss diff" in proc.stdout
    # the progress bar: each run's steps against --steps, the total labelled as the sum over runs
    assert (
        "(reference, repetition 1/1), step 2/2" in proc.stderr
        and "(fasttrain, repetition 1/1)" in proc.stderr
    )
    assert "4/4 steps of all runs" in proc.stderr
    data = json.loads(out.with_suffix(".json").read_text())
    for side in ("reference", "fasttrain"):
        assert {"tokens_per_s", "peak_memory_mb", "losses"} <= data[side].keys()
        assert len(data[side]["losses"]) == 2 and data[side]["tokens_per_s"] > 0
    assert data["fasttrain"]["runs"][0]["fasttrain_disable"] is None
    assert data["fasttrain"]["trainer_class"] == "fasttrain.trainer.Trainer"
    # same weights, same first batch: the first loss agrees to fp32 rounding whichever loss path runs
    assert data["fasttrain"]["losses"][0] == pytest.approx(data["reference"]["losses"][0], rel=1e-4)
    # where it came from: the command as retyped, the commit it ran at
    assert data["provenance"]["command"].startswith("fasttrain bench --device cpu --model tiny")
    assert data["provenance"]["commit"] == provenance.git_commit()
    assert "| tokens/s (higher is better) |" in out.with_suffix(".md").read_text()
    assert "model tiny (hidden 32, 1 layer, vocab 151,936" in proc.stdout
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_local_checkpoint_directory(tmp_path):
    """--model PATH loads with local_files_only; a bare checkpoint falls back to the built-in tokenizer."""
    from fasttrain.bench import models

    checkpoint = tmp_path / "ckpt"
    models.build_model("tiny", 32, 0, "cpu", torch.float32).save_pretrained(checkpoint)
    r = worker.run(
        _tiny.bench_config(model=str(checkpoint), steps=1, warmup_steps=0),
        Contender("reference", "reference"),
    )
    assert r["steps"] == 1 and r["losses"][0] == pytest.approx(11.93, abs=0.3)


def test_train_flops_per_token_counts_parameters_and_causal_attention():
    class Model:
        config = types.SimpleNamespace(num_attention_heads=2, head_dim=4, hidden_size=16, num_hidden_layers=2)

        def num_parameters(self):
            return 100

    # 6 x 100 parameters; attention: 6 x 2 layers x width 8 x (2*2 + 4*4) / (2 + 4) tokens = 320
    assert worker.train_flops_per_token(Model(), [[0, 0], [0, 0, 0, 0]]) == 600 + 320
    Model.config.head_dim = None  # no head_dim in the config: hidden_size / heads
    assert worker.train_flops_per_token(Model(), [[0, 0], [0, 0, 0, 0]]) == 600 + 6 * 2 * 16 * 20 / 6


def test_worker_reports_the_training_flops_of_a_token(reference_result):
    assert reference_result["train_flops_per_token"] > 6 * 100_000  # the tiny model has well over 1e5 weights


def test_tokens_counted_are_the_real_tokens_of_the_examples(reference_result):
    # one epoch over exactly steps x batch examples: the real tokens counted at the model's input are their total
    r = reference_result
    assert r["tokens_expected"] is not None
    assert sum(r["tokens_per_step"]) == r["tokens_expected"]
    config = _tiny.bench_config()
    with pytest.raises(
        worker.TokenCountError, match="bench counted 11 input tokens over the run, but its examples hold 12"
    ):
        worker._check_token_count(config, [[1] * 2] * 6, [4, 8, 11])
    assert worker._check_token_count(config, [[1] * 2] * 6, [4, 8, 12]) == 12
    # the data ran short: two epochs of three examples
    assert worker._check_token_count(config, [[1] * 2] * 3, [4, 8, 12]) == 12
    assert worker._check_token_count(_tiny.bench_config(trainer_type="dpo"), [[1]] * 6, [1, 2, 3]) is None


def test_lognormal_lengths_count_the_same_tokens_padded_and_packed():
    config = _tiny.bench_config(lengths="lognormal", seq_len=512, group_by_length=False, steps=2)
    padded = worker.run(config, Contender("reference", "reference"))
    packed = worker.run(config, Contender("fasttrain", "fasttrain"))
    assert packed["hot_paths"]["packing"] == "on"
    assert packed["tokens_per_step"] == padded["tokens_per_step"]
    assert sum(packed["tokens_per_step"]) == packed["tokens_expected"] == padded["tokens_expected"]
    assert len(set(packed["tokens_per_step"])) > 1 or min(packed["tokens_per_step"]) < 2 * 512  # lengths vary


def test_real_tokens_are_counted_alike_for_padded_and_packed_batches():
    class Echo(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None):
            return input_ids

    model = Echo()
    counter = worker.RealTokenCounter(model, pad_token_id=0)
    padded = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    model(input_ids=padded, attention_mask=(padded != 0).long())
    assert counter.total() == 5
    packed = torch.tensor([[5, 6, 7, 8, 9]])  # the same examples in one row: no attention_mask
    model(input_ids=packed, position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
    assert counter.total() == 10
    model(packed)  # positional input_ids
    assert counter.total() == 15
    model.eval()
    model(input_ids=packed)  # evaluation forwards are not training tokens
    assert counter.total() == 15
    counter.remove()
    model.train()
    model(input_ids=packed)
    assert counter.total() == 15


def test_a_built_in_model_in_bf16_is_the_fp32_init_rounded():
    """Built directly in bf16 (a 4B shape built in fp32 first would need twice its bf16 memory), with the weights an
    fp32 init cast to bf16 gives: every bf16 contender starts from the fp32 contenders' weights, rounded."""
    from fasttrain.bench import models

    fp32 = models.build_model("tiny", 32, 0, "cpu", torch.float32)
    bf16 = models.build_model("tiny", 32, 0, "cpu", torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    for (name, a), b in zip(fp32.state_dict().items(), bf16.state_dict().values(), strict=True):
        assert torch.equal(a.to(torch.bfloat16), b), name
