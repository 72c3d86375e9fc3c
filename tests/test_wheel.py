"""The built wheel, installed into a fresh virtual environment, carries every part of the package.

The Triton kernels (python/fasttrain/kernels) must be packed as fasttrain/kernels, not as a stray top-level
package; the FASTTRAIN_PATCH .pth and the Axolotl entry point must be packed too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _maturin() -> str:
    exe = shutil.which("maturin") or str(Path(sys.executable).with_name("maturin"))
    if not Path(exe).exists():
        pytest.fail("maturin is not installed; run .ci/setup")
    return exe


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    env = dict(os.environ, PYO3_PYTHON=sys.executable)
    # the dev profile keeps this quick; what is packed does not depend on the profile
    subprocess.run(
        [_maturin(), "build", "--profile", "dev", "--quiet", "-o", str(out)], cwd=ROOT, env=env, check=True
    )
    (whl,) = out.glob("fasttrain-*.whl")
    return whl


def test_wheel_contents(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    kernel_sources = {p.name for p in (ROOT / "python" / "fasttrain" / "kernels").glob("*.py")}
    for name in kernel_sources:
        assert f"fasttrain/kernels/{name}" in names, f"kernels/{name} missing from the wheel"
    assert not any(n.startswith("kernels/") for n in names), "a stray top-level kernels package was packed"
    assert "fasttrain/_native.pyi" in names
    assert "fasttrain/py.typed" in names
    assert any(n.startswith("fasttrain/_native") and n.endswith(".so") for n in names)
    assert "cp310-abi3" in wheel.name, "the wheel must be abi3 so one build serves Python 3.10+"
    assert "fasttrain-autopatch.pth" in names, "FASTTRAIN_PATCH=1 needs the .pth at the root of site-packages"
    entry_points = (
        zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    )
    assert (
        "[axolotl.plugins]" in entry_points
        and "fasttrain.integrations.axolotl:FasttrainPlugin" in entry_points
    )


def _fresh_venv_with(wheel: Path, tmp_path: Path) -> tuple[Path, str]:
    """A new virtual environment with the wheel unpacked into it: (its python, its site-packages)."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    target = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with zipfile.ZipFile(wheel) as zf:  # a wheel is installed by unpacking it into site-packages
        zf.extractall(target)
    # The heavy dependencies (torch, ...) come from the development environment. A path added by a .pth
    # file is not itself a site directory, so the editable install's own .pth there is not followed.
    (Path(target) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py, target


def test_wheel_imports_in_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    py, target = _fresh_venv_with(wheel, tmp_path)
    code = (
        "import fasttrain, fasttrain._native, fasttrain.kernels.adamw, sys\n"
        f"assert fasttrain.__file__.startswith({target!r}), fasttrain.__file__\n"
        f"assert fasttrain.kernels.__file__.startswith({target!r}), fasttrain.kernels.__file__\n"
        f"assert fasttrain.kernels.adamw.__file__.startswith({target!r}), fasttrain.kernels.adamw.__file__\n"
        "print(fasttrain._native.__version__)\n"
    )
    done = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == fasttrain_version()


def fasttrain_version() -> str:
    import fasttrain

    return fasttrain.__version__


@pytest.mark.parametrize("switch", ["1", "", "0"])
def test_fasttrain_patch_in_the_environment_patches_any_program(
    wheel: Path, tmp_path: Path, switch: str
) -> None:
    """The wheel's .pth: with FASTTRAIN_PATCH set, transformers' Trainer is patched as soon as it is imported (and
    nothing of fasttrain's patching nor torch is imported before that); unset or 0, nothing of fasttrain's is
    imported at all."""
    py, _ = _fresh_venv_with(wheel, tmp_path)
    on = (
        "import sys\n"
        "early = sorted(m for m in sys.modules if m.startswith(('fasttrain.patching', 'torch')))\n"
        "import transformers\n"
        "transformers.Trainer  # transformers imports its trainer module on this first access\n"
        "import fasttrain.patching as p\n"
        "print(early, p._original_init is not None)\n"
    )
    off = "import sys\nprint(sorted(m for m in sys.modules if m.startswith('fasttrain')))\n"
    env = {k: v for k, v in os.environ.items() if k != "FASTTRAIN_PATCH"}
    if switch:
        env["FASTTRAIN_PATCH"] = switch
    done = subprocess.run(
        [str(py), "-c", on if switch == "1" else off], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr
    # on: torch and the patch waited for transformers' Trainer; off: the .pth line imported nothing
    assert done.stdout.strip() == ("[] True" if switch == "1" else "[]"), done.stdout
