"""Compile fasttrain's Triton kernels for an H100/H200 (sm_90) without a GPU: Triton's compiler and ptxas run on CPU.

    python tests/_compile_kernels_sm90.py [--all | --each-value] [--jobs N] [--only MODULE.KERNEL]

Every entry point and variant space comes from tests/_kernel_variants.py; first it checks that this list covers
every ``@triton.jit`` entry point of kernels/ (exit 3 when it does not). Default: the pairwise-covering subset of
each kernel's variants; ``--each-value``: a subset with every value of every parameter once (quicker);
``--all``: every variant (thousands: hours). Prints one JSON line per compiled variant
(with the number of 128-bit global loads in its PTX) and a last line ``{"done": ...}``; exit 1 if any failed,
each failure printed with its variant and Triton's error.

Run in a process without TRITON_INTERPRET (tests/test_kernels_compile.py does): the interpreter replaces the
compiler. ``benchmarks/gpu/run.sh --smoke`` also runs it, in the replica of the GPU machine's versions.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import importlib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

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
    row = {"kernel": spec_key, **variant}
    started = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(fn=getattr(module, spec.name), signature=sig, constexprs=consts),
            target=GPUTarget(*SM90),
            options={"num_warps": warps},
        )
    except Exception as exc:  # the point: report every failing variant with Triton's message
        row["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        row["traceback"] = traceback.format_exc()[-6000:]
        return row
    row["v4_loads"] = len(re.findall(r"ld\.global[^\n]*\.v4", compiled.asm["ptx"]))
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every variant, not the pairwise-covering subset")
    which.add_argument("--each-value", action="store_true", help="every value of every parameter once")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiling processes")
    parser.add_argument("--only", action="append", default=[], help="MODULE.KERNEL (repeatable)")
    args = parser.parse_args()

    problems = V.uncovered(V.inventory())
    if problems:
        print(
            "kernels not covered by tests/_kernel_variants.py:\n  " + "\n  ".join(problems), file=sys.stderr
        )
        return 3
    specs = [s for s in V.KERNELS if not args.only or s.key in args.only]
    jobs = [
        (s.key, v)
        for s in specs
        for v in (V.all_variants(s) if args.all else V.covering(s, 1 if args.each_value else 2))
    ]
    failed = 0
    started = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for row in pool.map(_compile, *zip(*jobs, strict=True)):
            trace = row.pop("traceback", None)
            failed += trace is not None
            print(json.dumps(row), flush=True)
            if trace is not None:
                print(f"FAILED {json.dumps(row)}\n{trace}", file=sys.stderr, flush=True)
    summary = {"done": len(jobs), "failed": failed, "seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
