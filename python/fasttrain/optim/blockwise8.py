"""The 8-bit optimizer state: blockwise dynamic quantization (the format of bitsandbytes' and torchao's 8-bit Adam).

A moment tensor of ``n`` elements is stored as

- ``codes``: uint8, the parameter's shape: element ``i`` is ``QMAP[codes[i]] * absmax[i // BLOCK]``;
- ``absmax``: fp32 ``[ceil(n / BLOCK)]``: the largest ``|x|`` of each block of ``BLOCK = 256`` consecutive elements
  (row-major order; the last block may be partial). A block of zeros has ``absmax = 0``.

``QMAP`` is the 256-entry "dynamic" map of Dettmers et al. (8-bit Optimizers via Block-wise Quantization, 2021),
the one bitsandbytes and torchao use: a sign bit (signed map, for ``exp_avg``), a decimal exponent told by the
count of leading zero bits, then linear fraction bits; it reaches down to ~1e-7 of the block's absmax with 1-6
significant bits. The unsigned map (for ``exp_avg_sq`` and ``max_exp_avg_sq``) spends the sign bit on one more
fraction bit. Both contain 0 and 1.0 exactly: zeros and a block's largest element survive a round trip.

Quantizing ``x`` finds the code of ``y = x / absmax`` (computed as ``x * (1 / absmax)``) as the number of entries
of a threshold table that are ``<= y``: ``torch.bucketize`` here, an 8-step branchless binary search over the same
table in the Triton kernel, so both backends pick the same code for the same fp32 input.

- The signed map (``exp_avg``) rounds to the nearest entry: its thresholds are the midpoints between entries.
- The unsigned map (the second moments) rounds **up**, to the smallest entry ``>= y``: a second moment is never
  stored below its value, above all never as 0 while its element's first moment is not. Rounded to nearest, a
  small ``v`` in a block with a large absmax becomes 0, and the update ``m / (sqrt(v) + eps)`` of that element
  jumps by orders of magnitude: the "zero-point problem" of low-bit second moments (Li et al., Memory Efficient
  Optimizers with 4-bit States, 2023). Measured here (``fasttrain.bench.convergence``): 8-bit moments without a
  gradient clip, rounded to nearest, ended 0.16 above fp32 AdamW's spread over 3 seeds; rounded up, inside it.
  Its thresholds are the entries themselves, raised by a relative 2**-20 so that an entry's own value, after the
  fp32 roundings of ``x / absmax``, keeps its code (a dequantized state requantizes to itself), and
  ``torch.finfo(float32).tiny`` for the zero entry (no subnormal threshold, which a GPU may flush to 0).

Row blocks (the layout of FSDP2 / DTensor shards, see ``fasttrain.optim._state``): ``absmax`` may instead be 2-D,
``[rows, ceil(cols / BLOCK)]`` for a tensor seen as ``[rows, cols]`` (dim 0 by the product of the others): each row
is cut into blocks of ``BLOCK`` on its own (its last block partial when ``cols % BLOCK != 0``), so a block never
spans two rows, and a shard of whole rows holds whole blocks. When ``cols % BLOCK == 0`` these are exactly the flat
blocks above (the same codes and absmax values, in memory order). The functions here tell the layouts apart by
``absmax.dim()``.

Tensors smaller than ``MIN_8BIT_SIZE = 4096`` elements (norm weights, biases) keep fp32 moments, as
bitsandbytes (``min_8bit_size=4096``) and torchao do: they are a negligible share of the memory, and the
precision of a norm's scale matters more than its bytes.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 256
MIN_8BIT_SIZE = 4096


def _dynamic_map(signed: bool) -> list[float]:
    """The 256 entries of the dynamic map, ascending (bitsandbytes' ``create_dynamic_map(signed, 7, 8)``)."""
    values: list[float] = []
    for exponent in range(7):  # magnitudes 1e-6 .. 1, one decade per count of leading zeros
        n_fraction = 2**exponent + 1 if signed else 2 ** (exponent + 1) + 1
        bounds = torch.linspace(0.1, 1, n_fraction, dtype=torch.float32)
        means = ((bounds[:-1] + bounds[1:]) / 2.0) * 10.0 ** (exponent - 6)
        values += means.tolist()
        if signed:
            values += (-means).tolist()
    values += [0.0, 1.0]
    assert len(values) == 256
    return sorted(values)


# relative: far below the maps' gaps (>= 1%), above the fp32 roundings of x / absmax
ROUND_UP_SLACK = 2.0**-20


def _thresholds(qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    """Threshold ``j`` separates entries ``j`` and ``j + 1`` (module doc: midpoints for the signed map, rounding to
    nearest; just above entry ``j`` for the unsigned map, rounding up); the 256th is ``+inf`` (the search table is a
    power of two long, and no value is above it)."""
    if signed:
        below = (qmap[:-1] + qmap[1:]) / 2
    else:
        below = qmap[:-1] * (1.0 + ROUND_UP_SLACK)
        below[0] = torch.finfo(torch.float32).tiny  # the zero entry: any positive normal y goes up
    assert bool((below < qmap[1:]).all()), "a threshold at or above the next entry"
    return torch.cat([below, torch.tensor([float("inf")])])


@functools.cache
def tables(device: torch.device) -> torch.Tensor:
    """fp32 ``[4, 256]`` on ``device``: signed map, its thresholds, unsigned map, its thresholds."""
    rows = []
    for signed in (True, False):
        qmap = torch.tensor(_dynamic_map(signed), dtype=torch.float32)
        rows += [qmap, _thresholds(qmap, signed)]
    return torch.stack(rows).to(device)


SIGNED, UNSIGNED = 0, 2  # row of a map in tables(); its thresholds are the next row


def zero_code(signed: bool) -> int:
    """The code of 0.0 (what a fresh state holds, with absmax 0)."""
    return 127 if signed else 0


def n_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def row_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """``(rows, cols)``: a tensor of ``shape`` seen as rows along dim 0 (a 1-D tensor has rows of one element)."""
    rows = shape[0] if len(shape) else 1
    cols = 1
    for d in shape[1:]:
        cols *= d
    return rows, cols


def empty_state(param: torch.Tensor, signed: bool, rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax) of an all-zero moment for ``param`` (a plain tensor); ``rows``: row blocks."""
    codes = torch.full(param.shape, zero_code(signed), dtype=torch.uint8, device=param.device)
    if rows:
        n_rows, cols = row_shape(param.shape)
        absmax_shape: tuple[int, ...] = (n_rows, n_blocks(cols))
    else:
        absmax_shape = (n_blocks(param.numel()),)
    return codes, torch.zeros(absmax_shape, dtype=torch.float32, device=param.device)


def _blocks(x: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """``x`` zero-padded to whole blocks of ``absmax``'s layout: ``[absmax.numel(), BLOCK]``."""
    if absmax.dim() == 2:
        rows, cols = row_shape(x.shape)
        flat = x.reshape(rows, cols)
        pad = absmax.shape[1] * BLOCK - cols
    else:
        flat = x.reshape(-1)
        pad = (-flat.numel()) % BLOCK
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.reshape(-1, BLOCK)


def _unblock(blocks: torch.Tensor, absmax: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The inverse of ``_blocks``: the padding dropped, ``shape`` restored."""
    if absmax.dim() == 2:
        rows, cols = row_shape(shape)
        # contiguous: torch's fused AdamW steps these working tensors in place, and needs them dense
        return blocks.reshape(rows, absmax.shape[1] * BLOCK)[:, :cols].contiguous().reshape(shape)
    n = 1
    for d in shape:
        n *= d
    return blocks.reshape(-1)[:n].reshape(shape)


def check_layout(codes: torch.Tensor, absmax: torch.Tensor) -> str | None:
    """Why ``absmax`` is not a block layout of ``codes`` (flat or rows), or None when it is."""
    rows, cols = row_shape(codes.shape)
    flat = (n_blocks(codes.numel()),)
    by_rows = (rows, n_blocks(cols))
    if tuple(absmax.shape) in (flat, by_rows):
        return None
    return f"absmax of shape {tuple(absmax.shape)} for codes of shape {tuple(codes.shape)} (expected {flat} or {by_rows})"


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool, dtype=torch.float32) -> torch.Tensor:
    """The moment as a ``dtype`` tensor of ``codes``' shape."""
    qmap = tables(codes.device)[SIGNED if signed else UNSIGNED]
    values = qmap[_blocks(codes, absmax).long()] * absmax.reshape(-1, 1)
    return _unblock(values, absmax, codes.shape).to(dtype)


def quantize_(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
    """Write the codes and block absmax of ``x`` (any float dtype, ``codes``' shape) into ``codes`` and ``absmax``."""
    t = tables(x.device)
    thresholds = t[(SIGNED if signed else UNSIGNED) + 1, :-1]
    blocks = _blocks(x.float(), absmax)
    amax = blocks.abs().amax(dim=1)
    inv = torch.where(amax > 0, 1.0 / amax, 0.0)
    new_codes = torch.bucketize(blocks * inv[:, None], thresholds, out_int32=True, right=True)
    codes.copy_(_unblock(new_codes, absmax, codes.shape))
    absmax.copy_(amax.view(absmax.shape))
