"""Every Triton kernel compiles for an H100/H200 (sm_90) on this CPU machine, in every variant the package launches.

The interpreter runs the kernels' Python, not Triton's compiler: type errors that only the compiler sees (a loop
variable int32 in one branch and int64 in the other, say) would otherwise surface only on a GPU, in the middle of
a GPU run. Triton's compiler and ptxas run without a GPU. The list of kernels and variants is
tests/_kernel_variants.py; these tests fail when kernels/ gains an entry point or a constexpr it does not list.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import _kernel_variants as V

NEW_KERNEL = """

@triton.jit
def _brand_new_kernel(x_ptr, n, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), _tanh(tl.zeros([BLOCK], dtype=tl.float32)))
"""


def test_the_list_covers_every_entry_point_and_constexpr():
    assert V.uncovered(V.inventory()) == []
    # helpers are compiled inside the kernels that call them, never listed on their own
    assert "lm_head._tanh" not in V.inventory()


def test_a_kernel_or_constexpr_the_list_lacks_is_reported(tmp_path):
    kernels = tmp_path / "kernels"
    shutil.copytree(V.KERNELS_DIR, kernels)
    source = kernels / "lm_head.py"
    text = source.read_text(encoding="utf-8")
    text = text.replace(
        "    BLOCK_V: tl.constexpr,\n):\n    row =",
        "    BLOCK_V: tl.constexpr,\n    NEW_FLAG: tl.constexpr,\n):\n    row =",
        1,
    )
    source.write_text(text + NEW_KERNEL, encoding="utf-8")
    problems = V.uncovered(V.inventory(kernels))
    assert any(p.startswith("lm_head._brand_new_kernel:") for p in problems), problems
    assert any(p.startswith("lm_head._row_stats_kernel: constexprs") for p in problems), problems
    assert len(problems) == 2, problems


@pytest.mark.parametrize("spec", V.KERNELS, ids=lambda s: s.key)
@pytest.mark.parametrize("strength", [1, 2])
def test_covering_subset_has_every_value_and_pair(spec, strength):
    chosen = V.covering(spec, strength)
    wanted = set().union(*(V._pairs(v, strength) for v in V.all_variants(spec)))
    got = set().union(*(V._pairs(v, strength) for v in chosen))
    assert wanted == got
    assert all(spec.valid(v) for v in chosen)
    assert len(chosen) < len(V.all_variants(spec)) or len(chosen) <= 2


def test_the_listed_values_are_those_the_launchers_pick():
    from fasttrain.kernels import adamw
    from fasttrain.kernels.lm_head import pick_block_v

    vocabularies = [2**k + d for k in range(0, 21) for d in (-1, 0, 1)]
    assert {pick_block_v(v) for v in vocabularies} == set(V.BLOCK_V)
    assert sorted(adamw.DTYPE_CODES.values()) == list(V.FLOAT_KINDS)


def _compile_sm90(*flags: str) -> tuple[list[dict], dict]:
    """Run tests/_compile_kernels_sm90.py (without TRITON_INTERPRET): its rows and its summary line."""
    pytest.importorskip("triton")
    script = Path(__file__).with_name("_compile_kernels_sm90.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, str(script), *flags], env=env, capture_output=True, text=True, timeout=900
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this triton build has no ptxas")
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return [r for r in lines if "kernel" in r], next(r for r in lines if "done" in r)


def test_kernels_compile_for_sm90_and_vectorize():
    rows, _ = _compile_sm90()
    assert {r["kernel"] for r in rows} == {s.key for s in V.KERNELS}
    assert len(rows) == sum(len(V.pairwise(s)) for s in V.KERNELS)
    multi_tensor = {"adamw._adamw_kernel", "adamw8bit._adamw8bit_kernel", "adamw._norm_partial_kernel"}
    for r in rows:
        assert r["regs"] > 0 and r["spill_stores"] >= 0 and r["shared"] >= 0, r  # ptxas -v was read
        if r["kernel"] in multi_tensor and r["ALIGNED"]:
            assert r["v4_loads"] > 0, r  # full chunks of aligned tensors use 128-bit loads


# ------------------------------------------------------------------------------------------------
# default variants: what the launchers start for the usual settings must not spill registers
# ------------------------------------------------------------------------------------------------

# Default variants known to spill, accepted up to these bytes (stores and loads each), with ptxas of this major
# version only. Both come from Triton 3.9's ptxas flags: it passes --regAllocOptLevel=2 to ptxas 13.x (its
# workaround for a ptxas 13 bug); the same PTX without that flag spills nothing, nor does Triton 3.6 with its
# ptxas 12.8 (the GPU machine's, .ci/gpu-machine.txt). Anything else that spills fails, as does more spilling.
KNOWN_SPILLS = [
    # fp32 AdamW without the clip: 72 registers; 4 loop-invariant scalars reloaded from local memory (L1) at the
    # top of each 1,024-element iteration of the full-chunk loop
    ("adamw._adamw_kernel", {"P_KIND": 0, "HAS_CLIP": False}, 13, 16),
    # fp32 logits with Gemma-2's softcap: 48 registers; one value stored before the vocabulary loop, loaded after
    ("lm_head._row_stats_kernel", {"logits": "*fp32", "HAS_SOFTCAP": True}, 13, 4),
]


def _known_spill(row: dict, ptxas_major: int) -> int:
    """The bytes ``KNOWN_SPILLS`` accepts for this row's variant (0: none)."""
    for kernel, values, major, limit in KNOWN_SPILLS:
        if row["kernel"] == kernel and major == ptxas_major and all(row[k] == v for k, v in values.items()):
            return limit
    return 0


