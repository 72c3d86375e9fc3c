"""Compile fasttrain's Triton kernels for an H100/H200 (sm_90) without a GPU: Triton's compiler and ptxas run on CPU.

    python tests/_compile_kernels_sm90.py [--all | --each-value | --defaults] [--jobs N] [--only MODULE.KERNEL]
                                          [--table benchmarks/results/kernels_sm90.md [--render]]

Every entry point and variant space comes from tests/_kernel_variants.py; first it checks that this list covers
every ``@triton.jit`` entry point of kernels/ (exit 3 when it does not). Default: the pairwise-covering subset of
each kernel's variants; ``--each-value``: a subset with every value of every parameter once (quicker);
``--all``: every variant (thousands: hours); ``--defaults``: only the default variants (``_kernel_variants.defaults``:
what the launchers start for the package's usual settings). Prints one JSON line per compiled variant and a last
line ``{"done": ...}``; exit 1 if any failed, each failure printed with its variant and Triton's error.

Each line holds the variant, ``default`` (one of the default variants), ``num_warps``, the number of 128-bit global
loads in its PTX (``v4_loads``) and what one program uses on an sm_90: ``regs`` (registers per thread),
``spill_stores`` / ``spill_loads`` and ``stack`` (bytes per thread), from ``ptxas -v`` (Triton's own ptxas and
flags: its ``make_cubin`` run again on the PTX with ``TRITON_DUMP_PTXAS_LOG``; a CompiledKernel's ``n_regs`` and
``n_spills`` are only filled when it is loaded on a GPU), and ``shared`` (bytes: Triton's allocation,
``metadata.shared``, plus any static shared memory ptxas reports).

``--table PATH.md`` also compiles the default variants and writes the table of these numbers (PATH.md, and
PATH.json for machines): one section per kernel, one column group per Triton version. The JSON keeps one run per
Triton version: running it again with another Triton (CI's replica of the GPU machine: ``bash .ci/env gpu``) adds
that version's columns, with the same version replaces them; ``--render`` only rewrites PATH.md from PATH.json.
The committed table (benchmarks/results/kernels_sm90.md) is, at the repository's root:

    TRITON_DEFAULT_FP_FUSION=1 .venv/bin/python tests/_compile_kernels_sm90.py --each-value --table PATH.md
    TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=python $(bash .ci/env gpu) tests/_compile_kernels_sm90.py --each-value \
        --table PATH.md

Run in a process without TRITON_INTERPRET (tests/test_kernels_compile.py does): the interpreter replaces the
compiler. ``benchmarks/gpu/run.sh --smoke`` also runs it, in the replica of the GPU machine's versions.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import functools
import importlib
import io
import json
import os
import platform
import re
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _kernel_variants as V

SM90 = ("cuda", 90, 32)


def _compile(spec_key: str, variant: dict) -> dict:
    """Compile one variant in this process; the result row (or the error) as a dict."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = next(s for s in V.KERNELS if s.key == spec_key)
    module = importlib.import_module(f"fasttrain.kernels.{spec.module}")
    sig, consts = V.signature(spec, variant)
    consts.update(spec.fixed(module))
    sig.update(dict.fromkeys((k for k in consts if k not in sig), "constexpr"))
    warps = spec.num_warps(variant)
    if isinstance(warps, str):  # the launcher's own constant, e.g. "NUM_WARPS" or "base.NUM_WARPS"
        warps = functools.reduce(getattr, warps.split("."), module)
    row = {"kernel": spec_key, **variant, "default": variant in V.defaults(spec_key), "num_warps": warps}
    started = time.perf_counter()
    try:
        src = ASTSource(fn=getattr(module, spec.name), signature=sig, constexprs=consts)
        compiled = triton.compile(src, target=GPUTarget(*SM90), options={"num_warps": warps})
        row["v4_loads"] = len(re.findall(r"ld\.global[^\n]*\.v4", compiled.asm["ptx"]))
        row.update(_ptxas_usage(src, compiled, warps))
    except Exception as exc:  # the point: report every failing variant with Triton's message
        row["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        row["traceback"] = traceback.format_exc()[-6000:]
        return row
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


# What ptxas -v says of each function it compiles: the entry function, then any function it calls that stayed a
# call (libdevice's pow in the AdamW kernels), e.g. (CUDA 12.8 and 13.x):
#   ptxas info    : Compiling entry function '_adamw_kernel' for 'sm_90a'
#   ptxas info    : Function properties for _adamw_kernel
#       16 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads
#   ptxas info    : Used 72 registers, used 1 barriers, 16 bytes cumulative stack size   (", N bytes smem" if any)
#   ptxas info    : Function properties for __internal_accurate_pow
#       0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
_PROPERTIES = re.compile(
    r"Function properties for (\S+)\s+(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)


def _ptxas_usage(src: Any, compiled: Any, warps: int) -> dict[str, int]:
    """Registers, spills and stack of a compiled variant from ptxas -v, and its shared memory.

    Triton runs ptxas -v itself but keeps the log only while TRITON_DUMP_PTXAS_LOG is set, and not at all when the
    kernel came from its cache; so its ``make_cubin`` (Triton's ptxas, Triton's flags) runs again here on the PTX,
    with the log on. Triton 3.6 and 3.9 both have ``make_cubin(src, metadata, options, capability)`` and the knob.
    ``regs`` and ``stack`` are the entry function's; the spills add up those of the functions it calls.
    """
    from triton import knobs
    from triton.compiler.compiler import make_backend

    backend = make_backend(compiled.metadata.target)
    options = backend.parse_options(dict({"num_warps": warps}, **src.parse_options()))
    log = io.StringIO()
    saved = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            backend.make_cubin(compiled.asm["ptx"], {}, options, compiled.metadata.target.arch)
    finally:
        knobs.nvidia.dump_ptxas_log = saved
    text = log.getvalue()
    functions = {name: tuple(map(int, numbers)) for name, *numbers in _PROPERTIES.findall(text)}
    regs = re.findall(r"Used (\d+) registers", text)
    entry = compiled.metadata.name
    if entry not in functions or len(regs) != 1:
        raise RuntimeError(f"ptxas -v: no properties or no register count of {entry} in its log:\n{text}")
    static_smem = re.findall(r"(\d+) bytes smem", text)
    return {
        "regs": int(regs[0]),
        "spill_stores": sum(f[1] for f in functions.values()),
        "spill_loads": sum(f[2] for f in functions.values()),
        "stack": functions[entry][0],
        "shared": int(compiled.metadata.shared) + sum(map(int, static_smem)),
    }


def _versions() -> dict[str, str]:
    """Triton's, its ptxas's (the one sm_90 uses) and Python's versions."""
    import triton
    from triton.backends.nvidia import compiler

    out = compiler.get_ptxas_version(SM90[1])
    release = re.search(r"V(\d+(?:\.\d+)+)", out)
    name = Path(compiler.get_ptxas(SM90[1]).path).name
    return {
        "triton": triton.__version__,
        "ptxas": f"{name} {release.group(1) if release else out.strip().splitlines()[-1]}",
        "python": platform.python_version(),
    }


def _defaults() -> dict[str, list[dict]]:
    """Each kernel's default variants (run in a worker: the launchers import torch)."""
    return {s.key: list(V.defaults(s.key)) for s in V.KERNELS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every variant, not the pairwise-covering subset")
    which.add_argument("--each-value", action="store_true", help="every value of every parameter once")
    which.add_argument("--defaults", action="store_true", help="only the default variants")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiling processes")
    parser.add_argument("--only", action="append", default=[], help="MODULE.KERNEL (repeatable)")
    parser.add_argument("--table", type=Path, help="write this Markdown table and its .json (defaults added)")
    parser.add_argument("--render", action="store_true", help="only rewrite --table from its .json")
    args = parser.parse_args()
    if args.render and args.table:
        runs = json.loads(args.table.with_suffix(".json").read_text())["runs"]
        args.table.write_text(render_table(runs))
        return 0

    problems = V.uncovered(V.inventory())
    if problems:
        print(
            "kernels not covered by tests/_kernel_variants.py:\n  " + "\n  ".join(problems), file=sys.stderr
        )
        return 3
    specs = [s for s in V.KERNELS if not args.only or s.key in args.only]
    failed = 0
    rows = []
    started = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        versions = pool.submit(_versions)
        defaults = pool.submit(_defaults).result()
        jobs = []
        for s in specs:
            if args.defaults:
                chosen = list(defaults[s.key])
            else:
                chosen = V.all_variants(s) if args.all else V.covering(s, 1 if args.each_value else 2)
                if args.table:
                    chosen = [d for d in defaults[s.key] if d not in chosen] + chosen
            jobs.extend((s.key, v) for v in chosen)
        for row in pool.map(_compile, *zip(*jobs, strict=True)):
            trace = row.pop("traceback", None)
            failed += trace is not None
            rows.append(row)
            print(json.dumps(row), flush=True)
            if trace is not None:
                print(f"FAILED {json.dumps(row)}\n{trace}", file=sys.stderr, flush=True)
        summary = {"done": len(jobs), "failed": failed, "seconds": round(time.perf_counter() - started, 1)}
        summary.update(versions.result())
    print(json.dumps(summary), flush=True)
    if args.table and not failed:
        modes = (
            ("all", args.all),
            ("defaults", args.defaults),
            ("each-value", args.each_value),
            ("pairwise", True),
        )
        selection = next(name for name, on in modes if on)
        run = {
            **versions.result(),
            "date": datetime.date.today().isoformat(),
            "command": _command(),
            "selection": selection,
            "rows": [{k: v for k, v in r.items() if k != "seconds"} for r in rows],
        }
        write_table(args.table, run)
    return 1 if failed else 0


def _command() -> str:
    """This run's command line as one would type it at the repository's root."""
    python = Path(sys.executable)
    with contextlib.suppress(ValueError):
        python = python.absolute().relative_to(Path.cwd())
    env = [f"{k}={os.environ[k]}" for k in ("PYTHONPATH", "TRITON_DEFAULT_FP_FUSION") if k in os.environ]
    return shlex.join([*env, str(python), "tests/_compile_kernels_sm90.py", *sys.argv[1:]])


# ------------------------------------------------------------------------------------------------
# the committed table (benchmarks/results/kernels_sm90.md and .json)
# ------------------------------------------------------------------------------------------------

_KINDS = {0: "fp32", 1: "bf16", 2: "fp16"}
_RESULT_KEYS = {"kernel", "default", "num_warps", "v4_loads", "regs", "spill_stores", "spill_loads", "stack"}
_RESULT_KEYS |= {"shared", "seconds"}


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in re.split(r"[.+]", version))


def write_table(path: Path, run: dict) -> None:
    """Merge ``run`` into PATH.json (one run per Triton version) and write PATH.md from every run in it."""
    data_path = path.with_suffix(".json")
    runs = []
    if data_path.exists():
        runs = [r for r in json.loads(data_path.read_text())["runs"] if r["triton"] != run["triton"]]
    runs = sorted([*runs, run], key=lambda r: _version_key(r["triton"]))
    data_path.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    path.write_text(render_table(runs))


def _variant_text(row: dict) -> str:
    parts = []
    params = [k for k in row if k not in _RESULT_KEYS and k != "error"]
    for key in sorted(params, key=lambda k: (not k.endswith("_KIND"), k != "logits")):  # dtypes first
        value = row[key]
        if key.endswith("_KIND"):
            parts.append(f"{key[0]}={_KINDS.get(value, value)}")
        elif value is True:
            parts.append(key)
        elif value is not False and value != "i32":  # False flags and runtime ints are the unmarked case
            parts.append(f"{key}={value.lstrip('*') if isinstance(value, str) else value}")
    return " ".join(parts) or "(any)"


def _spills(row: dict) -> str:
    if not row["spill_stores"] and not row["spill_loads"]:
        return "0"
    return f"**{row['spill_stores']} / {row['spill_loads']}**"


def render_table(runs: list[dict]) -> str:
    lines = [
        "# fasttrain's Triton kernels on sm_90 (H100/H200): registers, spills, shared memory",
        "",
        "Compiled on CPU, without a GPU, by tests/_compile_kernels_sm90.py (Triton's compiler and its bundled ptxas),",
        "from tests/_kernel_variants.py's variants. **default**: a variant the launchers start for the package's usual",
        "settings (`_kernel_variants.defaults`); tests/test_kernels_compile.py fails when one of those spills.",
        "Per program: `regs` registers per thread and `spills` bytes of spill stores / loads per thread (ptxas -v),",
        "`smem` bytes of shared memory (Triton's allocation plus ptxas's static). Variants: `P`, `G`, `M` are the",
        "parameter, gradient and moment dtypes, a flag named is on, one not named is off; `n_tensors=1`: a",
        "one-tensor launch (Triton folds the constant). The GPU machine runs Triton 3.6 (.ci/gpu-machine.txt);",
        "CI's replica of it (`bash .ci/env gpu`, then `PYTHONPATH=python`) adds its columns.",
        "",
        "| Triton | ptxas | Python | date | variants | default variants | max regs | max regs (default) | spilling (default) | command |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        rows = run["rows"]
        defaults = [r for r in rows if r["default"]]
        spilling = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
        lines.append(
            f"| {run['triton']} | {run['ptxas']} | {run['python']} | {run['date']} | {len(rows)} | {len(defaults)}"
            f" | {max(r['regs'] for r in rows)} | {max((r['regs'] for r in defaults), default='-')}"
            f" | {len(spilling)} ({sum(r['default'] for r in spilling)}) | `{run['command']}` |"
        )
    spilling = [(run, r) for run in runs for r in run["rows"] if r["spill_stores"] or r["spill_loads"]]
    if spilling:
        lines += [
            "",
            "Variants that spill (bytes per thread; `stack`: the entry function's stack frame). Those that are",
            "default variants, and why they are accepted, are tests/test_kernels_compile.py's `KNOWN_SPILLS`.",
            "",
            "| Triton | kernel | variant | default | regs | spill stores | spill loads | stack |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {run['triton']} | {r['kernel']} | `{_variant_text(r)}` | {'yes' if r['default'] else ''} | {r['regs']}"
            f" | {r['spill_stores']} | {r['spill_loads']} | {r['stack']} |"
            for run, r in spilling
        ]
    kernels = list(dict.fromkeys(r["kernel"] for run in runs for r in run["rows"]))
    for kernel in kernels:
        variants: dict[str, dict] = {}  # variant text -> {triton version: row}
        for run in runs:
            for r in run["rows"]:
                if r["kernel"] == kernel:
                    variants.setdefault(_variant_text(r), {})[run["triton"]] = r
        order = sorted(variants, key=lambda v: not any(r["default"] for r in variants[v].values()))
        head = ["variant", "default", "warps"]
        for run in runs:
            head += [f"regs {run['triton']}", f"spills {run['triton']}", f"smem {run['triton']}"]
        lines += ["", f"## {kernel}", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for text in order:
            by_version = variants[text]
            first = next(iter(by_version.values()))
            cells = [f"`{text}`", "yes" if first["default"] else "", str(first["num_warps"])]
            for run in runs:
                r = by_version.get(run["triton"])
                cells += ["-"] * 3 if r is None else [str(r["regs"]), _spills(r), str(r["shared"])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
