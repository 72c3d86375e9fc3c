"""Aggregation and reporting: medians, ratios, loss parity, the table, the JSON schema, the plot."""

from __future__ import annotations

import json
import math
import sys

import pytest

from _bench_helpers import CONFIG, full_data
from _bench_helpers import run_result as _run
from fasttrain.bench import report, runner, summary, worker
from fasttrain.bench.config import Contender


@pytest.fixture
def results():
    status = {
        "optimizer": "on",
        "clip": "on",
        "loss": "off: not a causal LM",
        "collator": "on",
        "sampler": "on",
    }
    return {
        "reference": [
            _run("reference", "reference", 100.0, 500.0, [4.0, 3.0, 2.0, 1.0]),
            _run("reference", "reference", 120.0, 520.0, [4.0, 3.0, 2.0, 1.0]),
        ],
        "fasttrain": [
            _run("fasttrain", "fasttrain", 150.0, 240.0, [4.0, 3.0, 2.2, 1.0], status),
            _run("fasttrain", "fasttrain", 130.0, 260.0, [4.0, 3.0, 2.2, 1.1], status),
        ],
    }


def test_loss_difference_absolute_and_relative():
    d = summary.loss_difference([2.0, 4.0, None], [2.5, 3.0, 1.0])
    assert d == {"max_abs": 1.0, "max_rel": 0.25, "steps_compared": 2}
    assert summary.loss_difference([None], [1.0])["max_abs"] is None


def test_build_medians_ratios_and_parity(results):
    data = summary.build(results)
    ref, fast = data["reference"], data["fasttrain"]
    assert ref["tokens_per_s"] == 110.0 and fast["tokens_per_s"] == 140.0  # medians of two repetitions
    assert fast["peak_memory_mb"] == 250.0
    vs = data["comparison"]["fasttrain_vs_reference"]
    assert vs["tokens_per_s_ratio"] == pytest.approx(140 / 110)
    assert vs["peak_memory_ratio"] == pytest.approx(250 / 510)
    assert vs["loss_difference"]["max_abs"] == pytest.approx(0.2)
    assert vs["loss_difference"]["max_rel"] == pytest.approx(0.1)
    assert ref["loss_difference_between_repetitions"] == 0.0
    assert fast["loss_difference_between_repetitions"] == pytest.approx(0.1)
    assert fast["losses"] == [4.0, 3.0, 2.2, 1.0] and fast["repetitions"] == 2


def test_ablations_are_grouped_and_compared(results):
    results["fasttrain-no-loss"] = [
        _run("fasttrain-no-loss", "fasttrain", 105.0, 480.0, [4.0, 3.0, 2.0, 1.0])
    ]
    data = summary.build(results)
    assert list(data["ablations"]) == ["fasttrain-no-loss"]
    assert data["comparison"]["fasttrain-no-loss_vs_reference"]["peak_memory_ratio"] == pytest.approx(
        480 / 510
    )


def _full(results) -> dict:
    return full_data(results)


def test_table_shows_every_row(results):
    text = report.text_table(CONFIG, _full(results))
    for label in (
        "tokens/s",
        "step time",
        "peak memory",
        "above setup",
        "final loss",
        "largest per-step loss diff",
        "hot paths, fasttrain: ",
    ):
        assert label in text
    assert "(1.27x)" in text  # 140 / 110 tokens/s
    assert "(0.49x)" in text  # 250 / 510 MB
    assert "optimizer, clip, collator, sampler on; off: loss (not a causal LM)" in text
    assert "the first step not timed (warm-up)" in text


def test_markdown_has_provenance(results):
    md = report.markdown(CONFIG, _full(results))
    assert "- command: `fasttrain bench --model tiny`" in md
    assert "- measured " in md and " at commit " in md and "- machine: " in md and "torch " in md
    assert "docs/method.md" in md  # how the figures are measured is written once, there
    assert "| tokens/s (higher is better) | 110.0 | 140.0 (1.27x) |" in md


def test_json_schema_and_nan_becomes_null(results, tmp_path):
    results["reference"][0]["tokens_per_s"] = math.nan
    data = _full(results)
    path = tmp_path / "out.json"
    report.write_json(str(path), data)
    loaded = json.loads(path.read_text())  # strict JSON: no NaN literal
    for side in ("reference", "fasttrain"):
        assert {"tokens_per_s", "peak_memory_mb", "losses"} <= loaded[side].keys()
        assert len(loaded[side]["losses"]) == CONFIG.steps
    assert loaded["reference"]["runs"][0]["tokens_per_s"] is None
    assert loaded["reference"]["tokens_per_s"] == 120.0  # the median skips the NaN repetition


