"""The suite's layout, which CI's stages rely on.

Stages pick their tests by pytest marker (.ci/suites), not by lists of files, so a file without a stage marker runs
in the main stage only: every test file carries one, or is named in MAIN_ONLY with the reason. A test module imports
shared code from helper modules (tests/_*.py), never from another test module: importing one runs its module-level
code, and with it its marks and fixtures, in a file that never asked for them.
"""

from __future__ import annotations

import ast
import pathlib
import re

TESTS = pathlib.Path(__file__).parent
ROOT = TESTS.parent
# the markers a CI stage selects by: .ci/suites (isa, gpu-tests, floor), benchmarks/gpu/run.sh (cuda), .ci/clients
STAGE_MARKERS = {"numeric", "dropin", "gpu_versions", "cuda", "client"}

MAIN_ONLY = {
    "tooling, not the training path: the bench and its reports, the CLI, the GPU script's options, the examples, "
    "the README, the packaging and the suite's own layout": (
        "test_architecture.py",
        "test_bench_convergence.py",
        "test_bench_data.py",
        "test_bench_frontier.py",
        "test_bench_limit.py",
        "test_bench_optimizer_memory.py",
        "test_bench_profile.py",
        "test_bench_report.py",
        "test_bench_roofline.py",
        "test_bench_scripts.py",
        "test_bench_trl.py",
        "test_bench_worker.py",
        "test_cli.py",
        "test_examples.py",
        "test_gpu_run_options.py",
        "test_kernels_shadowing.py",
        "test_native_stub.py",
        "test_readme.py",
        "test_suite_layout.py",
        "test_version.py",
        "test_wheel.py",
    ),
    "integer batching held equal to transformers' classes or a plain-Python reference (nothing to round "
    "differently on another CPU); the Trainer tests of the drop-in stages run the collators and samplers too": (
        "test_collators.py",
        "test_collators_errors.py",
        "test_collators_probe.py",
        "test_collators_settings.py",
        "test_collators_trl.py",
        "test_collators_workers.py",
        "test_labels.py",
        "test_sampler.py",
        "test_sampler_budget.py",
        "test_sampler_lengths.py",
    ),
    "several processes on gloo: too slow to repeat; DeepSpeed and the FSDP2 Trainer run in .ci/scale": (
        "test_deepspeed.py",
        "test_distributed.py",
        "test_fsdp_trainer.py",
        "test_model_patch_fsdp.py",
        "test_optim_fsdp.py",
        "test_optim_fsdp_8bit.py",
        "test_optim_fsdp_sr.py",
        "test_optim_in_backward_ddp.py",
    ),
    "compilers at the latest versions only: every kernel for sm_90 (the gpu-smoke stage compiles them with the GPU "
    "machine's Triton), flex attention through inductor, Liger's kernels": (
        "test_kernels_compile.py",
        "test_liger_compose.py",
        "test_packing_flex.py",
    ),
    "the status line and hook, and evaluation with the fused loss: the drop-in stages' Trainer tests check the "
    "status and the loss at their versions": (
        "test_model_patch_eval.py",
        "test_status_hook.py",
        "test_status_line.py",
    ),
}


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _marks(tree: ast.Module) -> set[str]:
    """Every ``pytest.mark.NAME`` the module uses: its pytestmark and its tests' decorators."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "pytest"
    }


def _imported(nodes) -> set[str]:
    """The top-level package of every absolute import, and of every ``pytest.importorskip``, among ``nodes``."""
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(node.args[0].value)
    return {name.split(".")[0] for name in names}


def _module_level(tree: ast.Module):
    """The module's own statements and the expressions in them, not what its functions do when called."""
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield from ast.walk(statement)


def _test_files() -> list[pathlib.Path]:
    return sorted(TESTS.glob("test_*.py"))


def test_no_module_imports_a_test_module():
    offenders = [
        f"{path.name} imports {name}"
        for path in sorted(TESTS.glob("*.py"))
        for name in sorted(_imported(ast.walk(_tree(path))))
        if name.startswith("test_")
    ]
    assert not offenders, "move what they share into a tests/_*.py helper:\n" + "\n".join(offenders)


def test_every_test_file_has_a_stage_or_says_why_not():
    listed = [name for names in MAIN_ONLY.values() for name in names]
    assert len(listed) == len(set(listed)), "a file is named twice in MAIN_ONLY"
    staged = {path.name for path in _test_files() if _marks(_tree(path)) & STAGE_MARKERS}
    unstaged = {path.name for path in _test_files()} - staged
    assert not unstaged - set(listed), (
        f"no stage marker ({', '.join(sorted(STAGE_MARKERS))}) and not in MAIN_ONLY: "
        f"{sorted(unstaged - set(listed))}"
    )
    assert not set(listed) - unstaged, f"in MAIN_ONLY but staged or gone: {sorted(set(listed) - unstaged)}"


def test_trl_marks_exactly_the_files_that_import_trl():
    # the floor stage runs `trl`-marked tests in floor-trl, the rest in an environment without TRL
    importing = {path.name for path in _test_files() if "trl" in _imported(_module_level(_tree(path)))}
    marked = {path.name for path in _test_files() if "trl" in _marks(_tree(path))}
    assert importing == marked, (
        f"import TRL, not marked `trl`: {sorted(importing - marked)}; marked, not importing it: "
        f"{sorted(marked - importing)}"
    )


def test_every_stage_selects_by_registered_markers(pytestconfig):
    # a misspelt marker in a -m expression is no error (--strict-markers checks marks only): it selects nothing,
    # or, after a `not`, everything
    registered = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert STAGE_MARKERS | {"trl", "slow"} <= registered
    selections = dict(re.findall(r'^(\w+_TESTS)="([^"]*)"', (ROOT / ".ci/suites").read_text(), re.M))
    assert selections, ".ci/suites defines no selection"
    for name, expression in selections.items():
        words = set(re.findall(r"\w+", expression)) - {"and", "or", "not"}
        assert words <= registered, f"{name} names an unregistered marker: {sorted(words - registered)}"
        # .ci/suites' marked_files imports only the files that set an expression's first marker
        assert expression.split()[0] in STAGE_MARKERS, f"{name} does not start with its stage's marker"
