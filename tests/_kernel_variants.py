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

``defaults(key)``: the default variants, those the launchers start for the package's usual settings (``USUAL_*``
below), read from kernels/'s launchers themselves (``launched_variants`` runs them with recorders in place of the
kernels: that one imports torch and the kernel modules); tests/test_kernels_compile.py fails when one spills.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

KERNELS_DIR = Path(__file__).resolve().parents[1] / "python" / "fasttrain" / "kernels"

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
    "salt_ptr": "*i64", "offset_ptr": "*i64", "n_tensors": "n_tensors",
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

KERNELS_BY_KEY = {s.key: s for s in KERNELS}

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
# default variants: what the launchers start for the package's usual settings
# ------------------------------------------------------------------------------------------------

# The usual settings, each one a choice the package or a Trainer with default arguments makes; everything else
# (constexprs, num_warps, BLOCK_V, alignment, which kernels a call starts) is read from the launchers themselves:
# ``launched_variants`` runs kernels/'s plain launchers on CPU tensors with every kernel replaced by a recorder.
#
# - parameters in fp32 (a Trainer's master weights under bf16 autocast) or bf16 (a model loaded in bf16);
#   gradients in the parameters' dtype; FusedAdamW's defaults: moments in the parameters' dtype (state_dtype
#   None), no amsgrad, maximize or stochastic rounding, lr a float; with and without the deferred clip (a
#   Trainer's max_grad_norm=1.0 arms it); no GradScaler (fp16 AMP is not the usual path). The 8-bit kernel with
#   the same settings: the variants ``state_dtype="8bit"`` launches (opt-in, but then these are the usual ones).
# - the global 2-norm of gradients in those dtypes (clip_grad_norm_'s default norm_type).
# - LM-head logits in bf16 (autocast) or fp32, the vocabularies of the families fasttrain serves, the head
#   transform's defaults (scale and temperature 1, no softcap but Gemma-2's): the cross-entropy loss (row_stats
#   with no optional statistic: label_smoothing 0; then row_grad) and TRL's token log-probs with the entropy
#   (GRPO asks for it).
USUAL_PARAM_DTYPES = ("float32", "bfloat16")
USUAL_LOGIT_DTYPES = ("bfloat16", "float32")
# families.py's families: Llama-2/Mistral, Phi-3, OLMo-2, Llama-3, Qwen2/3, Gemma/Gemma-2, Gemma-3
USUAL_VOCABS = (32000, 32064, 100352, 128256, 151936, 256000, 262144)
SOFTCAP_VOCABS = (256000,)  # Gemma-2 soft-caps its logits (final_logit_softcapping=30)
_TENSOR_SIZES = (4096, 100_003)  # a norm weight and a matrix with a tail chunk: the group has many tensors


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: self.calls.append((self.name, args, kwargs))


def _adamw_launches(m: Any, torch: Any) -> None:
    cpu = torch.device("cpu")
    betas = torch.tensor([0.9, 0.999, 0.1, 0.001], dtype=torch.float64)
    steps = [torch.ones((), dtype=torch.float32) for _ in _TENSOR_SIZES]
    for name in USUAL_PARAM_DTYPES:
        dtype = getattr(torch, name)
        tensors = [[torch.zeros(n, dtype=dtype) for n in _TENSOR_SIZES] for _ in range(4)]
        for clip in (None, torch.ones((), dtype=torch.float32)):
            args = m.StepArgs(lr=1e-3, betas=betas, eps=1e-8, weight_decay=0.0, clip_coef=clip)
            table = m.TensorTable([*tensors, [None] * len(steps), steps], cpu)
            m.adamw_step(table, dtype, dtype, dtype, args)  # moments in the parameters' dtype
        m.per_tensor_norms(m.TensorTable([tensors[1]], cpu), dtype, 2.0)


