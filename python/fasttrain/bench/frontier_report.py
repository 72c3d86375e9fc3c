"""``fasttrain bench --frontier`` end to end: the budget, the search (bench/frontier.py), the files."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from . import outputs, provenance, report
from .config import BenchConfig, Contender
from .frontier import Found, available_bytes, budget_for, run_frontier, summarize


def _f(value: float | None, spec: str = "{:.2f}") -> str:
    return "-" if value is None else spec.format(value)


def rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["contender", "longest length", "did not fit", "peak GiB there", "tokens/s there",
              "x reference's length", "peak GiB at reference's longest", "x reference's peak"]  # fmt: skip
    table = [
        [name, str(row["longest_length"] or "none fits"), str(row["first_length_not_fitting"] or "-"),
         _f(row["peak_gib_at_longest"]), _f(row.get("tokens_per_s_at_longest"), "{:.1f}"),
         _f(row.get("length_ratio"), "{:.2f}x"), _f(row.get("peak_gib_at_reference_longest")),
         _f(row.get("peak_ratio_at_reference_longest"), "{:.2f}x")]
        for name, row in data["summary"]["contenders"].items()
    ]  # fmt: skip
    return header, table


def describe(config: BenchConfig, data: dict[str, Any]) -> list[str]:
    memory = "peak resident memory (ru_maxrss), the budget watched by the parent"
    if config.device == "cuda":
        memory = "torch.cuda.max_memory_allocated, the budget set as the process's memory fraction"
    return [
        f"model {config.model}, {'bf16' if config.bf16 else 'fp32'}, {config.device}; one optimizer step a "
        "probe, batch 1, gradient checkpointing on both sides; every example exactly the probed length",
        f"memory budget {data['summary']['budget_gib']:.2f} GiB ({memory}); lengths doubled from "
        f"{config.seq_len} up to {data['max_length']}, then bisected to within 10%",
        f"wall time {data['wall_s'] / 60:.1f} min" + ("" if data["complete"] else " so far (not finished)"),
    ]


def markdown(config: BenchConfig, data: dict[str, Any]) -> str:
    probes = [
        [name, str(p["length"]), "yes" if p["fits"] else "no",
         _f(None if p["peak_bytes"] is None else p["peak_bytes"] / 2**30), _f(p["tokens_per_s"], "{:.1f}"),
         _f(p["loss"], "{:.4f}"), p["why"].splitlines()[0][:120] if p["why"] else ""]
        for name, runs in data["probes"].items()
        for p in runs
    ]  # fmt: skip
    lines = [provenance.markdown(data["provenance"]), "", "## The length frontier", ""]
    lines += [*[f"- {line}" for line in describe(config, data)], "", *report._markdown_table(*rows(data))]
    header = ["contender", "length", "fits", "peak GiB", "tokens/s", "loss", "why not"]
    return "\n".join([*lines, "## Every probe", "", *outputs.md_table(header, probes)]) + "\n"


def plot(path: str, config: BenchConfig, data: dict[str, Any]) -> None:
    """Peak memory against length, one line a contender; probes that did not fit as crosses at the budget."""
    budget = data["summary"]["budget_gib"]
    runs = {
        n: [(p["length"], p["peak_bytes"], p["fits"]) for p in probes] for n, probes in data["probes"].items()
    }
    dtype = "bf16" if config.bf16 else "fp32"
    with outputs.figure(path, (8, 5)) as ax:
        outputs.peaks(ax, runs, budget, ("{} (fits)", "{} (does not fit)"), 60, f"budget {budget:.1f} GiB")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="sequence length (tokens, batch 1)", ylabel="peak memory (GiB)",
               title=f"longest trainable length: {config.model}, {dtype}, {config.device}")  # fmt: skip


def frontier_bench(
    config: BenchConfig, contenders: list[Contender], settings: dict[str, Any], args: Any, command_line: str
) -> int:
    budget = budget_for(config.device, settings.get("memory_budget"))
    max_length = settings.get("max_length") or config.seq_len * 64
    if config.device == "cpu" and budget > (free := available_bytes()):
        print(f"fasttrain bench: warning: the budget ({budget / 2**30:.1f} GiB) is more than the machine has "
              f"free ({free / 2**30:.1f} GiB): the kernel may stop a run before the budget does",
              file=sys.stderr)  # fmt: skip
    config = dataclasses.replace(config, memory_budget=budget)
    origin = provenance.record(command_line=command_line)
    started = time.perf_counter()

    def write(found: Found, complete: bool) -> dict[str, Any]:
        """The result so far, written (after every probe: a search cut short keeps what finished)."""
        data = {"provenance": origin, "config": config.to_json(), "max_length": max_length,
                "probes": {name: [dataclasses.asdict(p) for p in probes] for name, probes in found.items()},
                "summary": summarize(found, budget), "wall_s": time.perf_counter() - started,
                "complete": complete}  # fmt: skip
        if args.json:
            report.write_json(args.json, data)
        if args.markdown:
            report.write_text(args.markdown, markdown(config, data))
        if args.plot:
            plot(args.plot, config, data)
        return data

    data = write(
        run_frontier(config, contenders, budget, max_length, lambda found: write(found, False)), True
    )
    print("\n".join([*describe(config, data), "", *report._aligned(*rows(data))]))
    crashed = {n: r["crashed"] for n, r in data["summary"]["contenders"].items() if r["crashed"]}
    for name, why in crashed.items():
        print(f"fasttrain bench: {name}: {why}", file=sys.stderr)
    return 1 if crashed else 0
