"""Run every contender in its own child process, alternating (``schedule``), one progress bar across all runs.
A contender whose run crashes is recorded with its error and its remaining repetitions are skipped; after every
run the caller hears of it (``on_run``) so that it can write what finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from .config import BenchConfig, Contender, dump
from .provenance import load_average

_POLL_S = 0.2
# under a memory budget: a process allocating at a few GB/s passes the budget by at most ~100 MB between reads
_BUDGET_POLL_S = 0.02
_LOG_TAIL_LINES = 30
_LOAD_EVERY_S = 5.0  # the machine's 1-minute load average, sampled while a child runs


class BenchError(ValueError):
    """A user error detected by a child (bad dataset contents, tokenizer/model mismatch): exit code 2."""


class RunFailed(RuntimeError):
    """A child crashed; the message carries the tail of its log."""


class OverBudget(RunFailed):
    """A child's resident memory passed the budget the parent watches (``run_one(budget_bytes=...)``): stopped."""

    def __init__(self, message: str, peak_bytes: int) -> None:
        super().__init__(message)
        self.peak_bytes = peak_bytes


def resident_bytes(pid: int) -> int:
    """A process's resident set size now (Linux /proc), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def schedule(contenders: list[Contender], repeats: int) -> list[tuple[int, Contender]]:
    """Round r runs the contenders in order, reversed on odd rounds, so that slow drift of the machine
    (thermal, other load) falls on both sides alike."""
    return [(r, c) for r in range(repeats) for c in (contenders if r % 2 == 0 else contenders[::-1])]


def _child_env(contender: Contender) -> dict[str, str]:
    # Only an ablation run may switch hot paths off; an inherited FASTTRAIN_DISABLE would skew the comparison.
    own = {"FASTTRAIN_DISABLE": contender.disable, "FASTTRAIN_OPTIM_ARGS": contender.optim_args}
    env = {name: value for name, value in os.environ.items() if name not in own}
    env.update({name: value for name, value in own.items() if value})
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _tail(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "".join(handle.readlines()[-_LOG_TAIL_LINES:])
    except OSError:
        return "(no log)"


def run_one(
    config: BenchConfig,
    contender: Contender,
    workdir: str,
    tag: str,
    on_step: Callable[[int], None],
    budget_bytes: int | None = None,
) -> dict[str, Any]:
    """One child run; ``on_step(n)`` is called with the number of optimizer steps finished since the last call.
    With ``budget_bytes`` the child's resident memory is read every few milliseconds and the child is killed
    (``OverBudget``) once it passes the budget: an out-of-memory decided here, before the kernel's OOM killer
    would pick a process of its own choosing."""
    job_path, result_path, progress_path, log_path = (
        os.path.join(workdir, tag + suffix) for suffix in (".job.json", ".result.json", ".progress", ".log")
    )
    job = {"config": config.to_json(), "contender": contender.to_json()}
    dump(job_path, {**job, "result_path": result_path, "progress_path": progress_path})
    open(progress_path, "w").close()
    seen = 0
    loads: list[float] = []
    next_load = 0.0
    with open(log_path, "w", encoding="utf-8") as log:
        command = [sys.executable, "-m", "fasttrain.bench.worker", job_path]
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_child_env(contender))
        peak = 0
        try:
            while True:
                code = child.poll()
                if budget_bytes is not None and code is None:
                    peak = max(peak, resident_bytes(child.pid))
                    if peak > budget_bytes:  # killed below, as on any exception
                        raise OverBudget(
                            f"the {contender.name} run passed the memory budget ({peak / 2**30:.2f} GiB resident "
                            f"> {budget_bytes / 2**30:.2f} GiB) and was stopped",
                            peak,
                        )
                with open(progress_path, encoding="ascii") as progress:
                    done = sum(1 for _ in progress)
                if done > seen:
                    on_step(done - seen)
                    seen = done
                if code is not None:
                    break
                if time.monotonic() >= next_load:
                    loads.append(load_average())
                    next_load = time.monotonic() + _LOAD_EVERY_S
                time.sleep(_BUDGET_POLL_S if budget_bytes is not None else _POLL_S)
        except BaseException:  # Ctrl-C, a failing callback or OverBudget: do not leave the child training
            child.kill()
            child.wait()
            raise
    result: dict[str, Any] = {}
    if os.path.exists(result_path):
        with open(result_path, encoding="utf-8") as handle:
            result = json.load(handle)
    if code == 2 and "error" in result:
        raise BenchError(result["error"])
    if code != 0 or not result:
        raise RunFailed(
            f"the {contender.name} run exited with code {code}; last lines of its log:\n{_tail(log_path)}"
        )
    result["wall_s"] = None  # filled by the caller, which times the whole child
    # other work on the machine while this run ran (the child itself counts about its threads)
    if loads := [x for x in loads if x is not None]:
        result["load_average_during"] = dict(mean=sum(loads) / len(loads), max=max(loads), samples=len(loads))
    return result


Results = dict[str, list[dict[str, Any]]]


def run_all(
    config: BenchConfig,
    contenders: list[Contender],
    repeats: int,
    progress: bool = True,
    on_run: Callable[[Results, dict[str, str]], None] | None = None,
) -> tuple[Results, dict[str, str]]:
    """Every repetition of every contender: (contender name -> worker results in run order, contender name ->
    the error that stopped it). ``on_run(results, failures)`` is called after each run. A user error
    (``BenchError``: the same data fails every contender) still ends the bench at once."""
    from tqdm.auto import tqdm

    order = schedule(contenders, repeats)
    results: Results = {c.name: [] for c in contenders}
    failures: dict[str, str] = {}
    # The bar counts the steps of every run (runs x --steps); the description says which run and which of its
    # own steps, so that `--steps 4` reads "step 4/4" and the total is labelled as the sum over runs.
    bar_format = "{desc}|{bar}| {n_fmt}/{total_fmt} steps of all runs [{elapsed}<{remaining}]"
    bar = tqdm(total=len(order) * config.steps, disable=not progress, file=sys.stderr, dynamic_ncols=True,
               desc="starting", bar_format=bar_format)  # fmt: skip
    try:
        with tempfile.TemporaryDirectory(prefix="fasttrain-bench-") as workdir:
            for index, (round_index, contender) in enumerate(order):
                if contender.name in failures:  # it crashed once: the next repetition would too
                    bar.update(config.steps)
                    continue
                label = (
                    f"run {index + 1}/{len(order)} ({contender.name}, repetition {round_index + 1}/{repeats})"
                )
                bar.set_description(f"{label}, step 0/{config.steps}")
                started = time.perf_counter()
                done_before = bar.n

                def on_step(count: int, label=label, done_before=done_before) -> None:
                    done = bar.n + count - done_before
                    warmup = " (warm-up)" if done <= config.warmup_steps else ""
                    bar.set_description(f"{label}, step {done}/{config.steps}{warmup}", refresh=False)
                    bar.update(count)

                try:
                    result = run_one(config, contender, workdir, f"{index:02d}-{contender.name}", on_step)
                except RunFailed as exc:
                    failures[contender.name] = str(exc)
                    print(f"fasttrain bench: {contender.name} failed; going on without it", file=sys.stderr)
                else:
                    result.update(wall_s=time.perf_counter() - started, round=round_index)
                    results[contender.name].append(result)
                # a run that failed or ended early (it should not) still leaves the bar consistent
                bar.update(max(0, config.steps - (bar.n - done_before)))
                if on_run is not None:
                    on_run(results, failures)
    finally:
        bar.close()
    return results, failures
