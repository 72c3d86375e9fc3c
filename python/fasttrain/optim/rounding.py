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


def _mul32_(x: torch.Tensor, c: int) -> None:
    # x = (x * c) mod 2**32 in place, for 0 <= x < 2**32 without leaving int64: c split in 16-bit halves
    high = x * (c >> 16)
    high &= 0xFFFF
    high <<= 16
    x *= c & 0xFFFF
    x += high
    x &= _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values (a new tensor; in place on it, so a staged batch of the
    optimizer's torch step allocates two working tensors, not a dozen)."""
    x = x ^ (x >> 16)
    _mul32_(x, MIX1)
    x ^= x >> 15
    _mul32_(x, MIX2)
    x ^= x >> 16
    return x


def sr_key(seed: int, salt: int, step: torch.Tensor) -> torch.Tensor:
    """The per-(parameter, step) key: an int64 0-d tensor on ``step``'s device (no host sync)."""
    s = step.to(torch.int64) & _M32
    return mix32(mix32(mix32(s) ^ (salt & _M32)) ^ (seed & _M32))


def random_bits16(key: torch.Tensor, numel: int, offset: int = 0) -> torch.Tensor:
    """int64 ``[numel]``: the 16 random bits of elements offset..offset+numel-1."""
    i = torch.arange(offset, offset + numel, dtype=torch.int64, device=key.device)
    if offset + numel <= 2**32:  # i >> 32 is 0 and i & 0xFFFFFFFF is i: one key for all
        bits = mix32(i ^ mix32(key & _M32))
    else:
        bits = mix32(mix32((key + (i >> 32)) & _M32) ^ (i & _M32))
    bits &= 0xFFFF
    return bits


def stochastic_round_to_bf16_(
    dst: torch.Tensor, src: torch.Tensor, key: torch.Tensor, offset: int = 0
) -> None:
    """``dst`` (bf16) = ``src`` (fp32, same shape) rounded stochastically with the bits of ``key``, its elements
    (row-major) being those of global index ``offset`` on.

    NaN stays NaN and an infinity stays infinite; a finite value can round up to infinity, as in any SR.
    """
    bits = src.reshape(-1).view(torch.int32).to(torch.int64)
    bits &= _M32
    bits += random_bits16(key, src.numel(), offset)
    bits &= 0xFFFF0000
    wrap = bits >> 31  # 1 where the sum is >= 2**31: back to a signed int32's range
    wrap <<= 32
    bits -= wrap
    rounded = bits.to(torch.int32).view(torch.float32)
    flat = src.reshape(-1)
    rounded = torch.where(torch.isnan(flat), flat, rounded)
    dst.copy_(rounded.view(src.shape))  # exact: the low 16 bits are zero
