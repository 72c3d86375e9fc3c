"""The scripts under benchmarks/: they stand on their own module (benchmarks/_common.py) and fasttrain's public
or data-path modules; of the ``fasttrain bench`` command's package only on the modules every result shares
(provenance, roofline), never on its internals or on the tests' helpers."""

from __future__ import annotations

import argparse
import ast
import gc
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("bench_*.py"))
# what every result file stands on, and the corpus every text benchmark reads (one copy of its order)
SHARED = {"fasttrain.bench.provenance", "fasttrain.bench.roofline", "fasttrain.bench.corpus"}

_spec = importlib.util.spec_from_file_location("_common", BENCHMARKS / "_common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


@pytest.mark.parametrize(
    "path", sorted(BENCHMARKS.rglob("*.py")), ids=lambda p: str(p.relative_to(BENCHMARKS))
)
def test_no_script_imports_the_bench_command_s_internals(path):
    modules = _imported_modules(path)
    internals = [m for m in modules if m.startswith("fasttrain.bench.") and m not in SHARED]
    assert not internals, f"{path} imports {internals}"
    assert "_tiny" not in modules, f"{path} imports the tests' helpers"


def test_the_scripts_are_there():
    assert len(SCRIPTS) >= 8 and (BENCHMARKS / "_common.py").is_file()


# Every script's --help in one interpreter (torch imported once, not once per script): it imports the script's
# module-level dependencies, so a module that moved or went away fails here, with the script's name.
_RUN_HELP = """
import runpy, sys
sys.path.insert(0, sys.argv[1])  # what `python benchmarks/x.py` puts first: `import _common` resolves
for path in sys.argv[2:]:
    sys.argv = [path, "--help"]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise SystemExit(f"{path} --help exited with {stop.code}")
    print("HELP OK", path, flush=True)
"""


def test_each_script_starts():
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_HELP, str(BENCHMARKS), *map(str, SCRIPTS)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCHMARKS.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("HELP OK") == len(SCRIPTS)


def test_write_opens_both_files_with_the_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "bench_sampler.py"), "--out", "/tmp/x y"])
    result = {**common.new_result("demo", "pytest"), "figure": 1.5}
    text = common.write(tmp_path / "out", "demo", result, "A title", ["| a |", "| 1.5 |"])
    saved = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert saved["benchmark"] == "demo" and saved["figure"] == 1.5
    prov = saved["provenance"]
    assert prov["command"] == "python benchmarks/bench_sampler.py --out '/tmp/x y'"
    assert prov["versions"]["pytest"] == pytest.__version__ and "commit" in prov
    assert (tmp_path / "out" / "demo.md").read_text() == text
    assert text.startswith("# A title\n\n- measured ") and text.endswith("| a |\n| 1.5 |\n")


def test_alternate_calls_each_contender_in_turn_with_the_collector_off():
    calls = []
    contenders = {name: (lambda i, name=name: calls.append((name, i, gc.isenabled()))) for name in "ab"}
    times = common.alternate(3, contenders)
    assert calls == [(name, i, False) for i in range(3) for name in "ab"] and gc.isenabled()
    assert [len(t) for t in times.values()] == [3, 3] and all(wall >= 0 for wall, _ in times["a"])


def test_int_options_forward_the_same_values():
    parser = argparse.ArgumentParser()
    names = common.int_options(parser, seq_len=64, steps=1)
    args = parser.parse_args(["--seq-len", "8"])
    assert common.forwarded(args, names) == ["--seq-len", "8", "--steps", "1"]
    assert parser.parse_args(common.forwarded(args, names)) == args


def test_batch_difference_names_what_differs():
    import torch

    batch = {"input_ids": torch.tensor([[1, 2]]), "lengths": [2]}
    assert common.batch_difference(batch, dict(batch)) is None
    assert common.batch_difference(batch, {**batch, "lengths": [3]}) == "lengths: values differ"
    assert "torch.int32" in common.batch_difference(batch, {**batch, "input_ids": batch["input_ids"].int()})
    assert common.batch_difference(batch, {"input_ids": batch["input_ids"]}) is not None


def test_word_level_tokenizer_pads_with_id_0():
    tok = common.word_level_tokenizer(16)
    assert tok.pad_token_id == 0 and len(tok) == 16
    assert tok("t3 t5")["input_ids"] == [3, 5]


def test_the_head_case_times_the_same_loss_and_its_three_gemms():
    """bench_loss.py --cases head: the reference and fasttrain steps compute the same loss; the GEMM floor runs."""
    import torch

    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("bench_loss", BENCHMARKS / "bench_loss.py")
        bench_loss = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench_loss)
        losses = {}
        for impl in bench_loss.IMPLS["head"]:
            torch.manual_seed(0)
            losses[impl] = bench_loss._head_step(impl, tokens=3, width=8)()
            gc.collect()
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert losses["fasttrain"] == pytest.approx(losses["reference"], rel=1e-5)
    assert abs(losses["gemms"]) < 1.0  # a logit of 8 small weights and two tiny gradients
