"""The profile runs of ``fasttrain bench --profile PATH``: one per contender, after the timed runs.

Each trains the warm-up steps and one more, the last under the profiler (bench/profile.py), in its own process like
every bench run; its timings are not the bench's figures (the profiler slows the step it watches). PATH gets the
table as Markdown under the bench's provenance; the bench's JSON gets the raw breakdowns. How the step's time is
split: docs/method.md.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from . import profile, provenance, report, runner
from .config import BenchConfig, Contender


def profile_contenders(config: BenchConfig, contenders: list[Contender], failures: dict[str, str],
                       limit: dict[str, Any] | None, origin: dict[str, Any], path: str) -> dict[str, Any]:  # fmt: skip
    """Profile every contender that did not fail; write ``path``; return what the JSON report keeps."""
    profiled = dataclasses.replace(config, steps=config.warmup_steps + 1, profile=True)
    todo = [c for c in contenders if c.name not in failures]
    names = ", ".join(c.name for c in todo)
    print(f"fasttrain bench: profiling {names} (step {profiled.steps})", file=sys.stderr)
    runs, errors = runner.run_all(profiled, todo, 1, progress=False)
    done = {name: result[0] for name, result in runs.items() if result and result[0].get("profile")}
    profiles = {name: result["profile"] for name, result in done.items()}
    flops = {name: result.get("train_flops_per_token") for name, result in done.items()}
    shape = next((result["model_shape"] for result in done.values() if result.get("model_shape")), None)
    rate = limit["matmul_flops_per_s"] if limit else None
    table = profile.markdown(profiles, rate, flops) if profiles else "(no contender could be profiled)\n"
    lines = [
        "# fasttrain bench --profile",
        "",
        provenance.markdown(origin),
        f"- model {report.model_note(config.model, shape)}; step {profiled.steps} of a run of {profiled.steps} "
        f"(the first {config.warmup_steps} warm up), each contender in its own process",
        "- how the step's time is split: docs/method.md; the profiler slows the step it watches, so these step "
        "times are not the bench's figures",
        "",
        table,
    ]
    if limit:
        lines.append(f"- matmul limit: {limit['measured']}, {limit['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s")
    for name, error in errors.items():
        lines.append(f"- {name}: not profiled: {error.splitlines()[0]}")
    report.write_text(path, "\n".join(lines) + "\n")
    print(table)
    return {"profiles": profiles, "errors": errors, "steps": profiled.steps}
