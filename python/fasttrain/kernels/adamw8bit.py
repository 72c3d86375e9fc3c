"""The multi-tensor AdamW step over blockwise 8-bit moments (Triton): dequantize, step, requantize in one pass.

The state format is ``fasttrain.optim.blockwise8``'s: per moment, uint8 codes (the parameter's shape) and an fp32
absmax per block of QBLOCK = 256 elements; the value of a code is ``map[code] * absmax`` with the signed dynamic
map for ``exp_avg`` and the unsigned one for ``exp_avg_sq`` / ``max_exp_avg_sq``. Each program updates one CHUNK
(a multiple of 256, so blocks never straddle programs) as tiles of [BLOCK // 256, 256]: a row is a block, so the
new absmax is a row maximum and the codes are found by an 8-step branchless binary search over the map's
thresholds (the nearest entry of the signed map, the next entry up of the unsigned one: see blockwise8;
``torch.bucketize`` in the torch implementation gives the same code).

The AdamW update itself is ``adamw._adam_update`` in fp32 on the dequantized moments; the parameter update uses
those fp32 moments before they are requantized (as bitsandbytes and torchao do). Per parameter and step it moves
p (read + write), g (read), 2 x 1 byte of codes (read + write) per moment, and 8 bytes per 256 elements of absmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import adamw as base
from .adamw import _adam_update, _param_out, _sr_program_key, _step_scalars, _typed_ptr

QBLOCK = 256

# rows of the address table of the 8-bit kernel
(
    ROW_PARAM,
    ROW_GRAD,
    ROW_M_CODES,
    ROW_V_CODES,
    ROW_VMAX_CODES,
    ROW_M_ABSMAX,
    ROW_V_ABSMAX,
    ROW_VMAX_ABSMAX,
    ROW_STEP,
) = range(9)
# rows of fasttrain.optim.blockwise8.tables(): signed map, its thresholds, unsigned map, its thresholds
MAP_SIGNED: tl.constexpr = tl.constexpr(0)
MAP_UNSIGNED: tl.constexpr = tl.constexpr(2)


@triton.jit
def _dequantize(
    codes_ptr, absmax_ptr, offs, blocks, n, maps_ptr, MAP: tl.constexpr, MASKED: tl.constexpr, mask
):
    if MASKED:
        codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
        absmax = tl.load(absmax_ptr + blocks, mask=blocks * 256 < n, other=0.0)
    else:
        codes = tl.load(codes_ptr + offs).to(tl.int32)
        absmax = tl.load(absmax_ptr + blocks)
    values = tl.load(maps_ptr + MAP * 256 + codes) * absmax[:, None]
    if MASKED:
        values = tl.where(mask, values, 0.0)
    return values


@triton.jit
def _quantize_store(
    x, codes_ptr, absmax_ptr, offs, blocks, n, maps_ptr, MAP: tl.constexpr, MASKED: tl.constexpr, mask
):
    # x: fp32 [rows, 256], one block per row (zeros where masked: they do not move the absmax)
    absmax = tl.max(tl.abs(x), axis=1)
    # 1 / absmax rounded as torch rounds it (the default division on a GPU is approximate); 0 for a zero block
    inv = tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32), tl.where(absmax > 0, absmax, 1.0))
    inv = tl.where(absmax > 0, inv, 0.0)
    y = x * inv[:, None]
    # the number of thresholds <= y (the 256th is +inf): the code blockwise8 rounds y to
    thresholds_ptr = maps_ptr + (MAP + 1) * 256
    code = tl.zeros(y.shape, dtype=tl.int32)
    for s in tl.static_range(8):  # steps of 128, 64, ..., 1
        code += tl.where(tl.load(thresholds_ptr + code + ((128 >> s) - 1)) <= y, 128 >> s, 0)
    if MASKED:
        tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)
        tl.store(absmax_ptr + blocks, absmax, mask=blocks * 256 < n)
    else:
        tl.store(codes_ptr + offs, code.to(tl.uint8))
        tl.store(absmax_ptr + blocks, absmax)


@triton.jit
def _adamw8_tile(
    p_ptr, g_ptr, mq_ptr, vq_ptr, vmaxq_ptr, ma_ptr, va_ptr, vmaxa_ptr, maps_ptr, offs, blocks, n, goff, program_key,
    decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bc2_sqrt, grad_mul, grad_scale,
    MASKED: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
    P_KIND: tl.constexpr, SR: tl.constexpr,
):  # fmt: skip
    mask = offs < n
    if MASKED:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        p = tl.load(p_ptr + offs).to(tl.float32)
        g = tl.load(g_ptr + offs).to(tl.float32)
    m = _dequantize(mq_ptr, ma_ptr, offs, blocks, n, maps_ptr, MAP_SIGNED, MASKED, mask)
    v = _dequantize(vq_ptr, va_ptr, offs, blocks, n, maps_ptr, MAP_UNSIGNED, MASKED, mask)
    vmax = v
    if AMSGRAD:
        vmax = _dequantize(vmaxq_ptr, vmaxa_ptr, offs, blocks, n, maps_ptr, MAP_UNSIGNED, MASKED, mask)

    p, m, v, vmax = _adam_update(
        p, g, m, v, vmax,
        decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bc2_sqrt, grad_mul, grad_scale,
        HAS_GRAD_SCALE, AMSGRAD, MAXIMIZE,
    )  # fmt: skip
    p_out = _param_out(p, offs, goff, program_key, P_KIND, SR)
    if MASKED:
        tl.store(p_ptr + offs, p_out, mask=mask)
        # masked lanes computed from zeros: keep them zero so they cannot raise a block's absmax
        m = tl.where(mask, m, 0.0)
        v = tl.where(mask, v, 0.0)
        vmax = tl.where(mask, vmax, 0.0)
    else:
        tl.store(p_ptr + offs, p_out)
    _quantize_store(m, mq_ptr, ma_ptr, offs, blocks, n, maps_ptr, MAP_SIGNED, MASKED, mask)
    _quantize_store(v, vq_ptr, va_ptr, offs, blocks, n, maps_ptr, MAP_UNSIGNED, MASKED, mask)
    if AMSGRAD:
        _quantize_store(vmax, vmaxq_ptr, vmaxa_ptr, offs, blocks, n, maps_ptr, MAP_UNSIGNED, MASKED, mask)


@triton.jit
def _adamw8bit_kernel(
    addr_ptr,  # int64 [9, n_tensors]: rows ROW_*
    numel_ptr, work_tensor_ptr, work_start_ptr, salt_ptr, offset_ptr, n_tensors,
    maps_ptr,  # fp32 [4, 256]: fasttrain.optim.blockwise8.tables()
    lr, betas_ptr, eps, weight_decay, clip_ptr, grad_scale_ptr, found_inf_ptr, seed,
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, ALIGNED: tl.constexpr,
    LR_IS_TENSOR: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, SR: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr, CHUNK_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    if HAS_FOUND_INF:  # noqa: SIM102 - a constexpr test, then a runtime one
        if tl.load(found_inf_ptr) != 0.0:
            return
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(work_tensor_ptr + pid)
    start = tl.load(work_start_ptr + pid)
    n = tl.load(numel_ptr + t)

    p_ptr = _typed_ptr(tl.load(addr_ptr + 0 * n_tensors + t), P_KIND, ALIGNED)
    g_ptr = _typed_ptr(tl.load(addr_ptr + 1 * n_tensors + t), G_KIND, ALIGNED)
    mq_ptr = _typed_ptr(tl.load(addr_ptr + 2 * n_tensors + t), 3, ALIGNED)
    vq_ptr = _typed_ptr(tl.load(addr_ptr + 3 * n_tensors + t), 3, ALIGNED)
    ma_ptr = _typed_ptr(tl.load(addr_ptr + 5 * n_tensors + t), 0, False)
    va_ptr = _typed_ptr(tl.load(addr_ptr + 6 * n_tensors + t), 0, False)
    vmaxq_ptr = mq_ptr  # unused unless AMSGRAD
    vmaxa_ptr = ma_ptr
    if AMSGRAD:
        vmaxq_ptr = _typed_ptr(tl.load(addr_ptr + 4 * n_tensors + t), 3, ALIGNED)
        vmaxa_ptr = _typed_ptr(tl.load(addr_ptr + 7 * n_tensors + t), 0, False)
    step_ptr = _typed_ptr(tl.load(addr_ptr + 8 * n_tensors + t), 0, False)

    step, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, bc2_sqrt, grad_mul, grad_scale = (
        _step_scalars(
            lr, step_ptr, betas_ptr, weight_decay, clip_ptr, grad_scale_ptr,
            LR_IS_TENSOR, HAS_CLIP, HAS_GRAD_SCALE, USE_LIBDEVICE,
        )
    )  # fmt: skip
    program_key = tl.full((), 0, tl.uint32)
    goff = tl.full((), 0, tl.int64)  # global index of the tensor's first element (a shard's offset)
    if SR:
        goff = tl.load(offset_ptr + t)
        program_key = _sr_program_key(step, tl.load(salt_ptr + t), seed, start + goff)

    ROWS: tl.constexpr = BLOCK_SIZE // 256
    rows = tl.arange(0, ROWS).to(tl.int64)
    tile = rows[:, None] * 256 + tl.arange(0, 256).to(tl.int64)[None, :]  # [ROWS, 256]
    if start + CHUNK_SIZE <= n:
        for i in tl.range(0, CHUNK_SIZE, BLOCK_SIZE):
            first = tl.multiple_of(start + i, BLOCK_SIZE)
            _adamw8_tile(
                p_ptr, g_ptr, mq_ptr, vq_ptr, vmaxq_ptr, ma_ptr, va_ptr, vmaxa_ptr, maps_ptr,
                first + tile, first // 256 + rows, n, goff, program_key,
                decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bc2_sqrt, grad_mul, grad_scale,
                False, HAS_GRAD_SCALE, AMSGRAD, MAXIMIZE, P_KIND, SR,
            )  # fmt: skip
    else:
        for j in tl.range(0, n - start, BLOCK_SIZE):  # j, not i: an int64 here, an int32 above
            first = start + j
            _adamw8_tile(
                p_ptr, g_ptr, mq_ptr, vq_ptr, vmaxq_ptr, ma_ptr, va_ptr, vmaxa_ptr, maps_ptr,
                first + tile, first // 256 + rows, n, goff, program_key,
                decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bc2_sqrt, grad_mul, grad_scale,
                True, HAS_GRAD_SCALE, AMSGRAD, MAXIMIZE, P_KIND, SR,
            )  # fmt: skip


def adamw8bit_step(
    table: base.TensorTable,
    p_dtype: torch.dtype,
    g_dtype: torch.dtype,
    maps: torch.Tensor,
    args: base.StepArgs,
) -> None:
    """One AdamW step over every tensor in ``table`` (rows as in ROW_*; steps already incremented)."""
    if table.n_programs == 0:
        return
    if base.BLOCK % QBLOCK or table.chunk % QBLOCK:
        raise ValueError(f"BLOCK ({base.BLOCK}) and chunk ({table.chunk}) must be multiples of {QBLOCK}")
    positional, constexprs = base.launch_args(table, args)
    _adamw8bit_kernel[(table.n_programs,)](
        table.addrs, table.numels, table.work_tensor, table.work_start, table.salts, table.offsets, table.n_tensors,
        maps,
        *positional,
        P_KIND=base.DTYPE_CODES[p_dtype], G_KIND=base.DTYPE_CODES[g_dtype], ALIGNED=table.aligned,
        CHUNK_SIZE=table.chunk, BLOCK_SIZE=base.BLOCK, **constexprs,
    )  # fmt: skip
