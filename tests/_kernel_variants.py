"""Every Triton kernel the package launches, and every compile-time variant of it (no triton import here).

``KERNELS`` lists each ``@triton.jit`` entry point of ``kernels/`` (a kernel no other kernel calls: the ones the
launchers start) with its runtime signature and its variant space: each constexpr, each argument whose type
changes with the launch (a tensor's dtype, an int that Triton specializes when it equals 1), and the values the
launchers can pass. ``tests/_compile_kernels_sm90.py`` compiles them for sm_90; ``inventory()`` reads the
kernels' source so that a test fails when a kernel or a constexpr appears that this file does not describe.

The whole product of a kernel's variant space (``all_variants``) is large (AdamW: thousands); ``pairwise``
picks a subset in which every value of every parameter, and every pair of values of any two parameters, appears
at least once: compile errors come from one feature or from two interacting (a variable typed differently in two
branches), and that subset (118 variants) compiles in about 2 minutes on two cores. ``covering(spec, 1)``, every
value once (about 40 variants), is the quicker check that ``benchmarks/gpu/run.sh --smoke`` runs with the GPU
machine's Triton version.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"

BOOL = (False, True)
FLOAT_KINDS = (0, 1, 2)  # kernels/adamw.py DTYPE_CODES: fp32, bf16, fp16
FLOAT_POINTERS = ("*fp32", "*bf16", "*fp16")  # a logits tensor of each float dtype
# An int argument equal to 1 is compiled as the constant 1 (Triton specializes it): both are variants.
INT_OR_ONE = ("i32", 1)
# lm_head.pick_block_v: a power of two from 16 to 4,096; 8 warps from 2,048 up
BLOCK_V = tuple(2**k for k in range(4, 13))


def block_v_warps(variant: dict[str, Any]) -> int:
    return 8 if variant["BLOCK_V"] >= 2048 else 4


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    module: str  # file under kernels/, without .py
    name: str
    signature: dict[str, str]  # runtime arguments: Triton type, or the name of a variant parameter
    space: dict[str, tuple]  # variant parameters (constexprs, argument types) and their possible values
    fixed: Callable[[Any], dict[str, Any]]  # constexprs with one value, from the imported kernel module
    num_warps: Callable[[dict[str, Any]], int | str]  # an int, or a (dotted) attribute of the kernel module
    valid: Callable[[dict[str, Any]], bool] = lambda v: True

    @property
    def key(self) -> str:
        return f"{self.module}.{self.name}"


def _adamw_valid(v: dict[str, Any]) -> bool:
    # moments in the parameter's dtype or fp32 (state_dtype); stochastic rounding of bf16 parameters only
    return v.get("M_KIND", 0) in (0, v["P_KIND"]) and (not v["SR"] or v["P_KIND"] == 1)


_MULTI_TENSOR = {
    "addr_ptr": "*i64", "numel_ptr": "*i64", "work_tensor_ptr": "*i64", "work_start_ptr": "*i64",
    "salt_ptr": "*i64", "n_tensors": "n_tensors",
}  # fmt: skip
_STEP = {
    "lr": "lr", "betas_ptr": "*fp64", "eps": "fp32", "weight_decay": "fp32", "clip_ptr": "*fp32",
    "grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32", "seed": "i32",
}  # fmt: skip
_STEP_SPACE = {
    "P_KIND": FLOAT_KINDS, "G_KIND": FLOAT_KINDS, "ALIGNED": BOOL, "LR_IS_TENSOR": BOOL, "HAS_CLIP": BOOL,
    "HAS_GRAD_SCALE": BOOL, "HAS_FOUND_INF": BOOL, "AMSGRAD": BOOL, "MAXIMIZE": BOOL, "SR": BOOL,
    "n_tensors": INT_OR_ONE,
}  # fmt: skip


def _adamw_fixed(m: Any) -> dict[str, Any]:
    # USE_LIBDEVICE is False only under the interpreter; CHUNK_SIZE is tuned only by tests and benchmarks
    return {"USE_LIBDEVICE": True, "CHUNK_SIZE": m.CHUNK, "BLOCK_SIZE": m.BLOCK}


def _adamw8_fixed(m: Any) -> dict[str, Any]:
    return {"USE_LIBDEVICE": True, "CHUNK_SIZE": m.base.CHUNK, "BLOCK_SIZE": m.base.BLOCK}


_ROW = {"logits_ptr": "logits", "logits_row_stride": "i32", "labels_ptr": "*i64"}

KERNELS = [
    KernelSpec(
        "adamw", "_adamw_kernel", {**_MULTI_TENSOR, **_STEP},
        {**_STEP_SPACE, "M_KIND": FLOAT_KINDS}, _adamw_fixed, lambda v: "NUM_WARPS", _adamw_valid,
    ),
    KernelSpec(
        "adamw8bit", "_adamw8bit_kernel", {**_MULTI_TENSOR, "maps_ptr": "*fp32", **_STEP},
        _STEP_SPACE, _adamw8_fixed, lambda v: "base.NUM_WARPS", _adamw_valid,
    ),
    KernelSpec(
        "adamw", "_norm_partial_kernel",
        {"addr_ptr": "*i64", "numel_ptr": "*i64", "work_tensor_ptr": "*i64", "work_start_ptr": "*i64",
         "partial_ptr": "*fp32"},
        {"G_KIND": FLOAT_KINDS, "ALIGNED": BOOL, "NORM_INF": BOOL},
        lambda m: {"CHUNK_SIZE": m.CHUNK, "BLOCK_SIZE": m.BLOCK}, lambda v: "NUM_WARPS",
    ),
    KernelSpec(
        "adamw", "_norm_per_tensor_kernel", {"partial_ptr": "*fp32", "first_chunk_ptr": "*i64", "out_ptr": "*fp32"},
        {"NORM_INF": BOOL}, lambda m: {"BLOCK_SIZE": m.BLOCK}, lambda v: "NUM_WARPS",
    ),
    KernelSpec(
        "lm_head", "_row_stats_kernel",
        {**_ROW, "log_z_ptr": "*fp32", "target_ptr": "*fp32", "sum_z_ptr": "*fp32", "entropy_ptr": "*fp32",
         "log_sum_sq_ptr": "*fp32", "top1_ptr": "top1", "n_cols": "i32", "ignore_index": "i32",
         "logit_scale": "fp32", "softcap": "fp32", "inv_t": "fp32"},
        {"logits": FLOAT_POINTERS, "HAS_SOFTCAP": BOOL, "HAS_SUM": BOOL, "HAS_ENTROPY": BOOL,
         "HAS_LOG_SUM_SQ": BOOL, "HAS_TOP1": BOOL, "BLOCK_V": BLOCK_V},
        lambda m: {}, block_v_warps,
    ),
    KernelSpec(
        "lm_head", "_row_grad_kernel",
        {**_ROW, "log_z_ptr": "*fp32", "entropy_ptr": "*fp32", "coef_ptr": "*fp32", "n_cols": "i32",
         "ignore_index": "i32", "logit_scale": "fp32", "softcap": "fp32", "inv_t": "fp32"},
        {"logits": FLOAT_POINTERS, "HAS_SOFTCAP": BOOL, "HAS_ENT_GRAD": BOOL, "BLOCK_V": BLOCK_V},
        lambda m: {}, block_v_warps,
    ),
]  # fmt: skip

# Argument types that follow a variant parameter: the parameter's value, mapped here when it is not a type.
_TYPE_OF = {
    "top1": lambda v: "*i8" if v["HAS_TOP1"] else "*fp32",
    "lr": lambda v: "*fp32" if v["LR_IS_TENSOR"] else "fp32",
}


def signature(spec: KernelSpec, variant: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """(Triton signature, constexpr values) of one variant; constants folded by specialization included."""
    sig: dict[str, str] = {}
    consts = {k: v for k, v in variant.items() if k.isupper()}
    for arg, kind in spec.signature.items():
        if kind in _TYPE_OF:
            kind = _TYPE_OF[kind](variant)
        elif kind in variant:
            kind = variant[kind]
        if isinstance(kind, int):  # an int Triton folds into the kernel
            sig[arg] = "constexpr"
            consts[arg] = kind
        else:
            sig[arg] = kind
    return sig, consts


def all_variants(spec: KernelSpec) -> list[dict[str, Any]]:
    names = list(spec.space)
    product = (dict(zip(names, values, strict=True)) for values in itertools.product(*spec.space.values()))
    return [v for v in product if spec.valid(v)]


def _pairs(variant: dict[str, Any], strength: int = 2) -> set[tuple]:
    """The values (strength 1), or the values and the pairs of values (strength 2), that a variant exercises."""
    items = sorted(variant.items())
    singles = {(a,) for a in items}
    return singles if strength == 1 else singles | set(itertools.combinations(items, 2))


def covering(spec: KernelSpec, strength: int = 2) -> list[dict[str, Any]]:
    """A small subset of ``all_variants`` in which every value (strength 1), or also every valid pair of
    values (strength 2, the default: ``pairwise``), appears at least once; chosen greedily, deterministically."""
    candidates = all_variants(spec)
    covers = [_pairs(v, strength) for v in candidates]
    uncovered = set().union(*covers)
    chosen = []
    while uncovered:
        best = max(range(len(candidates)), key=lambda i: len(covers[i] & uncovered))
        chosen.append(candidates[best])
        uncovered -= covers[best]
    return chosen


def pairwise(spec: KernelSpec) -> list[dict[str, Any]]:
    return covering(spec, 2)


# ------------------------------------------------------------------------------------------------
# inventory: what the kernels' source defines
# ------------------------------------------------------------------------------------------------


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (
        isinstance(target, ast.Attribute)
        and target.attr == "jit"
        and getattr(target.value, "id", "") == "triton"
    )


def inventory(kernels_dir: Path = KERNELS_DIR) -> dict[str, dict[str, list[str]]]:
    """Every entry point in ``kernels_dir``: "module.name" -> {"args": runtime arguments, "constexprs": ...}.

    An entry point is a ``@triton.jit`` function that no ``@triton.jit`` function calls; the others are helpers
    inlined into the entry points that call them, so compiling the entry points compiles them too.
    """
    jitted: dict[str, ast.FunctionDef] = {}
    called: set[str] = set()
    for path in sorted(kernels_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and any(_is_triton_jit(d) for d in node.decorator_list):
                jitted[f"{path.stem}.{node.name}"] = node
    for node in jitted.values():
        for call in ast.walk(node):
            if isinstance(call, ast.Call):
                callee = call.func
                called.add(callee.id if isinstance(callee, ast.Name) else getattr(callee, "attr", ""))
    out = {}
    for key, node in jitted.items():
        if node.name in called:
            continue
        args = node.args.args
        is_const = [
            isinstance(a.annotation, ast.Attribute) and a.annotation.attr == "constexpr" for a in args
        ]
        out[key] = {
            "args": [a.arg for a, c in zip(args, is_const, strict=True) if not c],
            "constexprs": [a.arg for a, c in zip(args, is_const, strict=True) if c],
        }
    return out


def uncovered(found: dict[str, dict[str, list[str]]], specs: list[KernelSpec] = KERNELS) -> list[str]:
    """What ``found`` (an ``inventory()``) has that ``specs`` do not describe: one line per problem."""
    by_key = {s.key: s for s in specs}
    problems = []
    for key, parts in sorted(found.items()):
        spec = by_key.get(key)
        if spec is None:
            problems.append(f"{key}: a @triton.jit entry point that tests/_kernel_variants.py does not list")
            continue
        if parts["args"] != list(spec.signature):
            problems.append(
                f"{key}: arguments {parts['args']} != the listed signature {list(spec.signature)}"
            )
        listed = {k for k in spec.space if k.isupper()} | set(_fixed_names(spec))
        if set(parts["constexprs"]) != listed:
            problems.append(f"{key}: constexprs {sorted(parts['constexprs'])} != the listed {sorted(listed)}")
    for key in sorted(set(by_key) - set(found)):
        problems.append(f"{key}: listed in tests/_kernel_variants.py but not an entry point in kernels/")
    return problems


class _AnyAttribute:
    """Stands in for a kernel module when only the names of a spec's fixed constexprs are wanted."""

    def __getattr__(self, name: str) -> _AnyAttribute:
        return self


def _fixed_names(spec: KernelSpec) -> list[str]:
    return list(spec.fixed(_AnyAttribute()))
