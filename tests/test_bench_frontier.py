"""``fasttrain bench --frontier``: the search on a known frontier, the budget parsing, and the command end to end on
the tiny model, where the reference's logits pass a budget that fasttrain's chunked head stays under."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fasttrain.bench import frontier
from fasttrain.bench.frontier import Probe


def _known(limit: int, calls: list[int]):
    def run(length: int) -> Probe:
        calls.append(length)
        return Probe(length, length <= limit, peak_bytes=length)

    return run


@pytest.mark.parametrize("limit", [640, 1000, 4096, 5000, 30000])
def test_search_doubles_then_bisects_to_within_tolerance(limit):
    calls: list[int] = []
    probes = frontier.search(_known(limit, calls), 512, 65536)
    best = frontier.longest(probes)
    misses = [p.length for p in probes if not p.fits]
    assert best is not None and best.length <= limit
    assert min(m for m in misses if m > best.length) - best.length <= frontier.TOLERANCE * best.length
    assert all(length % frontier.ROUND == 0 for length in calls)
    assert len(calls) == len(set(calls)), "a length probed twice"
    doubling = [512 * 2**i for i in range(len(calls)) if 512 * 2**i <= limit * 2]
    assert calls[: len(doubling)] == doubling


def test_search_stops_at_the_cap_and_when_nothing_fits():
    calls: list[int] = []
    assert [p.length for p in frontier.search(_known(10**9, calls), 512, 4096)] == [512, 1024, 2048, 4096]
    assert [(p.length, p.fits) for p in frontier.search(_known(100, []), 512, 4096)] == [(512, False)]


def test_the_reference_runs_first_and_the_others_start_at_its_longest(monkeypatch):
    """A time cap may stop the search: the reference's search comes first whatever the order given, each other
    contender's first probe is at the reference's longest (the peak ratio the frontier is for), and no length
    runs twice (4,096 comes from the doubling as well as from that first probe)."""
    from fasttrain.bench.config import Contender

    limits, calls = {"reference": 4100, "fasttrain": 40000}, []

    def fake_probe(config, contender, length, budget, workdir):
        calls.append((contender.name, length))
        return Probe(length, length <= limits[contender.name], peak_bytes=length)

    monkeypatch.setattr(frontier, "probe", fake_probe)
    config = type("Config", (), {"seq_len": 512})()
    contenders = [Contender("fasttrain", "fasttrain"), Contender("reference", "reference")]
    found = frontier.run_frontier(config, contenders, 2**30, 65536, lambda found: None)
    assert list(found) == ["reference", "fasttrain"]
    assert calls[:5] == [("reference", n) for n in (512, 1024, 2048, 4096, 8192)]
    best = frontier.longest(found["reference"]).length
    assert best == 4096 and calls[calls.index(("fasttrain", 512)) - 1] == ("fasttrain", best)
    assert len(calls) == len(set(calls)) and [p.length for p in found["fasttrain"]].count(best) == 1
    assert frontier.longest(found["fasttrain"]).length == 38912


def test_parse_size():
    assert frontier.parse_size("20GiB") == 20 * 2**30
    assert frontier.parse_size("20G") == 20 * 2**30
    assert frontier.parse_size("1.5 GB") == 1_500_000_000
    assert frontier.parse_size("512MiB") == 512 * 2**20
    assert frontier.parse_size("1000") == 1000
    for bad in ("", "twenty", "20 parsecs", "-1G"):
        with pytest.raises(ValueError, match="not a size"):
            frontier.parse_size(bad)


def test_summary_ratios_at_the_references_longest():
    found = {
        "reference": [Probe(512, True, 4 * 2**30), Probe(1024, False, 9 * 2**30)],
        "fasttrain": [Probe(512, True, 2**30), Probe(8192, True, 3 * 2**30), Probe(16384, False)],
    }
    rows = frontier.summarize(found, 8 * 2**30)["contenders"]
    assert (
        rows["reference"]["longest_length"] == 512 and rows["reference"]["first_length_not_fitting"] == 1024
    )
    assert rows["fasttrain"]["length_ratio"] == 16.0
    assert rows["fasttrain"]["peak_ratio_at_reference_longest"] == 0.25


def test_frontier_options_without_frontier_are_refused(capsys):
    from fasttrain import cli

    assert cli.main(["bench", "--model", "tiny", "--memory-budget", "2GiB"]) == 2
    assert "only apply to --frontier" in capsys.readouterr().err
    assert cli.main(["bench", "--frontier", "--smoke", "--memory-budget", "lots"]) == 2
    assert "--memory-budget: 'lots' is not a size" in capsys.readouterr().err


def test_frontier_end_to_end_under_a_budget(tmp_path):
    """The tiny model keeps Qwen3's 151,936-token vocabulary: at 1,024 tokens the reference's fp32 logits and their
    gradient alone are ~1.2 GB, fasttrain's chunked head never holds them. Under a 2.2 GiB budget (the tiny runs'
    baseline is ~1.1 GiB resident) the parent must stop the reference before 1,024 tokens and let fasttrain reach
    it; a budget the parent did not watch, or a run whose peak went unread, would let both through or neither."""
    out = tmp_path / "frontier.json"
    command = [sys.executable, "-m", "fasttrain", "bench", "--frontier", "--smoke", "--max-length", "1024",
               "--memory-budget", "2.2GiB", "--json", str(out), "--no-progress"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["summary"]["contenders"]
    reference, fasttrain = data["probes"]["reference"], data["probes"]["fasttrain"]
    assert rows["fasttrain"]["longest_length"] == 1024
    assert rows["reference"]["longest_length"] is None or rows["reference"]["longest_length"] < 1024
    stopped = [p for p in reference if not p["fits"]]
    assert stopped and all("budget" in p["why"] for p in stopped)
    assert all(p["peak_bytes"] <= 2.2 * 2**30 for p in fasttrain if p["fits"])
    assert data["complete"] and data["provenance"]["command"].startswith("fasttrain bench --frontier")
    assert "longest length" in done.stdout


def test_model_frontier_runs_each_setting_and_reports_bytes_per_parameter(tmp_path):
    """The model-size frontier's runs on the tiny shape: the lean setting goes through the Trainer with the step
    inside backward (its status says so), the reference with its own AdamW, each under the parent's budget."""
    command = [sys.executable, "-m", "fasttrain.bench.model_frontier", "--shapes", "tiny", "--seq-len", "32",
               "--contenders", "reference-fp32,fasttrain-lean", "--memory-budget", "6GiB", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "model_frontier_cpu.json").read_text())
    rows = {r["contender"]: r for r in data["rows"]}
    assert set(rows) == {"reference-fp32", "fasttrain-lean"} and all(r["fits"] for r in rows.values())
    assert "stepping in backward" in rows["fasttrain-lean"]["optimizer"]
    assert rows["reference-fp32"]["optimizer"] is None  # the reference Trainer has no fasttrain status
    assert rows["reference-fp32"]["optimizer_class"] == "torch.optim.adamw.AdamW"
    assert rows["fasttrain-lean"]["optimizer_class"] == "fasttrain.optim.adamw.FusedAdamW"
    for r in rows.values():
        assert r["bytes_per_parameter"] == r["peak_bytes"] / r["parameters"] and len(r["losses"]) == 2
    assert data["provenance"]["command"].startswith("python -m fasttrain.bench.model_frontier")
    assert (tmp_path / "model_frontier_cpu.png").stat().st_size > 0