def _adamw8bit_launches(m: Any, torch: Any) -> None:
    cpu = torch.device("cpu")
    betas = torch.tensor([0.9, 0.999, 0.1, 0.001], dtype=torch.float64)
    steps = [torch.ones((), dtype=torch.float32) for _ in _TENSOR_SIZES]
    none = [None] * len(_TENSOR_SIZES)
    codes = [[torch.zeros(n, dtype=torch.uint8) for n in _TENSOR_SIZES] for _ in range(2)]
    absmax = [[torch.zeros(-(-n // m.QBLOCK), dtype=torch.float32) for n in _TENSOR_SIZES] for _ in range(2)]
    for name in USUAL_PARAM_DTYPES:
        dtype = getattr(torch, name)
        p_g = [[torch.zeros(n, dtype=dtype) for n in _TENSOR_SIZES] for _ in range(2)]
        for clip in (None, torch.ones((), dtype=torch.float32)):
            args = m.base.StepArgs(lr=1e-3, betas=betas, eps=1e-8, weight_decay=0.0, clip_coef=clip)
            table = m.base.TensorTable([*p_g, *codes, none, *absmax, none, steps], cpu)
            m.adamw8bit_step(table, dtype, dtype, torch.zeros(4, 256), args)


def _lm_head_launches(m: Any, torch: Any) -> None:
    from fasttrain.loss.lm_head_torch import HeadTransform

    head, softcapped = HeadTransform(), HeadTransform(softcap=30.0)
    meta = {"device": "meta"}
    for vocab in USUAL_VOCABS:
        for name in USUAL_LOGIT_DTYPES:
            logits = torch.empty((2, vocab), dtype=getattr(torch, name), **meta)
            labels = torch.zeros(2, dtype=torch.int64, **meta)
            m.row_stats(logits, labels, head)  # the cross-entropy loss
            m.row_stats(logits, labels, head, entropy=True)  # TRL's token log-probs with the entropy
            log_z = torch.empty(2, dtype=torch.float32, **meta)
            m.row_grad(logits, labels, head, log_z, log_z, log_z)
            if vocab in SOFTCAP_VOCABS:  # Gemma-2's loss: its config's final_logit_softcapping
                m.row_stats(logits, labels, softcapped)
                m.row_grad(logits, labels, softcapped, log_z, log_z, log_z)


_LAUNCHES = {"adamw": _adamw_launches, "adamw8bit": _adamw8bit_launches, "lm_head": _lm_head_launches}


def launched_variants(spec: KernelSpec) -> list[dict[str, Any]]:
    """The variants of ``spec`` that its module's launchers start for the usual settings (``USUAL_*``), each
    with the launch's ``num_warps`` under the key ``"num_warps"``; imports torch and the kernel module."""
    import torch

    module = importlib.import_module(f"fasttrain.kernels.{spec.module}")
    calls: list = []
    kernels = [n for n in vars(module) if n in {s.name for s in KERNELS if s.module == spec.module}]
    saved = {n: getattr(module, n) for n in kernels}
    try:
        for n in kernels:
            setattr(module, n, _Recorder(n, calls))
        _LAUNCHES[spec.module](module, torch)
    finally:
        for n, kernel in saved.items():
            setattr(module, n, kernel)
    out: list[dict[str, Any]] = []
    for name, args, kwargs in calls:
        if name == spec.name:
            variant = _variant_of(spec, args, kwargs, torch)
            if variant not in out:
                out.append(variant)
    return out


def _variant_of(spec: KernelSpec, args: tuple, kwargs: dict[str, Any], torch: Any) -> dict[str, Any]:
    bound = dict(zip(spec.signature, args, strict=False)) | kwargs
    pointer = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
    variant: dict[str, Any] = {}
    for name in spec.space:
        if name.isupper():
            variant[name] = bound[name]
            continue
        value = bound[next(a for a, kind in spec.signature.items() if kind == name)]
        if isinstance(value, torch.Tensor):
            variant[name] = pointer[value.dtype]
        else:  # an int argument: Triton folds it when it equals 1
            variant[name] = 1 if value == 1 else "i32"
    if variant not in all_variants(spec):
        raise ValueError(f"{spec.key}: the launcher started {variant}, outside the listed variant space")
    return {**variant, "num_warps": bound["num_warps"]}


@functools.cache
def defaults(spec_key: str) -> tuple[dict[str, Any], ...]:
    """``launched_variants`` without ``num_warps`` (a variant as ``all_variants`` lists it), cached."""
    launched = launched_variants(KERNELS_BY_KEY[spec_key])
    return tuple({k: v for k, v in d.items() if k != "num_warps"} for d in launched)


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
