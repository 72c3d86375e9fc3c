"""Stochastic rounding of fp32 to bf16, with random bits that are a pure function of (seed, parameter, step, element).

Rounding an fp32 value to bf16 drops its 16 low bits. Adding 16 random bits first and then dropping them rounds
up with probability (dropped bits) / 2**16, so the rounded value is the fp32 value on average: small Adam updates
that nearest rounding would lose every step accumulate in expectation, and pure-bf16 training follows fp32 master
weights (Zamirai et al. 2020, "Revisiting BFloat16 Training"; torchao's ``bf16_stochastic_round``).

The 16 random bits of element ``i`` of a parameter come from a counter-based hash, no generator state:

    key     = mix32(mix32(mix32(step) ^ salt) ^ seed)      salt = the parameter's index in the optimizer
    bits(i) = mix32(mix32(key + (i >> 32)) ^ (i & 0xFFFFFFFF)) & 0xFFFF

with ``mix32`` the "lowbias32" integer hash (C. Wellons). ``step`` is the optimizer's step count of the
parameter (after the increment), so a run resumed from a checkpoint draws exactly the bits it would have drawn.
``i`` is the element's index in the whole parameter (row-major): a rank holding an FSDP2 shard (rows of dim 0)
draws the bits of its elements at ``i = offset + local index``, ``offset`` its first element's global index
(``fasttrain.optim._tensors.global_offset``), so every sharding, and the unsharded optimizer, rounds each element
with the same bits, and a checkpoint resharded to another world size resumes with the bits of the run it left.
The Triton kernel computes the same bits (``fasttrain.kernels.adamw._sr_bits``); this module is the torch
implementation, on int64 tensors (products split in 16-bit halves, so nothing overflows).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
MIX1, MIX2 = 0x7FEB352D, 0x846CA68B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for 0 <= x < 2**32 without leaving int64: split c in 16-bit halves
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX2)
    return x ^ (x >> 16)


def sr_key(seed: int, salt: int, step: torch.Tensor) -> torch.Tensor:
    """The per-(parameter, step) key: an int64 0-d tensor on ``step``'s device (no host sync)."""
    s = step.to(torch.int64) & _M32
    return mix32(mix32(mix32(s) ^ (salt & _M32)) ^ (seed & _M32))


def random_bits16(key: torch.Tensor, numel: int, offset: int = 0) -> torch.Tensor:
    """int64 ``[numel]``: the 16 random bits of elements offset..offset+numel-1."""
    i = torch.arange(offset, offset + numel, dtype=torch.int64, device=key.device)
    hi_key = mix32((key + (i >> 32)) & _M32)
    return mix32(hi_key ^ (i & _M32)) & 0xFFFF


def stochastic_round_to_bf16_(
    dst: torch.Tensor, src: torch.Tensor, key: torch.Tensor, offset: int = 0
) -> None:
    """``dst`` (bf16) = ``src`` (fp32, same shape) rounded stochastically with the bits of ``key``, its elements
    (row-major) being those of global index ``offset`` on.

    NaN stays NaN and an infinity stays infinite; a finite value can round up to infinity, as in any SR.
    """
    bits = src.reshape(-1).view(torch.int32).to(torch.int64) & _M32
    bits = (bits + random_bits16(key, src.numel(), offset)) & 0xFFFF0000
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    rounded = bits.view(torch.float32)
    flat = src.reshape(-1)
    rounded = torch.where(torch.isnan(flat), flat, rounded)
    dst.copy_(rounded.view(src.shape))  # exact: the low 16 bits are zero
