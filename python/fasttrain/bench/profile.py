"""``fasttrain bench --profile``: where one optimizer step's time goes, for each contender.

One extra run per contender (after the timed runs, never mixed into their figures) trains the warm-up steps and
then one more step under ``torch.profiler``. Every operator's self time on the training thread goes to exactly one
category, the first that matches:

- optimizer: inside ``Optimizer.step`` / ``Optimizer.zero_grad`` (torch records them), or a ``_foreach_`` op
  (the gradient-norm and clip passes);
- attention: inside a scaled-dot-product-attention op;
- LM head: an op with an operand whose last or first dimension is the vocabulary (the head's projection, its
  gradients, the softmax and loss over the logits; for fasttrain, every chunk of its fused head);
- matmuls: the other GEMMs (``mm``, ``addmm``, ``bmm``, ...): the backbone's projections;
- elementwise and other ops: everything else (RMSNorm, RoPE, SwiGLU, casts, copies, the embedding).

What no operator holds is "outside operators" (Python, the Trainer, the data loader). The kernel's share comes
from ``getrusage`` over the same step: system CPU-seconds of the whole process (all threads) and minor page faults.
It overlaps the categories (a page fault happens inside an operator), so it is given beside them, not added.
"""

from __future__ import annotations

import resource
import time
from typing import Any

CATEGORY_NOTE = (
    "each operator's self time goes to the first category it matches: optimizer (inside Optimizer.step or "
    "zero_grad, or a _foreach_ op: the norm and clip passes), attention (inside scaled-dot-product attention), "
    "LM head (an operand with the vocabulary as its first or last dimension: projection, its gradients, softmax "
    "and loss), matmuls (the other GEMMs), elementwise and other ops (the rest); outside operators is the step's "
    "wall time that no operator holds (Python, the Trainer); system CPU time and page faults are the whole "
    "process's over the step (getrusage) and overlap the rows above"
)
CATEGORIES = ("matmuls", "LM head", "attention", "optimizer", "elementwise and other ops")
OUTSIDE = "outside operators"

_GEMMS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::matmul",
    "aten::linear",
    "aten::_mm",
}
_OPTIMIZER_SCOPES = ("Optimizer.step#", "Optimizer.zero_grad#")


def _has_vocab(shapes: Any, vocab: int) -> bool:
    return any(
        isinstance(shape, (list, tuple))
        and shape
        and isinstance(shape[0], int)
        and vocab in (shape[0], shape[-1])
        for shape in shapes or ()
    )


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def category(event, vocab: int) -> str:
    """The category one profiler event's self time goes to (see the module's docstring)."""
    name = event.name
    chain = [name, *(a.name for a in _ancestors(event))]
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
    for event in events:
        if event.device_type.name != "CPU":
            continue
        seconds[category(event, vocab)] += event.self_cpu_time_total / 1e6
    seconds[OUTSIDE] = max(step_s - sum(seconds.values()), 0.0)
    return seconds


class StepProfiler:
    """Profiles one optimizer step (``step``, 1-based) from the Trainer's ``on_step_begin`` to its
    ``on_step_end``; ``result()`` is the breakdown, the step's wall time, system time and page faults."""

    def __init__(self, step: int, vocab: int, is_cuda: bool) -> None:
        self.step, self.vocab, self.is_cuda = step, vocab, is_cuda
        self._profiler = None
        self._result: dict[str, Any] | None = None

    def begin(self, global_step: int) -> None:
        if global_step + 1 != self.step:
            return
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.is_cuda:
            torch.cuda.synchronize()
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.__enter__()
        self._usage = resource.getrusage(resource.RUSAGE_SELF)
        self._t0 = time.perf_counter()

    def end(self, global_step: int, tokens: int) -> None:
        if self._profiler is None or global_step != self.step:
            return
        if self.is_cuda:
            import torch

            torch.cuda.synchronize()
        step_s = time.perf_counter() - self._t0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self._profiler.__exit__(None, None, None)
        seconds = breakdown(self._profiler.events(), self.vocab, step_s)
        self._profiler = None
        self._result = {
            "step": self.step,
            "step_s": step_s,
            "tokens": tokens,
            "seconds": seconds,
            "user_cpu_s": usage.ru_utime - self._usage.ru_utime,
            "system_cpu_s": usage.ru_stime - self._usage.ru_stime,
            "minor_page_faults": usage.ru_minflt - self._usage.ru_minflt,
            "note": "self time of every operator on the training thread, under torch.profiler (record_shapes)",
        }

    def result(self) -> dict[str, Any] | None:
        return self._result


def markdown(profiles: dict[str, dict[str, Any]], matmul_rate: float | None, flops_per_token: dict) -> str:
    """One table: a row per category, a column per contender (seconds and share of the step)."""
    names = list(profiles)
    lines = [
        "| one optimizer step | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]

    def cell(profile: dict[str, Any], seconds: float) -> str:
        return f"{seconds:.2f} s ({100 * seconds / profile['step_s']:.0f}%)"

    for key in (*CATEGORIES, OUTSIDE):
        lines.append(
            f"| {key} | " + " | ".join(cell(profiles[n], profiles[n]["seconds"][key]) for n in names) + " |"
        )
    lines.append("| step (wall) | " + " | ".join(f"{profiles[n]['step_s']:.2f} s" for n in names) + " |")
    if matmul_rate:
        limits = []
        for n in names:
            flops = flops_per_token.get(n)
            limit = flops * profiles[n]["tokens"] / matmul_rate if flops else None
            limits.append(
                "-" if limit is None else f"{limit:.2f} s ({100 * limit / profiles[n]['step_s']:.0f}%)"
            )
        lines.append(
            "| its matmul limit (model FLOPs at the measured GEMM rate) | " + " | ".join(limits) + " |"
        )
    lines.append(
        "| system CPU time, all threads (overlaps the rows above) | "
        + " | ".join(f"{profiles[n]['system_cpu_s']:.2f} s" for n in names)
        + " |"
    )
    lines.append(
        "| user CPU time, all threads | "
        + " | ".join(f"{profiles[n]['user_cpu_s']:.2f} s" for n in names)
        + " |"
    )
    lines.append(
        "| minor page faults | " + " | ".join(f"{profiles[n]['minor_page_faults']:,}" for n in names) + " |"
    )
    lines.append("| tokens in the step | " + " | ".join(f"{profiles[n]['tokens']:,}" for n in names) + " |")
    return "\n".join(lines) + "\n"
