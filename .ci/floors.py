"""The declared dependency floors of pyproject.toml, for CI's floor environments (.ci/env floor, floor-trl).

    python .ci/floors.py dev --without trl         the dev extra's requirements, one a line, less the named ones
    python .ci/floors.py check [--raised-by trl]   print each runtime dependency's installed version beside its
                                                   declared floor (`name>=X`); exit 1 unless every one is X

`check` runs in the environment it checks. With --raised-by PKG a dependency may lie above its floor only where
PKG's own requirement on it excludes the floor (TRL needs a newer accelerate, datasets and pyarrow than
fasttrain does): it must then be the lowest release PKG admits, which the lowest-direct resolution picks.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _project() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def floor_of(requirement: Requirement) -> Version | None:
    """X of the requirement's `>=X` (None when it has none)."""
    floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    return max(floors) if floors else None


def _runtime() -> list[Requirement]:
    """The runtime dependencies that apply on this machine (markers evaluated)."""
    requirements = [Requirement(line) for line in _project()["dependencies"]]
    return [r for r in requirements if r.marker is None or r.marker.evaluate()]


def dev(without: list[str]) -> int:
    skipped = {name.lower() for name in without}
    for line in _project()["optional-dependencies"]["dev"]:
        if Requirement(line).name.lower() not in skipped:
            print(line)
    return 0


def _requirement_of(package: str, name: str) -> Requirement | None:
    for line in metadata.requires(package) or []:
        requirement = Requirement(line)
        if requirement.name.lower() == name.lower() and (
            requirement.marker is None or requirement.marker.evaluate({"extra": ""})
        ):
            return requirement
    return None


def check(raised_by: str | None) -> int:
    where = f"{sys.executable} (Python {sys.version.split()[0]})"
    print(f"[floors] declared floors (pyproject.toml) against what {where} has:", file=sys.stderr)
    failures = 0
    for requirement in _runtime():
        floor = floor_of(requirement)
        if floor is None:
            print(f"    {requirement.name}: no `>=` floor declared", file=sys.stderr)
            failures += 1
            continue
        installed = Version(metadata.version(requirement.name))
        verdict = "ok"
        if Version(installed.public) != floor:
            theirs = _requirement_of(raised_by, requirement.name) if raised_by else None
            if theirs is not None and not theirs.specifier.contains(floor, prereleases=True):
                # lowest-direct resolution: the lowest release both admit
                lowest = floor_of(theirs)
                if lowest is not None and Version(installed.public) == lowest:
                    verdict = f"raised by {raised_by} {metadata.version(raised_by)} ({theirs})"
                else:
                    verdict = f"FAILED: {raised_by} needs {theirs}, so expected {lowest}"
            else:
                verdict = "FAILED: not the declared floor"
        failures += verdict.startswith("FAILED")
        print(f"    {requirement.name:<13} {installed!s:<14} declared >={floor!s:<8} {verdict}", file=sys.stderr)
    if failures:
        print(f"[floors] {failures} dependencies are not at their declared floor", file=sys.stderr)
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    dev_parser = commands.add_parser("dev")
    dev_parser.add_argument("--without", action="append", default=[])
    check_parser = commands.add_parser("check")
    check_parser.add_argument("--raised-by")
    args = parser.parse_args()
    if args.command == "dev":
        return dev(args.without)
    return check(args.raised_by)


if __name__ == "__main__":
    sys.exit(main())
