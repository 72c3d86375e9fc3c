"""Compile every kernel variant of fasttrain.kernels.adamw for an H100/H200 (sm_90) without a GPU.

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

TARGET = GPUTarget("cuda", 90, 32)
ADAMW_SIG = {
    "addr_ptr": "*i64", "numel_ptr": "*i64", "work_tensor_ptr": "*i64", "work_start_ptr": "*i64",
    "n_tensors": "i32", "lr": "fp32", "betas_ptr": "*fp64", "eps": "fp32", "weight_decay": "fp32",
    "clip_ptr": "*fp32", "grad_scale_ptr": "*fp32", "found_inf_ptr": "*fp32",
}  # fmt: skip


def compile_one(fn, signature, constexprs):
    sig = dict(signature)
    sig.update(dict.fromkeys(constexprs, "constexpr"))
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=TARGET,
                              options={"num_warps": K.NUM_WARPS})  # fmt: skip
    ptx = compiled.asm["ptx"]
    return len(re.findall(r"ld\.global[^\n]*\.v4", ptx))


def main(quick: bool):
    combos = list(itertools.product((0, 1, 2), (False, True), (False, True), (False, True)))
    if quick:  # each dtype once, each flag on once
        combos = [(0, False, False, False), (1, True, True, True), (2, False, False, True)]
    for p_kind, lr_tensor, amsgrad, scaled in combos:
        sig = dict(ADAMW_SIG, lr="*fp32") if lr_tensor else ADAMW_SIG
        consts = dict(
            P_KIND=p_kind, G_KIND=p_kind, ALIGNED=True, LR_IS_TENSOR=lr_tensor, HAS_CLIP=True,
            HAS_GRAD_SCALE=scaled, HAS_FOUND_INF=scaled, AMSGRAD=amsgrad, MAXIMIZE=amsgrad,
            USE_LIBDEVICE=True, CHUNK_SIZE=K.CHUNK, BLOCK_SIZE=K.BLOCK,
        )  # fmt: skip
        v4 = compile_one(K._adamw_kernel, sig, consts)
        flags = {k: consts[k] for k in ("P_KIND", "LR_IS_TENSOR", "AMSGRAD", "HAS_GRAD_SCALE")}
        print(json.dumps({"kernel": "adamw", **flags, "v4_loads": v4}), flush=True)
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
