"""Where a measurement came from (docs/method.md, "Provenance"): ``record()``, what `fasttrain bench`, every
script under benchmarks/ and the GPU proof write beside their figures; and ``timed()``, the one timer.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The packages whose versions decide a figure; a caller adds its own (a client framework, bitsandbytes, ...)
PACKAGES = ("fasttrain", "torch", "triton", "transformers", "accelerate", "tokenizers", "datasets", "trl")
_SOURCE = Path(__file__).resolve().parents[3]  # the checkout holding python/fasttrain, in an editable install


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what ``platform`` knows."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def machine() -> dict[str, Any]:
    """CPU, cores, memory, platform and, where CUDA is available, the GPU."""
    memory_gib = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    out: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),  # those this process may run on (Linux only, docs/support.md)
        "memory_gib": memory_gib,
        "platform": platform.platform(),
    }
    torch = sys.modules.get("torch")  # only when the caller imported it: provenance never pays torch's import
    if torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out["gpu"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
        out["gpus"] = torch.cuda.device_count()
    return out


def versions(*extra: str) -> dict[str, str | None]:
    """Python's version and each package's (None where it is not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in (*PACKAGES, *extra):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(where: Path = _SOURCE) -> str | None:
    """The commit of the checkout fasttrain runs from, with "+dirty" where files differ from it; else the
    FASTTRAIN_COMMIT a copy without .git was given (the GPU kit's wheels carry it); None without either."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("FASTTRAIN_COMMIT") or None
    return commit + ("+dirty" if dirty else "")


def command() -> str:
    """The command that produced a result, as one would retype it from the repository root."""
    argv0 = Path(sys.argv[0])
    if argv0.name in ("fasttrain", "__main__.py", "cli.py"):
        return shlex.join(["fasttrain", *sys.argv[1:]])
    script = argv0.resolve()
    with contextlib.suppress(ValueError):  # a script outside the repository keeps its path as given
        script = script.relative_to(_SOURCE)
    # an interpreter of the repository's other environments (.ci-envs/llamafactory/...) is part of the command
    python = Path(sys.executable)
    own = python.is_relative_to(_SOURCE) and not python.is_relative_to(_SOURCE / ".venv")
    interpreter = str(python.relative_to(_SOURCE)) if own else "python"
    return shlex.join([interpreter, str(script), *sys.argv[1:]])


def record(*packages: str, command_line: str | None = None) -> dict[str, Any]:
    """The provenance block of a result file: date, command (``command_line``, else this process's), commit,
    machine, load at the start, versions."""
    return {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line or command(),
        "commit": git_commit(),
        "machine": machine(),
        "load_1min_at_start": load_average(),
        "versions": versions(*packages),
    }


def markdown(prov: dict[str, Any]) -> str:
    """Provenance as the lines a result's Markdown opens with."""
    m = prov["machine"]
    gpu = f"; {m['gpu']}" if "gpu" in m else ""
    lines = [
        f"- measured {prov['date_utc']} at commit {prov['commit'] or 'unknown (not a git checkout)'}",
        f"- command: `{prov['command']}`",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB{gpu}; load average "
        f"{prov['load_1min_at_start']} at the start",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in prov["versions"].items() if v),
    ]
    return "\n".join(lines)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The garbage collector run before and off during a timed call, as timeit does: otherwise a collection of
    one side's garbage lands on whichever side allocates next."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def timed(fn: Callable[[], Any], device: str = "cpu") -> float:
    """Seconds one call of ``fn`` takes: CUDA events on a GPU, the wall clock on CPU; the collector paused."""
    with gc_paused():
        if device.startswith("cuda"):
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
