"""``fasttrain bench --frontier``: the longest sequence each contender trains within a memory budget, every
probe in a process of its own (runner.run_one) that the parent watches (the method: docs/usage.md, "The memory
frontiers")."""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from .config import REFERENCE, BenchConfig, Contender
from .runner import OverBudget, RunFailed, run_one

# the bisection stops when the first length that did not fit is within 10% of the longest that did
TOLERANCE = 0.10
ROUND = 64  # probed lengths are multiples of this (whole tiles for every kernel)
# the default budget on CPU leaves this share of the available memory (at least _MIN_MARGIN) to the rest
_MARGIN = 0.10
_MIN_MARGIN = 2**30
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes from '20GiB', '20G' (binary), '20GB' (decimal), '512MiB' or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise ValueError(f"{text!r} is not a size (say e.g. 20GiB, 20G, 512MiB or a number of bytes)")
    return int(float(match.group(1)) * unit)


def available_bytes() -> int:
    """What the machine has free now (Linux MemAvailable)."""
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 2**10
    raise OSError("no MemAvailable line in /proc/meminfo")


def budget_for(device: str, given: str | None) -> int:
    """``given`` (a size), else on cuda 95% of the device's free memory, else the machine's available memory
    less a margin (10%, at least 1 GiB) for everything else it runs."""
    if given:
        return parse_size(given)
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0] * 0.95)
    free = available_bytes()
    return free - max(int(free * _MARGIN), _MIN_MARGIN)


@dataclasses.dataclass
class Probe:
    length: int
    fits: bool
    # the child's high-water mark, or the parent's last read when it was stopped
    peak_bytes: int | None = None
    tokens_per_s: float | None = None
    step_s: float | None = None
    loss: float | None = None
    why: str | None = None  # why it did not fit


Found = dict[str, list[Probe]]  # contender -> its probes, in the order they ran


def _round(length: int) -> int:
    return max(ROUND, (length + ROUND // 2) // ROUND * ROUND)


def under_budget(
    config: BenchConfig, contender: Contender, tag: str, budget: int, workdir: str
) -> tuple[dict[str, Any] | None, int | None, str | None]:
    """One run in a child under ``budget``: (its result, None when the parent stopped it; its peak; why it
    does not fit, None if it fits). On cuda the child's memory fraction holds the budget, not the parent."""
    watched = budget if config.device == "cpu" else None
    try:
        result = run_one(config, contender, workdir, tag, lambda _: None, watched)
    except OverBudget as exc:
        return None, exc.peak_bytes, "passed the budget (stopped by the parent)"
    peak = int(result["peak_memory_mb"] * 2**20)
    return result, peak, None if peak <= budget else "its high-water mark passed the budget"


def probe(config: BenchConfig, contender: Contender, length: int, budget: int, workdir: str) -> Probe:
    """One optimizer step at ``length`` tokens in a child under ``budget``."""
    at = dataclasses.replace(config, seq_len=length)
    try:
        result, peak, why = under_budget(at, contender, f"{contender.name}-{length}", budget, workdir)
    except RunFailed as exc:
        if "not enough memory" in str(exc) or "out of memory" in str(exc).lower():
            return Probe(length, False, why="the allocator ran out of memory")
        raise
    if result is None:
        return Probe(length, False, peak, why=why)
    loss = next((x for x in reversed(result["losses"]) if x is not None), None)  # the last logged
    return Probe(length, why is None, peak, result["tokens_per_s"], result["step_time_s"], loss, why)


def search(run: Callable[[int], Probe], start: int, max_length: int) -> list[Probe]:
    """Doubling from ``start`` until a probe does not fit (or ``max_length`` is passed), then bisection."""
    probes: list[Probe] = []
    length, fit, miss = _round(start), None, None
    while length <= max_length:
        probes.append(run(length))
        if not probes[-1].fits:
            miss = length
            break
        fit, length = length, length * 2
    if fit is None or miss is None:  # nothing fits, or everything up to the cap does
        return probes
    while miss - fit > TOLERANCE * fit:
        middle = _round((fit + miss) // 2)
        if middle in (fit, miss):
            break
        probes.append(run(middle))
        fit, miss = (middle, miss) if probes[-1].fits else (fit, middle)
    return probes


def longest(probes: list[Probe]) -> Probe | None:
    return max((p for p in probes if p.fits), key=lambda p: p.length, default=None)


def run_frontier(
    config: BenchConfig,
    contenders: list[Contender],
    budget: int,
    max_length: int,
    on_probe: Callable[[Found], None],
) -> Found:
    """Every contender's probes, the reference's first; the others start at its longest (their peak ratio kept
    if a time cap stops the search), a length probed once; ``on_probe(found)`` after each, said on stderr."""
    ordered = sorted(contenders, key=lambda c: c.name != REFERENCE)  # stable: the others keep their order
    found: Found = {c.name: [] for c in ordered}
    with tempfile.TemporaryDirectory(prefix="fasttrain-frontier-") as workdir:

        def run(contender: Contender, length: int) -> Probe:
            if done := next((p for p in found[contender.name] if p.length == length), None):
                return done
            print(f"fasttrain bench --frontier: {contender.name} at {length} tokens ...", file=sys.stderr)
            result = probe(config, contender, length, budget, workdir)
            peak = "-" if result.peak_bytes is None else f"{result.peak_bytes / 2**30:.2f} GiB"
            print(f"  {'fits' if result.fits else 'does not fit'} (peak {peak})", file=sys.stderr)
            found[contender.name].append(result)
            on_probe(found)
            return result

        for contender in ordered:
            best = longest(found.get(REFERENCE, []))
            try:
                if best is not None and contender.name != REFERENCE:
                    run(contender, best.length)
                search(functools.partial(run, contender), config.seq_len, max_length)
            except RunFailed as exc:  # not a memory verdict: recorded, and the other contenders go on
                found[contender.name].append(Probe(0, False, why=f"crashed: {exc}"))
    return found


def summarize(found: Found, budget: int) -> dict[str, Any]:
    """The table's facts: each contender's longest length, its peak and speed there, the first length that did
    not fit, and its peak at the reference's longest length (and the ratio to the reference's)."""
    reference = longest(found.get(REFERENCE, []))
    out: dict[str, Any] = {}
    for name, probes in found.items():
        best = longest(probes)
        misses = [p.length for p in probes if not p.fits and p.length]
        row: dict[str, Any] = {
            "longest_length": best.length if best else None,
            "first_length_not_fitting": min((m for m in misses if not best or m > best.length), default=None),
            "peak_gib_at_longest": best.peak_bytes / 2**30 if best and best.peak_bytes else None,
            "tokens_per_s_at_longest": best.tokens_per_s if best else None,
            "crashed": next((p.why for p in probes if p.why and p.why.startswith("crashed")), None),
        }
        if reference is not None:
            at = next((p for p in probes if p.length == reference.length and p.fits), None)
            row["peak_gib_at_reference_longest"] = at.peak_bytes / 2**30 if at and at.peak_bytes else None
            if at and at.peak_bytes and reference.peak_bytes:
                row["peak_ratio_at_reference_longest"] = at.peak_bytes / reference.peak_bytes
            if best:
                row["length_ratio"] = best.length / reference.length
        out[name] = row
    return {"budget_gib": budget / 2**30, "contenders": out}
