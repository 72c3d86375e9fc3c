"""What the memory frontiers and the convergence benchmark share: a figure, the peak-memory-under-a-budget
plot, a Markdown table, and (``python -m fasttrain.bench.convergence`` and ``.model_frontier``) a directory of
three result files."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import provenance, report
from .config import REFERENCE


@contextlib.contextmanager
def figure(path: str, size: tuple[float, float]) -> Iterator[Any]:
    """One plot's axes, saved to ``path`` with their legend when the block ends (Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    yield ax
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def peaks(ax: Any, runs: dict[str, list[tuple]], budget_gib: float, labels: tuple, size: int, budget: str):
    """Peak memory against x, a line per contender through its runs that fit and a cross on the budget's line
    for each that did not. ``runs``: name -> [(x, peak bytes, fits)]; ``labels``: the line's and the crosses'
    (formats of the name; None: not in the legend); ``size``: the crosses'; ``budget``: the budget line's."""
    for i, (name, points) in enumerate(runs.items()):
        color = "0.4" if name == REFERENCE else f"C{i}"
        fit = sorted((x, peak / 2**30) for x, peak, fits in points if fits and peak)
        if fit:
            ax.plot(*zip(*fit, strict=True), marker="o", color=color, label=labels[0].format(name))
        if missed := [x for x, _, fits in points if not fits and x]:
            label = labels[1] and labels[1].format(name)
            ax.scatter(missed, [budget_gib] * len(missed), marker="x", s=size, color=color, label=label)
    ax.axhline(budget_gib, linestyle="--", color="k", linewidth=1, label=budget)


def md_table(header: list[str], rows: list[list[str]], rule: str | None = None) -> list[str]:
    """A Markdown table of the cells as given; ``rule``: the alignment row (default: every column left)."""
    rule = rule or "|---" * len(header) + "|"
    return [f"| {' | '.join(header)} |", rule, *(f"| {' | '.join(row)} |" for row in rows)]


def parser(doc: str, stem: str) -> argparse.ArgumentParser:
    """A ``python -m`` benchmark's options: its docstring as the help, and --out for its three files."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help=f"a directory: {stem}.{{json,md,png}} go there")
    return p


def start(a: argparse.Namespace, argv: list[str] | None, stem: str, *packages: str) -> dict[str, Any]:
    """A result's opening: its name, its provenance (the command as typed; ``stem`` is the module's name
    + _cpu; the versions of ``packages`` too) and its arguments. --out is made."""
    command = ["python", "-m", f"fasttrain.bench.{stem.removesuffix('_cpu')}"]
    command += sys.argv[1:] if argv is None else argv
    a.out.mkdir(parents=True, exist_ok=True)
    origin = provenance.record(*packages, command_line=shlex.join(command))
    return {"benchmark": stem, "provenance": origin, "args": {**vars(a), "out": str(a.out)}}


def save(out: Path, result: dict[str, Any], title: str, body: list[str], plot: Callable[[str], None]) -> str:
    """The three files, rewritten after every run (a run cut short keeps what finished); the Markdown."""
    stem = out / result["benchmark"]
    report.write_json(f"{stem}.json", result)
    text = "\n".join([f"# {title}", "", provenance.markdown(result["provenance"]), "", *body]) + "\n"
    report.write_text(f"{stem}.md", text)
    plot(f"{stem}.png")
    return text
