"""The two phases of a GRPO or RLOO step, measured apart (docs/method.md, "TRL's trainers"): ``model.generate``
is wrapped on the model instance, so that TRL's classes stay as they are. Where the CPU's peak-RSS reset
(/proc/self/clear_refs, Linux 4.0+) is refused the phases have no peaks (None); the run's stays.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from typing import Any

GENERATION = "generation"
TRAINING = "training"
_CLEAR_REFS = "/proc/self/clear_refs"


def _rss_peak_mb() -> float | None:
    """The process's peak RSS (VmHWM), in MiB; None where /proc/self/status has none."""
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**10  # kB
    return None


def completion_tokens(output: Any, prompt_width: int, eos_ids: list[int]) -> int:
    """Tokens generated in ``output`` (``[rows, prompt_width + new]`` ids), each row up to and including its first
    end-of-sequence id (what TRL keeps of a completion), every new position when none ends it."""
    import torch

    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    new = sequences[:, prompt_width:]
    if new.numel() == 0:
        return 0
    if not eos_ids:
        return new.numel()
    ends = torch.isin(new, torch.tensor(eos_ids, device=new.device))
    lengths = torch.where(ends.any(dim=1), ends.int().argmax(dim=1) + 1, new.shape[1])
    return int(lengths.sum())


def _eos_ids(model, kwargs: dict[str, Any]) -> list[int]:
    eos = getattr(kwargs.get("generation_config") or model.generation_config, "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


class PhaseMeter:
    """Wall time, CPU time, generated tokens and peak memory of each phase, per optimizer step.

    ``install(model)`` wraps the model's ``generate``; ``start()`` at the start of training, ``step_end()`` at the
    end of each optimizer step (the bench's callback); the per-step lists then line up with the step times."""

    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda
        self.resettable = is_cuda or (_rss_peak_mb() is not None and os.access(_CLEAR_REFS, os.W_OK))
        self.setup_peak_mb: float | None = None
        self.peak_mb: dict[str, float | None] = {GENERATION: None, TRAINING: None}
        self.generation_s: list[float] = []  # per optimizer step
        self.generation_cpu_s: list[float] = []
        self.generated_tokens: list[int] = []
        self.generate_calls = 0
        self._step = {"s": 0.0, "cpu_s": 0.0, "tokens": 0}

    def install(self, model) -> None:
        original = model.generate  # the bound method (or a synthetic stand-in set on the instance)

        def generate(*args, **kwargs):
            self._close(TRAINING)  # synchronizes on CUDA: the generation's timing starts with an idle GPU
            started, started_cpu = time.perf_counter(), time.process_time()
            output = original(*args, **kwargs)
            self._close(GENERATION)
            self._step["s"] += time.perf_counter() - started
            self._step["cpu_s"] += time.process_time() - started_cpu
            prompt = kwargs.get("input_ids", args[0] if args else None)
            self._step["tokens"] += completion_tokens(output, prompt.shape[1], _eos_ids(model, kwargs))
            self.generate_calls += 1
            return output

        model.generate = generate

    def start(self) -> None:
        """Training begins: what came before (model, data, trainer construction) is the setup's peak."""
        self.setup_peak_mb = self._take_peak()

    def step_end(self) -> None:
        self._close(TRAINING)
        self.generation_s.append(self._step["s"])
        self.generation_cpu_s.append(self._step["cpu_s"])
        self.generated_tokens.append(self._step["tokens"])
        self._step = {"s": 0.0, "cpu_s": 0.0, "tokens": 0}

    def _close(self, phase: str) -> None:
        if (peak := self._take_peak()) is not None:
            self.peak_mb[phase] = max(peak, self.peak_mb[phase] or 0.0)

    def _take_peak(self) -> float | None:
        """The peak since the previous call (or the process start), then reset; None if it cannot be reset."""
        if self.is_cuda:
            import torch

            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
            return peak
        if not self.resettable:
            return None
        peak = _rss_peak_mb()
        with open(_CLEAR_REFS, "w", encoding="ascii") as handle:
            handle.write("5")
        return peak


def phase_results(meter: PhaseMeter, result: dict[str, Any], cpu_times: list[float], warmup: int) -> dict:
    """The worker's figures split by phase (the first ``warmup`` steps untimed): ``tokens_per_s`` and
    ``tokens_per_cpu_s`` become the training phase's (scored tokens over its time), ``step_time_s`` stays the
    whole step's. ``result`` holds the run's ``step_times_s`` and ``tokens_per_step`` (the loss forwards' tokens);
    ``cpu_times`` is the process's CPU clock at the start and at each step's end."""
    step_s = result["step_times_s"]
    step_cpu_s = [b - a for a, b in itertools.pairwise(cpu_times)]
    scored = result["tokens_per_step"]
    train_s = [s - g for s, g in zip(step_s, meter.generation_s, strict=True)]
    train_cpu_s = [s - g for s, g in zip(step_cpu_s, meter.generation_cpu_s, strict=True)]
    timed = range(warmup, len(step_s))

    def total(values) -> float:
        return sum(values[i] for i in timed)

    def per(numerator: float, denominator: float) -> float:
        return numerator / denominator if denominator > 0 else float("nan")

    out: dict[str, Any] = {
        "phases": f"{GENERATION}: inside model.generate; {TRAINING}: the rest of each optimizer step",
        "generation_time_s": per(total(meter.generation_s), len(timed)),
        "generation_tokens_per_s": per(total(meter.generated_tokens), total(meter.generation_s)),
        "generation_times_s": meter.generation_s,
        "generated_tokens_per_step": meter.generated_tokens,
        "generate_calls": meter.generate_calls,
        "training_phase_time_s": per(total(train_s), len(timed)),
        "training_phase_times_s": train_s,
        "tokens_per_s": per(total(scored), total(train_s)),
        "tokens_per_cpu_s": per(total(scored), total(train_cpu_s)),
        "step_tokens_per_s": per(total(scored), total(step_s)),
        "generation_peak_memory_mb": meter.peak_mb[GENERATION],
        "training_peak_memory_mb": meter.peak_mb[TRAINING],
    }
    setup = result["memory_after_setup_mb"]
    if meter.peak_mb[TRAINING] is not None:
        out["training_peak_above_setup_mb"] = meter.peak_mb[TRAINING] - setup
    # on CPU the reset also reset ru_maxrss: the run's peak is the phases' and setup's, where told apart
    if meter.setup_peak_mb is not None:
        run_peak = max(v for v in (meter.setup_peak_mb, *meter.peak_mb.values()) if v is not None)
        out.update(peak_memory_mb=run_peak, peak_above_setup_mb=run_peak - setup)
        if not meter.is_cuda:
            out["memory_kind"] = "peak RSS (VmHWM, reset at each phase change)"
    return out
