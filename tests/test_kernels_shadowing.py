"""The repository's top-level ``kernels/`` folder does not shadow the ``kernels`` package of the hub.

From the repository's root (on ``sys.path`` under ``python -m pytest`` or ``python -c``), ``import kernels`` must
find the installed ``kernels`` package when there is one (a stand-in is installed into a temporary folder here),
and without one nothing transformers or Liger-Kernel would take for it. ``fasttrain.kernels`` still imports.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    prelude = "import sys\n" + (f"sys.path.append({str(extra_path)!r})\n" if extra_path else "")
    return subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_root_is_on_the_path_in_these_runs():
    assert _run("import os; assert os.getcwd() in map(os.path.abspath, sys.path)").returncode == 0


def test_from_the_root_an_installed_kernels_package_is_found(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("def get_kernel(name):\n    return 'hub:' + name\n")
    done = _run("import kernels\nprint(kernels.get_kernel('x'), kernels.__file__)", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["hub:x", str(tmp_path / "kernels" / "__init__.py")]


def test_without_one_nothing_passes_for_it():
    done = _run("from kernels import get_kernel")  # how Liger-Kernel's integration imports it
    assert done.returncode == 1 and "ImportError" in done.stderr
    done = _run("from transformers.utils import is_kernels_available\nprint(is_kernels_available())")
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    done = _run("import fasttrain.kernels.adamw, fasttrain.kernels.lm_head")
    assert done.returncode == 0, done.stderr