def test_plot_writes_a_png(results, tmp_path):
    path = tmp_path / "bench.png"
    report.plot(str(path), CONFIG, _full(results))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(results, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(report.PlotUnavailable, match="needs matplotlib"):
        report.plot(str(tmp_path / "x.png"), CONFIG, _full(results))
    from fasttrain import cli

    assert cli.main(["bench", "--device", "cpu", "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_schedule_alternates_and_reverses_each_round():
    a, b, c = (
        Contender("reference", "reference"),
        Contender("fasttrain", "fasttrain"),
        Contender("x", "fasttrain", "loss"),
    )
    order = [(r, x.name) for r, x in runner.schedule([a, b, c], 3)]
    assert order == [
        (0, "reference"),
        (0, "fasttrain"),
        (0, "x"),
        (1, "x"),
        (1, "fasttrain"),
        (1, "reference"),
        (2, "reference"),
        (2, "fasttrain"),
        (2, "x"),
    ]


def test_child_env_passes_only_the_ablation_switch(monkeypatch):
    monkeypatch.setenv("FASTTRAIN_DISABLE", "optimizer")  # inherited: must not leak into the comparison
    assert "FASTTRAIN_DISABLE" not in runner._child_env(Contender("fasttrain", "fasttrain"))
    assert "FASTTRAIN_DISABLE" not in runner._child_env(Contender("reference", "reference"))
    env = runner._child_env(Contender("fasttrain-no-loss", "fasttrain", "loss"))
    assert env["FASTTRAIN_DISABLE"] == "loss"


def test_small_loss_differences_are_not_rounded_to_zero(results):
    # fp32 parity leaves differences of ~1e-6: the table must show them, not 0.00e+00
    results["fasttrain"][0]["losses"] = [4.0, 3.0 + 2.5e-6, 2.0, 1.0]
    results["fasttrain"][1]["losses"] = [4.0, 3.0 + 2.5e-6, 2.0, 1.0]
    text = report.text_table(CONFIG, _full(results))
    assert "2.50e-06 / 8.33e-07" in text


def test_every_logged_metric_is_compared(results):
    # runs from before metrics were recorded (loss and grad_norm only) and TRL runs with more keys mix
    for run in results["fasttrain"]:
        run["metrics"] = {
            "loss": run["losses"],
            "grad_norm": [1.0, 1.0, 1.0, 1.0],
            "rewards/margins": [0.0, 0.5, 0.5, 0.5],
        }
    results["reference"][0]["metrics"] = {
        "loss": [4.0, 3.0, 2.0, 1.0],
        "grad_norm": [1.0, 1.0, 1.0, 1.1],
        "rewards/margins": [0.0, 0.5, 0.4, 0.5],
    }
    data = _full(results)
    vs = data["comparison"]["fasttrain_vs_reference"]
    assert set(vs["metric_differences"]) == {"loss", "grad_norm", "rewards/margins"}
    assert vs["metric_differences"]["rewards/margins"]["max_abs"] == pytest.approx(0.1)
    assert vs["largest_metric_difference"]["metric"] == "rewards/margins"
    assert vs["largest_metric_difference"]["max_rel"] == pytest.approx(0.25)
    text = report.text_table(CONFIG, data)
    assert (
        "largest per-step metric diff vs reference (rel, metric)" in text
        and "2.50e-01 (rewards/margins)" in text
    )
    md = report.markdown(CONFIG, data)
    assert "| rewards/margins | 1.00e-01 / 2.50e-01 |" in md
    assert "| grad_norm | 1.00e-01 / 9.09e-02 |" in md


def test_metrics_fall_back_to_loss_and_grad_norm(results):
    data = summary.build(results)  # the fixture's runs carry no "metrics"
    assert set(data["comparison"]["fasttrain_vs_reference"]["metric_differences"]) == {"loss", "grad_norm"}


def test_step_metrics_leave_timings_out():
    logs = {
        "loss": 2.0,
        "grad_norm": 1.5,
        "learning_rate": 1e-3,
        "epoch": 0.5,
        "train_runtime": 3.0,
        "train_tokens_per_second": 9.0,
        "total_flos": 1e9,
        "rewards/chosen": -0.1,
        "note": "x",
        "flag": True,
    }
    assert worker.step_metrics(logs) == {
        "loss": 2.0,
        "grad_norm": 1.5,
        "learning_rate": 1e-3,
        "epoch": 0.5,
        "rewards/chosen": -0.1,
    }


LIGER_ERROR = "the liger run exited with code 1; last lines of its log:\nTraceback ...\nRuntimeError: no kernel for sm_90"


def test_a_failed_contender_is_in_the_table_with_its_error(results, tmp_path):
    data = full_data(results, {"liger": LIGER_ERROR})
    header, table = report.rows(data)
    assert header == ["", "reference", "liger", "fasttrain"]
    assert table[0] == ["tokens/s (higher is better)", "110.0", "failed", "140.0 (1.27x)"]
    error_row = table[-1]
    assert error_row[0] == "error" and error_row[1] == error_row[3] == "-"
    assert error_row[2].endswith("RuntimeError: no kernel for sm_90")
    assert "liger failed; its remaining repetitions were skipped" in report.text_table(CONFIG, data)
    assert "| error | - | the liger run exited with code 1" in report.markdown(CONFIG, data)
    report.write_json(str(tmp_path / "r.json"), data)
    assert json.loads((tmp_path / "r.json").read_text())["failed"] == {"liger": LIGER_ERROR}


def test_without_a_finished_reference_there_are_no_ratios(results):
    del results["reference"]
    data = full_data(results, {"reference": "the reference run exited with code 1"})
    assert data["comparison"] == {}
    text = report.text_table(CONFIG, data)
    assert "the reference failed: no ratios" in text
    header, table = report.rows(data)
    assert header == ["", "reference", "fasttrain"]
    assert table[0] == ["tokens/s (higher is better)", "failed", "140.0"]


def test_run_all_goes_on_after_a_crash_and_reports_every_run(monkeypatch):
    calls = []

    def fake_run_one(config, contender, workdir, tag, on_step):
        calls.append(contender.name)
        if contender.name == "liger":
            raise runner.RunFailed(LIGER_ERROR)
        on_step(config.steps)
        return _run(contender.name, contender.trainer, 100.0, 500.0, [4.0, 3.0, 2.0, 1.0])

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    seen = []
    contenders = [Contender(n, n) for n in ("reference", "liger", "fasttrain")]
    results, failures = runner.run_all(
        CONFIG, contenders, 2, progress=False, on_run=lambda r, f: seen.append((len(r["fasttrain"]), dict(f)))
    )
    assert calls == ["reference", "liger", "fasttrain", "fasttrain", "reference"]  # liger's 2nd skipped
    assert failures == {"liger": LIGER_ERROR}
    assert [len(results[n]) for n in ("reference", "liger", "fasttrain")] == [2, 0, 2]
    assert seen == [(0, {}), (0, failures), (1, failures), (2, failures), (2, failures)]


def test_a_data_error_still_ends_the_bench(monkeypatch):
    def fake_run_one(config, contender, workdir, tag, on_step):
        raise runner.BenchError("no 'text' column")

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    with pytest.raises(runner.BenchError):
        runner.run_all(CONFIG, [Contender("reference", "reference")], 2, progress=False)


def test_no_metric_is_named_when_nothing_differs():
    """With every per-step difference zero, the table names no metric (it used to name the first, `epoch`)."""
    from fasttrain.bench.summary import largest_metric_difference

    equal = {name: {"max_abs": 0.0, "max_rel": 0.0} for name in ("epoch", "grad_norm", "loss")}
    assert largest_metric_difference(equal) == {"metric": None, "max_abs": 0.0, "max_rel": 0.0}
    one_differs = {**equal, "loss": {"max_abs": 1e-7, "max_rel": 2e-7}}
    assert largest_metric_difference(one_differs)["metric"] == "loss"


def test_each_hot_path_share_is_fasttrain_with_it_against_without_it(results, tmp_path):
    results["fasttrain-no-packing"] = [
        _run("fasttrain-no-packing", "fasttrain", 70.0, 300.0, [4.0, 3.0, 2.2, 1.0]),
        _run("fasttrain-no-packing", "fasttrain", 90.0, 340.0, [4.0, 3.0, 2.2, 1.0]),
    ]
    results["fasttrain-no-all"] = [_run("fasttrain-no-all", "fasttrain", 110.0, 500.0, [4.0, 3.0, 2.0, 1.0])]
    results["fasttrain"][0]["tokens_per_cpu_s"] = results["fasttrain"][1]["tokens_per_cpu_s"] = 50.0
    results["fasttrain-no-packing"][0]["tokens_per_cpu_s"] = 20.0
    results["fasttrain-no-packing"][1]["tokens_per_cpu_s"] = 30.0
    data = _full(results)
    packing = data["shares"]["packing"]
    assert packing["speedup"] == pytest.approx(140 / 80)  # medians: fasttrain 140, without packing 80
    assert packing["tokens_per_cpu_s_speedup"] == pytest.approx(50 / 25)
    assert packing["peak_memory_ratio"] == pytest.approx(250 / 320)  # packed below padded: under 1
    assert data["shares"]["all"]["speedup"] == pytest.approx(140 / 110)
    assert math.isnan(data["shares"]["all"]["tokens_per_cpu_s_speedup"])  # not measured there
    text = report.text_table(CONFIG, data)
    assert "Each hot path's share" in text and "140.0 (1.75x)" in text and "250 (0.78x)" in text
    md = report.markdown(CONFIG, data)
    assert "## Each hot path's share" in md
    assert "| packing | 80.0 | 140.0 (1.75x) | 2.00x | 320 | 250 (0.78x) |" in md
    report.write_json(str(tmp_path / "r.json"), data)  # strict JSON: the unmeasured speed-up is null
    assert json.loads((tmp_path / "r.json").read_text())["shares"]["all"]["tokens_per_cpu_s_speedup"] is None


def test_no_share_table_without_ablations(results):
    data = _full(results)
    assert "shares" not in data
    assert "share" not in report.text_table(CONFIG, data)


def test_the_lengths_and_the_grouping_are_described(results):
    import dataclasses

    lognormal = dataclasses.replace(CONFIG, lengths="lognormal", seq_len=1024, group_by_length=False)
    text = report.text_table(lognormal, _full(results))
    assert "sequences: log-normal lengths (median 180, sigma 0.8, 16..1024 tokens)" in text
    assert "not grouped by length" in text
    natural = report.text_table(CONFIG, _full(results))
    assert "sequences up to 32 tokens (the data's natural lengths)" in natural
    assert ", grouped by length" in natural


# --- what a new user reads (issue 23): each of these failed on the old report ---


@pytest.mark.parametrize(
    ("status", "cell"),
    [
        ({"optimizer": "on", "sampler": "off: group_by_length is not set"},
         "optimizer on; off: sampler (group_by_length is not set)"),
        ({"loss": "off: switched off", "sampler": "off: group_by_length is not set"},
         "off: loss (switched off), sampler (group_by_length is not set)"),
        ({"optimizer": "on", "clip": "on"}, "optimizer, clip on"),
    ],
)  # fmt: skip
def test_an_off_hot_path_says_off_once(status, cell):
    text = report._hot_paths({"trainer": "fasttrain", "hot_paths": status})
    assert text == cell
    assert text.count("off:") <= 1 and "(off:" not in text


def test_every_ratio_row_says_which_way_is_better(results):
    # measured, so that its row has a ratio (an unmeasured value shows n/a alone)
    for runs in results.values():
        for run in runs:
            run["tokens_per_cpu_s"] = run["tokens_per_s"] / 2
    _, table = report.rows(_full(results))
    labels = {row[0].strip(): row for row in table}
    ratio_rows = [label for label, row in labels.items() if any(c.endswith("x)") for c in row[1:])]
    assert sorted(ratio_rows) == sorted(
        [
            "tokens/s (higher is better)",
            "step time, s (lower is better)",
            "tokens per CPU-second (higher is better)",
            "peak memory, MB (lower is better)",
            "of which above setup, MB (lower is better)",
        ]
    )
    assert "docs/method.md" in report.text_table(CONFIG, _full(results))  # where the ratios are explained


@pytest.mark.parametrize("model", ["tiny", "qwen3-cpu", "qwen3-0.6b", "qwen3-1.7b"])
def test_a_built_in_model_says_its_size(results, model):
    import dataclasses

    text = report.text_table(dataclasses.replace(CONFIG, model=model), _full(results))
    assert f"model {model} (hidden " in text and "vocab 151,936" in text
    assert " parameters, LM head " in text and "of the matmul FLOPs" in text
    if model == "tiny":
        assert (
            "model tiny (hidden 32, 1 layer, vocab 151,936, 4.9M parameters, LM head 99.8% of the matmul"
            in text
        )


def test_the_recorded_shape_of_any_model_is_described(results):
    import dataclasses

    for run in results["reference"]:
        run["model_shape"] = {"hidden_size": 64, "num_hidden_layers": 3, "vocab_size": 1000,
                              "parameters": 250_000, "lm_head_matmul_share": 0.25}  # fmt: skip
    text = report.text_table(dataclasses.replace(CONFIG, model="./ckpt"), _full(results))
    assert (
        "model ./ckpt (hidden 64, 3 layers, vocab 1,000, 0.2M parameters, LM head 25% of the matmul FLOPs)"
        in text
    )


def test_built_in_parameter_counts_match_the_models():
    import torch
    from transformers import Qwen3ForCausalLM

    from fasttrain.bench import models

    for name in models.BUILTIN_SHAPES:
        with torch.device("meta"):  # the size without the memory
            model = Qwen3ForCausalLM(models.builtin_config(name, 128))
        assert models.builtin_parameters(name) == model.num_parameters(), name
        assert models.model_summary(model) == models.builtin_summary(name), name


def test_one_step_is_singular_and_no_warm_up_is_a_warning(results):
    import dataclasses

    for runs in results.values():
        for run in runs:
            run["warmup_steps_excluded"] = 0
    del results["reference"][1], results["fasttrain"][1]
    one = dataclasses.replace(CONFIG, steps=1, warmup_steps=0)
    text = report.text_table(one, _full(results))
    assert "1 step x batch" in text and "1 steps" not in text
    assert "1 repetition per contender" in text and "repetition(s)" not in text
    assert "exclude the first 0" not in text
    assert "medians; every step timed" in text
    assert f"WARNING: {report.NO_WARMUP_NOTE}" in text
    assert "compilation" in report.NO_WARMUP_NOTE


def test_two_warm_up_steps_are_plural(results):
    for runs in results.values():
        for run in runs:
            run["warmup_steps_excluded"] = 2
    text = report.text_table(CONFIG, _full(results))
    assert "the first 2 steps not timed (warm-up)" in text and "WARNING" not in text


def test_the_progress_bar_counts_each_run_s_own_steps(monkeypatch, capsys):
    """`--steps 4` with two runs showed a bare 8/8: each run's step count is now said against --steps, and the
    total is labelled as the sum over runs."""

    def fake_run_one(config, contender, workdir, tag, on_step):
        for _ in range(config.steps):
            on_step(1)
        return _run(contender.name, contender.trainer, 100.0, 500.0, [4.0, 3.0, 2.0, 1.0])

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    runner.run_all(CONFIG, [Contender("reference", "reference"), Contender("fasttrain", "fasttrain")], 1)
    err = capsys.readouterr().err
    assert "run 2/2 (fasttrain, repetition 1/1), step 4/4" in err
    assert "8/8 steps of all runs" in err


def test_hot_path_statuses_go_under_the_table_not_into_it(results):
    """Six paths off with their reasons made one cell, and so the whole table, 300+ characters wide."""
    reasons = {name: f"off: a reason as long as the real ones are ({name})" for name in ("optimizer", "clip",
               "loss", "collator", "sampler", "packing")}  # fmt: skip
    for run in results["fasttrain"]:
        run["hot_paths"] = reasons
    text = report.text_table(CONFIG, _full(results))
    table = text.split("\n\n")[0]
    assert max(len(line) for line in table.splitlines()) <= 110
    assert "hot paths, fasttrain: off: optimizer (a reason as long as the real ones are (optimizer))" in text
    md = report.markdown(CONFIG, _full(results))
    assert "- hot paths, fasttrain: off: optimizer" in md and "| hot paths |" not in md


@pytest.mark.parametrize("seq_len", [64, 128, 512, 1024])
def test_the_lengths_description_states_the_median_the_lengths_have(results, seq_len):
    """A limit under the log-normal's median moves the median: `--seq-len 64` said "median 180, 16..64"."""
    import dataclasses
    import re
    import statistics

    from fasttrain.bench import data

    config = dataclasses.replace(CONFIG, lengths="lognormal", seq_len=seq_len)
    text = report.text_table(config, _full(results))
    stated = int(re.search(r"log-normal lengths \(median (\d+)", text).group(1))
    drawn = statistics.median(data.lognormal_lengths(20_001, seq_len, seed=0))
    assert abs(stated - drawn) <= 4, (stated, drawn)  # the sample median of 20,001 draws is within ~1.3 of it
    assert f"16..{seq_len} tokens" in text
