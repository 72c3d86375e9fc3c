"""``fasttrain bench --profile``: where one optimizer step's time goes, for each contender: one extra run per
contender profiles a step under ``torch.profiler``. The categories and how each is recognised: docs/method.md,
"--profile".
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from typing import Any

from . import provenance, report, runner
from .config import BenchConfig, Contender

CATEGORIES = ("matmuls", "LM head", "attention", "optimizer", "elementwise and other ops")
OUTSIDE = "outside operators"

_GEMMS = {f"aten::{op}" for op in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_mm")}
_OPTIMIZER_SCOPES = ("Optimizer.step#", "Optimizer.zero_grad#")


def _has_vocab(shapes: Any, vocab: int) -> bool:
    return any(
        shape and isinstance(shape[0], int) and vocab in (shape[0], shape[-1]) for shape in shapes or ()
    )


def category(event, vocab: int) -> str:
    """The category one profiler event's self time goes to (docs/method.md, "--profile")."""
    name, parent = event.name, event.cpu_parent
    chain = [name]  # the event's name and its ancestors'
    while parent is not None:
        chain.append(parent.name)
        parent = parent.cpu_parent
    if any(n.startswith(_OPTIMIZER_SCOPES) for n in chain) or name.startswith("aten::_foreach_"):
        return "optimizer"
    if any("scaled_dot_product" in n.lower() or "flash_attention" in n.lower() for n in chain):
        return "attention"
    if "embedding" not in name and _has_vocab(getattr(event, "input_shapes", None), vocab):
        return "LM head"
    if name in _GEMMS:
        return "matmuls"
    return "elementwise and other ops"


def breakdown(events, vocab: int, step_s: float) -> dict[str, float]:
    """Seconds per category for one step, from the profiler's events (self CPU time of every operator and
    record_function scope on the training thread) and the step's wall time."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for event in (e for e in events if e.device_type.name == "CPU"):
        seconds[category(event, vocab)] += event.self_cpu_time_total / 1e6
    seconds[OUTSIDE] = max(step_s - sum(seconds.values()), 0.0)
    return seconds


class StepProfiler:
    """Profiles one optimizer step (``step``, 1-based) from the Trainer's ``on_step_begin`` to its
    ``on_step_end``, each told the tokens counted so far; then ``result`` holds the breakdown, the step's wall
    time, tokens, CPU time and page faults."""

    def __init__(self, step: int, vocab: int, is_cuda: bool) -> None:
        import torch

        self.step, self.vocab = step, vocab
        self._sync = torch.cuda.synchronize if is_cuda else lambda: None
        self._profiler = None
        self.result: dict[str, Any] | None = None

    def begin(self, global_step: int, tokens: int) -> None:
        if global_step + 1 != self.step:
            return
        import torch

        self._sync()
        self._profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
        )
        self._profiler.__enter__()
        self._tokens = tokens
        self._usage = resource.getrusage(resource.RUSAGE_SELF)
        self._t0 = time.perf_counter()

    def end(self, global_step: int, tokens: int) -> None:
        if self._profiler is None or global_step != self.step:
            return
        self._sync()
        step_s = time.perf_counter() - self._t0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self._profiler.__exit__(None, None, None)
        seconds = breakdown(self._profiler.events(), self.vocab, step_s)
        self._profiler = None
        self.result = {
            "step": self.step,
            "step_s": step_s,
            "tokens": tokens - self._tokens,
            "seconds": seconds,
            "user_cpu_s": usage.ru_utime - self._usage.ru_utime,
            "system_cpu_s": usage.ru_stime - self._usage.ru_stime,
            "minor_page_faults": usage.ru_minflt - self._usage.ru_minflt,
            "note": "self time of every operator on the training thread, under torch.profiler (record_shapes)",
        }


def markdown(profiles: dict[str, dict[str, Any]], matmul_rate: float | None, flops_per_token: dict) -> str:
    """One table: a row per category, a column per contender (seconds and share of the step)."""
    names = list(profiles)

    def share(p: dict[str, Any], seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds:.2f} s ({100 * seconds / p['step_s']:.0f}%)"

    def limit(n: str) -> float | None:  # the step's model FLOPs at the measured GEMM rate
        return flops_per_token[n] * profiles[n]["tokens"] / matmul_rate if flops_per_token.get(n) else None

    rows = [(key, lambda p, n, key=key: share(p, p["seconds"][key])) for key in (*CATEGORIES, OUTSIDE)]
    rows.append(("step (wall)", lambda p, n: f"{p['step_s']:.2f} s"))
    if matmul_rate:
        rows.append(
            ("its matmul limit (model FLOPs at the measured GEMM rate)", lambda p, n: share(p, limit(n)))
        )
    rows += [
        ("system CPU time, all threads (overlaps the rows above)", lambda p, n: f"{p['system_cpu_s']:.2f} s"),
        ("user CPU time, all threads", lambda p, n: f"{p['user_cpu_s']:.2f} s"),
        ("minor page faults", lambda p, n: f"{p['minor_page_faults']:,}"),
        ("tokens in the step", lambda p, n: f"{p['tokens']:,}"),
    ]
    table = [[label, *(cell(profiles[n], n) for n in names)] for label, cell in rows]
    return "\n".join(report._markdown_table(["one optimizer step", *names], table))


def profile_contenders(config: BenchConfig, contenders: list[Contender], failures: dict[str, str],
                       limit: dict[str, Any] | None, origin: dict[str, Any], path: str) -> dict:  # fmt: skip
    """The profile runs of ``--profile PATH``, after the timed runs: one per contender that did not fail, each
    in its own process like every bench run. PATH gets the table as Markdown under the bench's provenance; the
    bench's JSON gets what this returns, the raw breakdowns."""
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
    table = markdown(profiles, rate, flops) if profiles else "(no contender could be profiled)\n"
    lines = [
        "# fasttrain bench --profile",
        "",
        provenance.markdown(origin),
        f"- model {report.model_note(config.model, shape)}; step {profiled.steps} of a run of "
        f"{profiled.steps} (the first {config.warmup_steps} warm up), each contender in its own process",
        "- how the step's time is split: docs/method.md; the profiler slows the step it watches, so these "
        "step times are not the bench's figures",
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
