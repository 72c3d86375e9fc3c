"""One version everywhere: Cargo.toml is the source; the wheel's metadata, the module and fasttrain agree."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import fasttrain
import fasttrain._native

ROOT = Path(__file__).resolve().parents[1]


def _project_table(text: str) -> str:
    """The [project] table of pyproject.toml (up to the next table); tomllib is not in Python 3.10."""
    return text.split("[project]", 1)[1].split("\n[", 1)[0]


def test_pyproject_takes_its_version_from_cargo():
    project = _project_table((ROOT / "pyproject.toml").read_text())
    assert not re.search(r"^version\s*=", project, re.M), "a hand-kept version in pyproject.toml would drift"
    assert re.search(r'^dynamic\s*=\s*\[[^]]*"version"', project, re.M)


def test_every_version_is_cargos():
    cargo = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M).group(1)
    assert fasttrain._native.__version__ == cargo, "the built extension is stale: run .ci/setup"
    assert fasttrain.__version__ == cargo
    assert importlib.metadata.version("fasttrain") == cargo
