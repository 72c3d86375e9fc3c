"""Matmul helpers shared by the chunked losses: fp32 accumulation, the chunk logits, reused buffers."""

from __future__ import annotations

import torch

__all__ = ["Scratch", "addmm_fp32", "chunk_logits", "has_fp32_addmm"]

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


class Scratch:
    """Chunk-sized buffers reused from one chunk to the next (one ``Scratch`` per forward or backward).

    On CPU a fresh ``[rows, vocab]`` tensor per chunk costs its page faults every time (allocations that large
    are mapped from the OS and returned to it when freed): measured 0.06 s for an in-place ``exp`` over
    256 x 151,936 fp32 values against 0.20 s for one that allocates its output.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(
        self, name: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = shape[0] * shape[1]
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


def chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scratch: Scratch
) -> torch.Tensor:
    """``hidden @ weight.T (+ bias)`` into a reused buffer: ``[rows, vocab]`` in the inputs' dtype."""
    out = scratch.take("logits", (hidden.shape[0], weight.shape[0]), hidden.dtype, hidden.device)
    if bias is None:
        return torch.mm(hidden, weight.t(), out=out)
    return torch.addmm(bias, hidden, weight.t(), out=out)
