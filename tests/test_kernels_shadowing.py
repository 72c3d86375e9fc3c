"""The repository's top-level ``kernels/`` folder does not shadow the ``kernels`` package of the hub.

From the repository's root (on ``sys.path`` under ``python -m pytest`` or ``python -c``), ``import kernels`` must
find the installed ``kernels`` package when there is one (a stand-in is installed into a temporary folder here),
and without one nothing transformers or Liger-Kernel would take for it (transformers 5.25 requires the hub package,
so both cases are met: the installed one as the environment has it, or a stand-in). ``fasttrain.kernels`` still
imports.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    # the extra folder right after the root (sys.path[0] under -c), ahead of any installed package
    prelude = "import sys\n" + (f"sys.path.insert(1, {str(extra_path)!r})\n" if extra_path else "")
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


def _kernels_away_from_the_root() -> str:
    """Where ``import kernels`` resolves with the repository's root off the path: the installed package's file,
    or '' when none is installed."""
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else '')"
    done = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_from_the_root_kernels_is_what_it_is_elsewhere():
    installed = _kernels_away_from_the_root()
    if installed:  # the hub's package, as installed: found, not the repository's folder
        done = _run("import kernels\nfrom kernels import get_kernel\nprint(kernels.__file__)")
        assert done.returncode == 0 and done.stdout.strip() == installed, done.stderr
    else:  # none installed: nothing passes for it (how Liger-Kernel's integration imports it)
        done = _run("from kernels import get_kernel")
        assert done.returncode == 1 and "ImportError" in done.stderr
        done = _run("from transformers.utils import is_kernels_available\nprint(is_kernels_available())")
        assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    assert not installed.startswith(str(ROOT / "kernels"))
    done = _run("import fasttrain.kernels.adamw, fasttrain.kernels.lm_head")
    assert done.returncode == 0, done.stderr
