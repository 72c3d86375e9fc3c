"""Compile every kernel variant of fasttrain.kernels.adamw and .adamw8bit for an H100/H200 (sm_90) without a GPU.

Run in a process without TRITON_INTERPRET (tests/test_optim_compile.py does): Triton's compiler and
ptxas run on the CPU. Prints one JSON line per variant with the number of 128-bit global loads.
"""

from __future__ import annotations

import itertools
import json
import os
import re

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fasttrain.kernels import adamw as K
from fasttrain.kernels import adamw8bit as K8

TARGET = GPUTarget("cuda", 90, 32)
ADAMW_SIG = {
    "addr_ptr": "*i64", "numel_ptr": "*i64", "work_tensor_ptr": "*i64", "work_start_ptr": "*i64",
    "salt_ptr": "*i64", "n_tensors": "i32", "lr": "fp32", "betas_ptr": "*fp64", "eps": "fp32",
    "weight_decay": "fp32", "clip_ptr": "*fp32", "grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32", "seed": "i32",
}  # fmt: skip
ADAMW8_SIG = {**{k: v for k, v in ADAMW_SIG.items() if k != "lr"}, "maps_ptr": "*fp32", "lr": "fp32"}


def compile_one(fn, signature, constexprs):
    sig = dict(signature)
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=TARGET,
                              options={"num_warps": K.NUM_WARPS})  # fmt: skip
    ptx = compiled.asm["ptx"]
    return len(re.findall(r"ld\.global[^\n]*\.v4", ptx))


def main(quick: bool):
    # (param kind, moment kind, lr tensor, amsgrad, grad scaler, stochastic rounding)
    combos = [
        (p, m, lr, ams, scaled, sr)
        for p, m, lr, ams, scaled, sr in itertools.product((0, 1, 2), (0, 1, 2, "8bit"), *[(False, True)] * 4)
        if (m in (0, p, "8bit")) and (not sr or p == 1)
    ]
    if quick:  # each dtype and layout once, each flag on once
        combos = [
            (0, 0, False, False, False, False), (1, 1, True, True, True, True), (2, 0, False, False, True, False),
            (1, "8bit", False, False, False, True), (0, "8bit", True, True, True, False),
        ]  # fmt: skip
    for p_kind, m_kind, lr_tensor, amsgrad, scaled, sr in combos:
        eight = m_kind == "8bit"
        sig = dict(ADAMW8_SIG if eight else ADAMW_SIG)
        if lr_tensor:
            sig["lr"] = "*fp32"
        consts = dict(
            P_KIND=p_kind, G_KIND=p_kind, ALIGNED=True, LR_IS_TENSOR=lr_tensor, HAS_CLIP=True,
            HAS_GRAD_SCALE=scaled, HAS_FOUND_INF=scaled, AMSGRAD=amsgrad, MAXIMIZE=amsgrad, SR=sr,
            USE_LIBDEVICE=True, CHUNK_SIZE=K.CHUNK, BLOCK_SIZE=K.BLOCK,
        )  # fmt: skip
        if not eight:
            consts["M_KIND"] = m_kind
        v4 = compile_one(K8._adamw8bit_kernel if eight else K._adamw_kernel, sig, consts)
        flags = {k: consts[k] for k in ("P_KIND", "LR_IS_TENSOR", "AMSGRAD", "HAS_GRAD_SCALE", "SR")}
        print(json.dumps({"kernel": "adamw8bit" if eight else "adamw", "M_KIND": m_kind, **flags, "v4_loads": v4}),
              flush=True)  # fmt: skip
    for g_kind, norm_inf in [(0, False), (1, True)] if quick else itertools.product((0, 1, 2), (False, True)):
        sig = {"addr_ptr": "*i64", "numel_ptr": "*i64", "work_tensor_ptr": "*i64", "work_start_ptr": "*i64",
               "partial_ptr": "*fp32"}  # fmt: skip
        consts = dict(G_KIND=g_kind, ALIGNED=True, NORM_INF=norm_inf, CHUNK_SIZE=K.CHUNK, BLOCK_SIZE=K.BLOCK)
        v4 = compile_one(K._norm_partial_kernel, sig, consts)
        print(json.dumps({"kernel": "norm_partial", "G_KIND": g_kind, "NORM_INF": norm_inf, "v4_loads": v4}), flush=True)
    for norm_inf in (False, True):
        sig = {"partial_ptr": "*fp32", "first_chunk_ptr": "*i64", "out_ptr": "*fp32"}
        compile_one(K._norm_per_tensor_kernel, sig, dict(NORM_INF=norm_inf, BLOCK_SIZE=K.BLOCK))
        print(json.dumps({"kernel": "norm_per_tensor", "NORM_INF": norm_inf}), flush=True)


if __name__ == "__main__":
    import sys

    main(quick="--quick" in sys.argv)
