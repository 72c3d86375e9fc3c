"""fasttrain bench --profile: one step's time split into matmuls, LM head, attention, optimizer and the rest."""

from __future__ import annotations

import dataclasses
import json
import resource
import types

import pytest

import _tiny
from fasttrain import cli
from fasttrain.bench import profile, worker
from fasttrain.bench.config import FASTTRAIN, REFERENCE, Contender

VOCAB = 151_936


def _event(name, shapes=(), parent=None):
    return types.SimpleNamespace(name=name, input_shapes=list(shapes), cpu_parent=parent)


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        # the optimizer's scope wins over the vocabulary: the update of a tied [vocab, hidden] weight
        (_event("aten::mul_", [[VOCAB, 64]], _event("Optimizer.step#FusedAdamW.step")), "optimizer"),
        (_event("aten::_foreach_norm", [[64, 64]]), "optimizer"),  # the Trainer's gradient norm
        (_event("aten::bmm", [[2, 8, 8]], _event("aten::scaled_dot_product_attention")), "attention"),
        (_event("aten::mm", [[40, 64], [64, VOCAB]]), "LM head"),  # the projection
        (_event("aten::mm", [[VOCAB, 40], [40, 64]]), "LM head"),  # the weight's gradient
        (_event("aten::_log_softmax", [[1, 40, VOCAB]]), "LM head"),
        (
            _event("aten::embedding", [[VOCAB, 64], [1, 40]]),
            "elementwise and other ops",
        ),  # a lookup, no FLOPs
        (_event("aten::addmm", [[64], [40, 64], [64, 64]]), "matmuls"),
        (_event("aten::mul", [[40, 64], [40, 64]]), "elementwise and other ops"),
    ],
)
def test_each_operator_goes_to_the_first_category_it_matches(event, expected):
    assert profile.category(event, VOCAB) == expected


@pytest.fixture(scope="module", params=[REFERENCE, FASTTRAIN])
def profiled(request, tmp_path_factory):
    config = dataclasses.replace(_tiny.bench_config(), profile=True)
    progress = tmp_path_factory.mktemp("p") / "progress"
    return config, worker.run(config, Contender(request.param, request.param), str(progress))


def test_the_last_step_is_profiled_and_its_time_is_split_whole(profiled):
    config, result = profiled
    p = result["profile"]
    assert p["step"] == config.steps == result["steps"]
    assert p["tokens"] == result["tokens_per_step"][-1] > 0
    # every second of the step is in exactly one row: the categories and what no operator holds
    assert sum(p["seconds"].values()) == pytest.approx(p["step_s"], rel=1e-9)
    assert set(p["seconds"]) == {*profile.CATEGORIES, profile.OUTSIDE}
    # the tiny model has a 151,936-word head, GEMMs in its layer, attention, and an AdamW step
    for category in ("LM head", "matmuls", "attention", "optimizer"):
        assert p["seconds"][category] > 0, category
    # (which category takes longest is a measurement, not asserted here: under a loaded CI machine the tiny
    # layer's GEMMs outlasted the 151,936-word head once; the operators' attribution is the test above)
    assert p["user_cpu_s"] > 0
    # a training step touches fresh pages (activations, gradients): some faults, and fewer than the whole
    # process has taken so far (the run's setup faulted too), so the figure is the step's, not the process's
    assert 0 < p["minor_page_faults"] < resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_run_without_profile_has_none(tmp_path):
    result = worker.run(
        dataclasses.replace(_tiny.bench_config(), steps=1, warmup_steps=0),
        Contender(REFERENCE, REFERENCE),
        str(tmp_path / "progress"),
    )
    assert "profile" not in result


def test_the_profile_option_runs_one_more_run_per_contender_and_writes_the_table(
    tmp_path, monkeypatch, capsys
):
    from _bench_helpers import run_result as _run
    from fasttrain.bench import runner

    calls = []

    def fake_run_one(config, contender, workdir, tag, on_step):
        calls.append((contender.name, config.profile, config.steps))
        run = _run(contender.name, contender.trainer, 100.0, 500.0, [4.0, 3.0, 2.0, 1.0])
        if config.profile:
            seconds = dict.fromkeys(profile.CATEGORIES, 0.5)
            seconds[profile.OUTSIDE] = 0.5
            run["profile"] = {
                "step": config.steps, "step_s": 3.0, "tokens": 60, "seconds": seconds, "user_cpu_s": 5.0,
                "system_cpu_s": 0.75, "minor_page_faults": 1234,
            }  # fmt: skip
            run["train_flops_per_token"] = 1e9
        return run

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    monkeypatch.setattr(
        "fasttrain.bench.roofline.measure_matmul_rate",
        lambda device, threads: {"matmul_flops_per_s": 1e11, "measured": "fp32 GEMM"},
    )
    out = tmp_path / "profile.md"
    argv = [
        "bench", "--device", "cpu", "--model", "tiny", "--steps", "4", "--warmup-steps", "2", "--repeats", "1",
        "--no-progress", "--json", str(tmp_path / "r.json"), "--profile", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    # the timed runs first, then one profile run per contender: the warm-up steps and one more
    assert calls == [(REFERENCE, False, 4), (FASTTRAIN, False, 4), (REFERENCE, True, 3), (FASTTRAIN, True, 3)]
    text = out.read_text()
    assert "| one optimizer step | reference | fasttrain |" in text
    assert "| LM head | 0.50 s (17%) | 0.50 s (17%) |" in text
    # 1e9 FLOPs x 60 tokens at 1e11 FLOP/s: 0.6 s of a 3 s step
    assert (
        "| its matmul limit (model FLOPs at the measured GEMM rate) | 0.60 s (20%) | 0.60 s (20%) |" in text
    )
    assert "| minor page faults | 1,234 | 1,234 |" in text
    assert "--profile" in text  # the command that made it
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data["profile"]["profiles"]) == {REFERENCE, FASTTRAIN}
