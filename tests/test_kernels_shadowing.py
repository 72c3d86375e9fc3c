"""Nothing in the repository shadows the Hugging Face hub's ``kernels`` package.

transformers (5.25 requires it) and Liger-Kernel import a top-level ``kernels``. fasttrain's Triton kernels are
``fasttrain.kernels``, a plain subpackage; from the repository's root (on ``sys.path`` under ``python -m pytest``
or ``python -c``) ``import kernels`` must resolve exactly as it does anywhere else.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIND = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else '')"


def _origin_from(cwd: Path | str) -> str:
    done = subprocess.run([sys.executable, "-c", FIND], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_no_top_level_kernels_in_the_repository():
    assert not (ROOT / "kernels").exists()
    assert not (ROOT / "python" / "kernels").exists()


def test_kernels_resolves_from_the_root_as_it_does_elsewhere():
    elsewhere = _origin_from("/")
    assert _origin_from(ROOT) == elsewhere
    # the hub's package as installed (perhaps in the repository's .venv), or none: never a source folder of ours
    assert not any(elsewhere.startswith(str(ROOT / d)) for d in ("kernels", "python", "tests", "benchmarks"))


def test_fasttrain_kernels_is_a_regular_subpackage():
    import fasttrain.kernels
    import fasttrain.kernels.adamw
    import fasttrain.kernels.lm_head

    assert Path(fasttrain.kernels.__file__).parent == ROOT / "python" / "fasttrain" / "kernels"