def test_a_contenders_optimizer_reaches_the_training_arguments():
    """The model-size frontier's reference with bitsandbytes' 8-bit AdamW trains with optim=adamw_bnb_8bit (the
    Trainer's name for it); a contender that names none keeps the Trainer's default."""
    from fasttrain.bench.config import BenchConfig, training_kwargs
    from fasttrain.bench.presets import MODEL_FRONTIER

    config = BenchConfig(model="tiny", dataset="default", device="cpu", steps=2, seq_len=32, batch_size=1,
                         grad_accum=1, bf16=True, seed=0, threads=1, learning_rate=1e-4, warmup_steps=0,
                         group_by_length=False)  # fmt: skip
    eight_bit = MODEL_FRONTIER["reference-bf16-8bit"][0]
    assert training_kwargs(config, eight_bit, "out", object)["optim"] == "adamw_bnb_8bit"
    assert "optim" not in training_kwargs(config, MODEL_FRONTIER["reference-bf16"][0], "out", object)


def test_model_frontier_says_which_package_a_contender_lacks(tmp_path, monkeypatch, capsys):
    from fasttrain.bench import model_frontier

    monkeypatch.setattr(model_frontier, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exit_:
        model_frontier.main(["--contenders", "reference-bf16,reference-bf16-8bit", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    said = capsys.readouterr().err
    assert "reference-bf16-8bit trains with adamw_bnb_8bit: pip install bitsandbytes" in said
    assert not list(tmp_path.iterdir())  # refused before any run or result file
