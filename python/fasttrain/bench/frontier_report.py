"""``fasttrain bench --frontier`` end to end: the budget, the search (bench/frontier.py), the table, the files."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from .config import REFERENCE, BenchConfig, Contender
from .frontier import Probe, available_bytes, default_budget, parse_size, run_frontier, summarize
from .report import _aligned, _markdown_table


def _budget(config: BenchConfig, given: str | None) -> int:
    if config.device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return parse_size(given) if given else int(free * 0.95)
    return parse_size(given) if given else default_budget()


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["contender", "longest length", "did not fit", "peak GiB there", "tokens/s there",
              "x reference's length", "peak GiB at reference's longest", "x reference's peak"]  # fmt: skip
    table = []
    for name, row in data["summary"]["contenders"].items():
        tps = row.get("tokens_per_s_at_longest")
        ratio = row.get("length_ratio")
        peak_ratio = row.get("peak_ratio_at_reference_longest")
        table.append([
            name,
            str(row["longest_length"] or "none fits"),
            str(row["first_length_not_fitting"] or "-"),
            _gib(row["peak_gib_at_longest"]),
            "-" if tps is None else f"{tps:.1f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            _gib(row.get("peak_gib_at_reference_longest")),
            "-" if peak_ratio is None else f"{peak_ratio:.2f}x",
        ])  # fmt: skip
    return header, table


def describe(config: BenchConfig, data: dict[str, Any]) -> list[str]:
    memory = "torch.cuda.max_memory_allocated, the budget set as the process's memory fraction" if (
        config.device == "cuda") else "peak resident memory (ru_maxrss), the budget watched by the parent"  # fmt: skip
    return [
        f"model {config.model}, {'bf16' if config.bf16 else 'fp32'}, {config.device}; one optimizer step a probe, "
        f"batch 1, gradient checkpointing on both sides; every example exactly the probed length",
        f"memory budget {data['summary']['budget_gib']:.2f} GiB ({memory}); lengths doubled from {config.seq_len} "
        f"up to {data['max_length']}, then bisected to within 10%",
        f"wall time {data['wall_s'] / 60:.1f} min" + ("" if data["complete"] else " so far (not finished)"),
    ]


def markdown(config: BenchConfig, data: dict[str, Any]) -> str:
    from .provenance import markdown as provenance_markdown

    header, table = rows(data)
    lines = [provenance_markdown(data["provenance"]), "", "## The length frontier", ""]
    lines += [f"- {line}" for line in describe(config, data)] + [""]
    lines += [*_markdown_table(header, table), "## Every probe", ""]
    lines += [
        "| contender | length | fits | peak GiB | tokens/s | loss | why not |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, probes in data["probes"].items():
        for p in probes:
            peak = None if p["peak_bytes"] is None else p["peak_bytes"] / 2**30
            tps = "-" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:.1f}"
            loss = "-" if p["loss"] is None else f"{p['loss']:.4f}"
            why = (p["why"] or "").splitlines()[0][:120] if p["why"] else ""
            lines.append(f"| {name} | {p['length']} | {'yes' if p['fits'] else 'no'} | {_gib(peak)} | {tps} | "
                         f"{loss} | {why} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(path: str, config: BenchConfig, data: dict[str, Any]) -> None:
    """Peak memory against length, one line a contender; probes that did not fit as crosses at the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budget = data["summary"]["budget_gib"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (name, probes) in enumerate(data["probes"].items()):
        color = "0.4" if name == REFERENCE else f"C{i}"
        fit = sorted((p["length"], p["peak_bytes"] / 2**30) for p in probes if p["fits"] and p["peak_bytes"])
        if fit:
            ax.plot(*zip(*fit, strict=True), marker="o", color=color, label=f"{name} (fits)")
        missed = [p["length"] for p in probes if not p["fits"] and p["length"]]
        if missed:
            ax.scatter(
                missed, [budget] * len(missed), marker="x", s=60, color=color, label=f"{name} (does not fit)"
            )
    ax.axhline(budget, linestyle="--", color="k", linewidth=1, label=f"budget {budget:.1f} GiB")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="sequence length (tokens, batch 1)", ylabel="peak memory (GiB)",
           title=f"longest trainable length: {config.model}, {'bf16' if config.bf16 else 'fp32'}, {config.device}")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def frontier_bench(
    config: BenchConfig, contenders: list[Contender], settings: dict[str, Any], args: Any, command_line: str
) -> int:
    from . import provenance, report

    budget = _budget(config, settings.get("memory_budget"))
    max_length = settings.get("max_length") or config.seq_len * 64
    if config.device == "cpu" and budget > available_bytes():
        print(f"fasttrain bench: warning: the budget ({budget / 2**30:.1f} GiB) is more than the machine has free "
              f"({available_bytes() / 2**30:.1f} GiB): the kernel may stop a run before the budget does",
              file=sys.stderr)  # fmt: skip
    config = dataclasses.replace(config, memory_budget=budget)
    origin = provenance.record(command_line=command_line)
    started = time.perf_counter()

    def assemble(found: dict[str, list[Probe]], complete: bool) -> dict[str, Any]:
        return {
            "provenance": origin,
            "config": config.to_json(),
            "max_length": max_length,
            "probes": {name: [dataclasses.asdict(p) for p in probes] for name, probes in found.items()},
            "summary": summarize(found, budget),
            "wall_s": time.perf_counter() - started,
            "complete": complete,
        }

    def write(data: dict[str, Any]) -> None:
        if args.json:
            report.write_json(args.json, data)
        if args.markdown:
            report.write_text(args.markdown, markdown(config, data))

    found = run_frontier(
        config, contenders, budget, max_length, on_probe=lambda f: write(assemble(f, False)),
        say=lambda line: print(line, file=sys.stderr),
    )  # fmt: skip
    data = assemble(found, True)
    write(data)
    print("\n".join([*describe(config, data), "", *_aligned(*rows(data))]))
    if args.plot:
        plot(args.plot, config, data)
    crashed = {n: r["crashed"] for n, r in data["summary"]["contenders"].items() if r["crashed"]}
    for name, why in crashed.items():
        print(f"fasttrain bench: {name}: {why}", file=sys.stderr)
    return 1 if crashed else 0
