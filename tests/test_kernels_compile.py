"""Every Triton kernel compiles for an H100/H200 (sm_90) on this CPU machine, in every variant the package launches.

The interpreter runs the kernels' Python, not Triton's compiler: type errors that only the compiler sees (a loop
variable int32 in one branch and int64 in the other, say) would otherwise surface only on a GPU, in the middle of
a GPU run. Triton's compiler and ptxas run without a GPU. The list of kernels and variants is
tests/_kernel_variants.py; these tests fail when kernels/ gains an entry point or a constexpr it does not list.
"""

from __future__ import annotations

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


def test_kernels_compile_for_sm90_and_vectorize():
    pytest.importorskip("triton")
    script = Path(__file__).with_name("_compile_kernels_sm90.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this triton build has no ptxas")
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"kernel"')]
    assert {r["kernel"] for r in rows} == {s.key for s in V.KERNELS}
    assert len(rows) == sum(len(V.pairwise(s)) for s in V.KERNELS)
    multi_tensor = {"adamw._adamw_kernel", "adamw8bit._adamw8bit_kernel", "adamw._norm_partial_kernel"}
    for r in rows:
        if r["kernel"] in multi_tensor and r["ALIGNED"]:
            assert r["v4_loads"] > 0, r  # full chunks of aligned tensors use 128-bit loads