def test_default_variants_are_what_the_launchers_start():
    from fasttrain.kernels.lm_head import pick_block_v
    from fasttrain.optim import FusedAdamW

    # the settings the defaults stand for are FusedAdamW's defaults
    params = inspect.signature(FusedAdamW).parameters
    assert {k: params[k].default for k in ("amsgrad", "maximize", "bf16_stochastic_rounding", "state_dtype")} == {
        "amsgrad": False, "maximize": False, "bf16_stochastic_rounding": False, "state_dtype": None,
    }  # fmt: skip
    for spec in V.KERNELS:
        module = importlib.import_module(f"fasttrain.kernels.{spec.module}")
        launched = V.launched_variants(spec)
        assert launched, f"{spec.key}: no default variant"
        for variant in launched:
            warps = spec.num_warps(variant)
            if isinstance(warps, str):
                warps = functools.reduce(getattr, warps.split("."), module)
            # the compile script's num_warps is the launcher's
            assert variant["num_warps"] == warps, (spec.key, variant)
    blocks = {d["BLOCK_V"] for d in V.defaults("lm_head._row_stats_kernel")}
    assert blocks == {pick_block_v(v) for v in V.USUAL_VOCABS} == {4096}
    adamw = V.defaults("adamw._adamw_kernel")
    assert {(d["P_KIND"], d["HAS_CLIP"]) for d in adamw} == {(0, False), (0, True), (1, False), (1, True)}
    assert all(d["ALIGNED"] and d["n_tensors"] == "i32" and d["M_KIND"] == d["P_KIND"] for d in adamw)


def test_default_variants_do_not_spill_on_sm90():
    rows, summary = _compile_sm90("--defaults")
    assert len(rows) == sum(len(V.defaults(s.key)) for s in V.KERNELS) and all(r["default"] for r in rows)
    major = int(summary["ptxas"].split()[-1].split(".")[0])
    spilling = [
        f"{r['kernel']} {json.dumps({k: v for k, v in r.items() if k in V.KERNELS_BY_KEY[r['kernel']].space})}: "
        f"{r['regs']} registers, {r['spill_stores']} bytes spill stores, {r['spill_loads']} bytes spill loads"
        for r in rows
        if max(r["spill_stores"], r["spill_loads"]) > _known_spill(r, major)
    ]
    versions = f"Triton {summary['triton']}, {summary['ptxas']}"
    assert not spilling, f"default variants that spill on sm_90 ({versions}):\n  " + "\n  ".join(spilling)
