"""The README's usage example runs as written and prints what the README says it prints; every figure the README
and docs/measured.md cite comes with a command that reproduces the file it cites.

The usage block is taken from README.md as it stands and run in a fresh process. The only change: the two
``from_pretrained`` downloads are answered locally (no hub here) by a byte-level tokenizer and a Qwen3 with the
real vocabulary size and small layers, so the example's data, arguments, collator, packing decisions and status
are those of the README.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fasttrain import cli
from fasttrain.bench.config import BenchConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CITING = (README, ROOT / "docs" / "measured.md")
# "[name.md](…benchmarks/results/[dir/]name.md) · `command`": a result file and the command cited beside it (a
# folder's README.md describes a run of several commands, not one file)
CITATION = re.compile(
    r"\]\((?:\.\./)?(benchmarks/results/(?:[\w.-]+/)?(?!README\.)[\w.-]+)\.md\) ·\s`([^`]+)`"
)

OFFLINE = """
import tokenizers, torch, transformers

def _tokenizer(*args, **kwargs):
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"<|endoftext|>": len(alphabet)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                                eos_token="<|endoftext|>")

def _model(*args, dtype=None, **kwargs):
    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)

transformers.AutoTokenizer.from_pretrained = _tokenizer
transformers.AutoModelForCausalLM.from_pretrained = _model
"""


def _usage_block() -> tuple[str, str]:
    text = README.read_text()
    usage = text[text.index("## Usage") :]
    code = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
    printed = re.search(r"^# (\{.*\})$", code, re.M).group(1)
    return code, printed


def test_the_usage_example_prints_what_the_readme_shows(tmp_path):
    code, printed = _usage_block()
    assert 'from_pretrained("Qwen/Qwen3-0.6B"' in code and "fasttrain.Trainer(" in code
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE + code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == printed


def _citations() -> list[tuple[str, str]]:
    found = [(stem, command) for doc in CITING for stem, command in CITATION.findall(doc.read_text())]
    assert any(cmd.startswith("fasttrain bench") for _, cmd in found), (
        "the citation pattern no longer matches"
    )
    return sorted(set(found))


def _recorded_command(result: dict) -> str:
    """The command a result file says wrote it (older files keep it beside their environment)."""
    for holder in (result.get("provenance"), result, result.get("environment"), result.get("meta")):
        if isinstance(holder, dict) and "command" in holder:
            return holder["command"]
    raise AssertionError("the result file records no command")


def _bench_settings(command: str, device: str, monkeypatch) -> tuple[dict, set[str], int]:
    """What `fasttrain bench` would run for ``command`` today: its settings, contenders and repetitions."""
    monkeypatch.setattr(cli, "_cuda_available", lambda: True)  # a cited GPU run resolves on a CPU machine too
    argv = shlex.split(command)[1:]
    if "--device" not in argv:
        argv += ["--device", device]  # "auto" would follow this machine, not the run's
    args = cli.build_parser().parse_args(argv)
    args.json = args.markdown = args.plot = args.profile = None  # where it writes is not a setting
    config, contenders, repeats = cli.resolve(args)
    return config.to_json(), {c.name for c in contenders}, repeats


@pytest.mark.parametrize(("stem", "command"), _citations(), ids=lambda value: str(value)[-60:])
def test_each_cited_command_reproduces_its_file(stem, command, monkeypatch):
    result = json.loads((ROOT / f"{stem}.json").read_text())
    if not command.startswith("fasttrain bench"):
        # a benchmark script: the arguments its file recorded (the interpreter may be another environment's)
        # (a script, or `python -m fasttrain.bench.<module>`: from the module on)
        script = next(word for word in shlex.split(command) if word.endswith(".py") or word == "-m")
        recorded = shlex.split(_recorded_command(result))
        cited = shlex.split(command)
        assert cited[cited.index(script) :] == recorded[recorded.index(script) :]
        return
    # through today's settings type: a field the file predates took its present default then, and a field today's
    # settings leave out for this kind of run is left out of both
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    recorded = BenchConfig(**{k: v for k, v in result["config"].items() if k in fields}).to_json()
    settings, contenders, repeats = _bench_settings(command, recorded["device"], monkeypatch)
    frontier = "probes" in result  # fasttrain bench --frontier: the budget is set apart from the settings
    if frontier:
        from fasttrain.bench.frontier import parse_size

        argv = [*shlex.split(command)[1:], "--device", recorded["device"]]
        today = cli.settings(cli.build_parser().parse_args(argv))
        budget = today.get("memory_budget")
        assert budget is not None and parse_size(budget) == recorded["memory_budget"], (
            f"{command!r} today runs another memory budget than {stem}.json recorded"
        )
    differ = {
        key: (value, settings.get(key))
        for key, value in recorded.items()
        # threads: the machine's cores; the frontier's budget: checked above
        if key != "threads" and not (frontier and key == "memory_budget") and settings.get(key) != value
    }
    assert not differ, (
        f"{command!r} today runs other settings than {stem}.json recorded (recorded, now): {differ}"
    )
    if frontier:
        assert contenders == set(result["probes"]) and result["max_length"] == today.get("max_length")
        return
    ran = {"reference", "fasttrain", *result.get("ablations", {})} | (
        {"liger"} if "liger" in result else set()
    )
    assert contenders == ran
    assert repeats == result["reference"]["repetitions"]
