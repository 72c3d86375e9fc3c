"""fp32 accumulation of chunk products, shared by the chunked losses."""

from __future__ import annotations

import torch

__all__ = ["addmm_fp32", "has_fp32_addmm"]

# torch >= 2.8 has addmm with bf16/fp16 operands and an fp32 output on CUDA (not on CPU): decided once, by
# version, instead of by trying and remembering a failure.
_CUDA_MIXED_ADDMM = torch.__version__ >= (2, 8)


def has_fp32_addmm(t: torch.Tensor) -> bool:
    """Whether ``addmm_fp32`` on ``t``'s half-precision operands needs no fp32 copies of them."""
    return _CUDA_MIXED_ADDMM and t.is_cuda


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` for an fp32 ``acc`` without rounding ``a @ b`` to the operands' dtype first
    (rounding each chunk's product to bf16 before summing biases the weight gradient)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif has_fp32_addmm(a):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        # no mixed-dtype matmul here: chunk-sized fp32 copies keep the accumulation exact
        acc.addmm_(a.float(), b.float())
