"""Multi-tensor AdamW step and gradient-norm kernels (Triton) and their plain launchers.

One launch covers every tensor of a parameter group: the launcher writes a table of raw addresses
(int64 ``data_ptr()``s, one row per role: param, grad, exp_avg, exp_avg_sq, ...) and a work table of
(tensor index, chunk start) pairs; each program loads its row of addresses, casts them to typed
pointers and updates one CHUNK of one tensor. A 0.6B model has hundreds of small tensors, so one
launch per tensor would be launch-bound. ``adamw8bit.py`` is the same step over blockwise 8-bit moments.

Math follows torch's fused AdamW: every stored value (param, grad, moments; fp32, bf16 or fp16, the
moments in their own dtype) is loaded into fp32, updated in fp32 and rounded once when stored; the
operations are those of ``torch.optim.AdamW`` in torch's order, so the fp32 roundings agree; bias
corrections in fp64 as torch computes them in Python floats:

    g = grad / grad_scale * clip_coef (negated if maximize)
    p *= 1 - lr * weight_decay
    m = lerp(m, g, 1 - beta1)
    v = v * beta2 + (1 - beta2) * g * g
    denom = sqrt(v (or max(v_max, v) with amsgrad)) / sqrt(1 - beta2 ** step) + eps
    p -= lr / (1 - beta1 ** step) * (m / denom)

bf16 parameters are rounded to nearest, or stochastically (``SR``) with the counter-based random bits
of ``fasttrain.optim.rounding`` (same bits as its torch implementation).

Hyperparameters are runtime scalars (or device scalars), never constexprs: a scheduler changing lr
never recompiles. A step whose ``found_inf`` flag is set leaves everything untouched, decided on the
device (no host sync). Offsets are 64-bit (a 7B model has single tensors of 500M+ elements).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


def _interpreting() -> bool:
    """Triton's CPU interpreter is on (it has no libdevice). Read here, not from the package: the kernels
    import nothing of fasttrain's, so they load on their own (the sm_90 compile check, other projects)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Elements per program and per vector op. 16K elements per program keeps the grid small for 7B
# parameters (~450K programs) while a 2K-element norm tensor still gets its own program.
CHUNK = 16384
BLOCK = 1024
NUM_WARPS = 4

# storage dtypes the kernels read and write; the code is a constexpr selecting the pointer type
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# rows of the address table of the AdamW kernel
ROW_PARAM, ROW_GRAD, ROW_EXP_AVG, ROW_EXP_AVG_SQ, ROW_MAX_EXP_AVG_SQ, ROW_STEP = range(6)


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _typed_ptr(addr, KIND: tl.constexpr, ALIGNED: tl.constexpr):
    # the launcher checked that every address is 16-byte aligned when ALIGNED is set: telling the
    # compiler lets it vectorize loads of pointers it cannot see
    if KIND == 0:
        ptr = addr.to(tl.pointer_type(tl.float32))
    elif KIND == 1:
        ptr = addr.to(tl.pointer_type(tl.bfloat16))
    elif KIND == 2:
        ptr = addr.to(tl.pointer_type(tl.float16))
    else:
        ptr = addr.to(tl.pointer_type(tl.uint8))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _pow(base, exponent, USE_LIBDEVICE: tl.constexpr):
    # libdevice's pow is what torch's CUDA kernel uses; the interpreter has no libdevice
    if USE_LIBDEVICE:  # noqa: SIM108 - constexpr branches stay statements in Triton code
        out = libdevice.pow(base, exponent)
    else:
        out = tl.exp2(exponent * tl.log2(base))
    return out


@triton.jit
def _to_storage(x, KIND: tl.constexpr):
    # fp32 -> storage dtype with round-to-nearest-even. Done by hand for bf16 because Triton's
    # interpreter truncates (the GPU rounds); after this the conversion is exact on both.
    if KIND == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        out = x.to(tl.bfloat16)
    elif KIND == 2:
        out = x.to(tl.float16)
    else:
        out = x
    return out


@triton.jit
def _mix32(x):
    # lowbias32 (fasttrain.optim.rounding.mix32) on uint32: products wrap modulo 2**32
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _sr_program_key(step, salt, seed, start):
    """fasttrain.optim.rounding's key of (seed, salt, step), folded with the high half of the global element
    index ``start`` of the chunk's first element (a chunk never straddles a multiple of 2**32: its elements share
    it; ``chunks_straddle`` says where a shard's offset would break that)."""
    key = _mix32(_mix32(_mix32(step.to(tl.uint32)) ^ salt.to(tl.uint32)) ^ seed.to(tl.uint32))
    return _mix32(key + (start >> 32).to(tl.uint32))


@triton.jit
def _to_bf16_stochastic(x, idx, program_key):
    # add 16 random bits below bf16's last bit, then drop them (NaN stays NaN; see fasttrain.optim.rounding);
    # idx: the elements' global indices
    noise = _mix32(program_key ^ idx.to(tl.uint32)) & 0xFFFF
    bits = (x.to(tl.uint32, bitcast=True) + noise) & 0xFFFF0000
    x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(tl.bfloat16)  # exact: the low bits are zero


@triton.jit
def _param_out(p, offs, goff, program_key, P_KIND: tl.constexpr, SR: tl.constexpr):
    # offs: the elements' local indices, goff: the global index of the tensor's first (a shard's offset)
    if SR and P_KIND == 1:  # noqa: SIM108
        out = _to_bf16_stochastic(p, offs + goff, program_key)
    else:
        out = _to_storage(p, P_KIND)
    return out


@triton.jit
def _adam_update(
    p, g, m, v, vmax,
    decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bc2_sqrt, grad_mul, grad_scale,
    HAS_GRAD_SCALE: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
):  # fmt: skip
    """The AdamW update of fp32 values of any shape: (p, m, v, vmax) after the step (vmax unused without AMSGRAD)."""
    if HAS_GRAD_SCALE:
        g = g / grad_scale  # torch divides by the scale too (`grad /= *grad_scale_ptr`)
    g = g * grad_mul  # clip coefficient (exactly 1.0 when not clipping)
    if MAXIMIZE:
        g = -g
    # the order of operations of torch.optim.AdamW (mul_, lerp_, mul_().addcmul_(), addcdiv_), so the
    # fp32 roundings match: p *= 1 - lr * wd; m = lerp(m, g, 1 - beta1); v = v * beta2 + (1 - beta2) * g * g
    p = p * decay
    m = tl.where(one_minus_beta1 < 0.5, m + one_minus_beta1 * (g - m), g - (g - m) * beta1)
    v = v * beta2 + one_minus_beta2 * g * g
    if AMSGRAD:
        vmax = tl.maximum(vmax, v)
        denom = tl.sqrt(vmax) / bc2_sqrt + eps
    else:
        denom = tl.sqrt(v) / bc2_sqrt + eps
    p = p - step_size * (m / denom)
    return p, m, v, vmax


@triton.jit
def _step_scalars(
    lr, step_ptr, betas_ptr, weight_decay, clip_ptr, grad_scale_ptr,
    LR_IS_TENSOR: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, USE_LIBDEVICE: tl.constexpr,
):  # fmt: skip
    """The per-tensor scalars of one step, once per program (so free)."""
    if LR_IS_TENSOR:  # noqa: SIM108
        lr_val = tl.load(lr).to(tl.float32)
    else:
        lr_val = tl.cast(lr, tl.float32)
    # Bias corrections in fp64: at step 1, 1 - 0.999 ** 1 in fp32 keeps 4 digits; torch's AdamW
    # computes them in Python floats (fp64).
    step = tl.load(step_ptr)  # already incremented for this step, as torch does
    step64 = step.to(tl.float64)
    beta1_64 = tl.load(betas_ptr)
    beta2_64 = tl.load(betas_ptr + 1)
    bias_correction1 = 1.0 - _pow(beta1_64, step64, USE_LIBDEVICE)
    bias_correction2 = 1.0 - _pow(beta2_64, step64, USE_LIBDEVICE)
    step_size = (tl.cast(lr_val, tl.float64) / bias_correction1).to(tl.float32)
    bc2_sqrt = tl.sqrt(bias_correction2).to(tl.float32)
    beta1 = beta1_64.to(tl.float32)
    beta2 = beta2_64.to(tl.float32)
    one_minus_beta1 = tl.load(betas_ptr + 2).to(tl.float32)
    one_minus_beta2 = tl.load(betas_ptr + 3).to(tl.float32)
    decay = (1.0 - tl.cast(lr_val, tl.float64) * tl.cast(weight_decay, tl.float64)).to(tl.float32)
    grad_mul = 1.0
    if HAS_CLIP:
        grad_mul = tl.load(clip_ptr)
    grad_scale = 1.0
    if HAS_GRAD_SCALE:
        grad_scale = tl.load(grad_scale_ptr)
    return (
        step,
        decay,
        beta1,
        beta2,
        one_minus_beta1,
        one_minus_beta2,
        step_size,
        bc2_sqrt,
        grad_mul,
        grad_scale,
    )


@triton.jit
def _adamw_block(
    p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, offs, n, goff, program_key,
    decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bc2_sqrt, grad_mul, grad_scale,
    MASKED: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
    P_KIND: tl.constexpr, M_KIND: tl.constexpr, SR: tl.constexpr,
):  # fmt: skip
    if MASKED:
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        vmax = v
        if AMSGRAD:
            vmax = tl.load(vmax_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        p = tl.load(p_ptr + offs).to(tl.float32)
        g = tl.load(g_ptr + offs).to(tl.float32)
        m = tl.load(m_ptr + offs).to(tl.float32)
        v = tl.load(v_ptr + offs).to(tl.float32)
        vmax = v
        if AMSGRAD:
            vmax = tl.load(vmax_ptr + offs).to(tl.float32)

    p, m, v, vmax = _adam_update(
        p, g, m, v, vmax,
        decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bc2_sqrt, grad_mul, grad_scale,
        HAS_GRAD_SCALE, AMSGRAD, MAXIMIZE,
    )  # fmt: skip
    p_out = _param_out(p, offs, goff, program_key, P_KIND, SR)
    m_out = _to_storage(m, M_KIND)
    v_out = _to_storage(v, M_KIND)
    vmax_out = _to_storage(vmax, M_KIND)
    if MASKED:
        tl.store(p_ptr + offs, p_out, mask=mask)
        tl.store(m_ptr + offs, m_out, mask=mask)
        tl.store(v_ptr + offs, v_out, mask=mask)
        if AMSGRAD:
            tl.store(vmax_ptr + offs, vmax_out, mask=mask)
    else:
        tl.store(p_ptr + offs, p_out)
        tl.store(m_ptr + offs, m_out)
        tl.store(v_ptr + offs, v_out)
        if AMSGRAD:
            tl.store(vmax_ptr + offs, vmax_out)


@triton.jit
def _adamw_kernel(
    addr_ptr,  # int64 [6, n_tensors]: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step
    numel_ptr,  # int64 [n_tensors]
    work_tensor_ptr,  # int64 [n_programs]: which tensor this program updates
    work_start_ptr,  # int64 [n_programs]: first element of its chunk
    salt_ptr,  # int64 [n_tensors]: the parameters' indices in the optimizer (stochastic rounding)
    offset_ptr,  # int64 [n_tensors]: global index of each tensor's first element (stochastic rounding of shards)
    n_tensors,
    lr,  # float, or pointer to a device scalar when LR_IS_TENSOR
    betas_ptr,  # fp64 [4] device tensor: beta1, beta2, 1 - beta1, 1 - beta2 (fp64: 1 - beta ** step keeps its digits)
    eps, weight_decay,
    clip_ptr,  # fp32 device scalar: clip coefficient (HAS_CLIP)
    grad_scale_ptr,  # fp32 device scalar: GradScaler's scale (HAS_GRAD_SCALE)
    found_inf_ptr,  # fp32 device scalar: non-zero skips the step (HAS_FOUND_INF)
    seed,  # int32: the stochastic rounding seed's low 32 bits (SR)
    P_KIND: tl.constexpr, G_KIND: tl.constexpr, M_KIND: tl.constexpr, ALIGNED: tl.constexpr,
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
    m_ptr = _typed_ptr(tl.load(addr_ptr + 2 * n_tensors + t), M_KIND, ALIGNED)
    v_ptr = _typed_ptr(tl.load(addr_ptr + 3 * n_tensors + t), M_KIND, ALIGNED)
    vmax_ptr = m_ptr  # unused unless AMSGRAD
    if AMSGRAD:
        vmax_ptr = _typed_ptr(tl.load(addr_ptr + 4 * n_tensors + t), M_KIND, ALIGNED)
    step_ptr = _typed_ptr(tl.load(addr_ptr + 5 * n_tensors + t), 0, False)

    step, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, bc2_sqrt, grad_mul, grad_scale = (
        _step_scalars(
            lr, step_ptr, betas_ptr, weight_decay, clip_ptr, grad_scale_ptr,
            LR_IS_TENSOR, HAS_CLIP, HAS_GRAD_SCALE, USE_LIBDEVICE,
        )
    )  # fmt: skip
    program_key = tl.full((), 0, tl.uint32)
    goff = tl.full((), 0, tl.int64)
    if SR:
        goff = tl.load(offset_ptr + t)
        program_key = _sr_program_key(step, tl.load(salt_ptr + t), seed, start + goff)

    base = tl.arange(0, BLOCK_SIZE).to(tl.int64)
    if start + CHUNK_SIZE <= n:
        # a full chunk: no masks, so the loads can be vectorized
        for i in tl.range(0, CHUNK_SIZE, BLOCK_SIZE):
            # chunk starts are multiples of CHUNK_SIZE, itself a multiple of BLOCK_SIZE: say so, or the
            # compiler cannot prove alignment of offsets loaded from memory and will not vectorize
            offs = tl.max_contiguous(tl.multiple_of(start + i + base, BLOCK_SIZE), BLOCK_SIZE)
            _adamw_block(
                p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, offs, n, goff, program_key,
                decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bc2_sqrt, grad_mul, grad_scale,
                False, HAS_GRAD_SCALE, AMSGRAD, MAXIMIZE, P_KIND, M_KIND, SR,
            )  # fmt: skip
    else:
        # the tail chunk of a tensor: stop at its end (a 1-element bias does one block, not CHUNK/BLOCK)
        for j in tl.range(0, n - start, BLOCK_SIZE):  # j, not i: an int64 here, an int32 above
            offs = start + j + base
            _adamw_block(
                p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, offs, n, goff, program_key,
                decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bc2_sqrt, grad_mul, grad_scale,
                True, HAS_GRAD_SCALE, AMSGRAD, MAXIMIZE, P_KIND, M_KIND, SR,
            )  # fmt: skip


@triton.jit
def _norm_partial_kernel(
    addr_ptr,  # int64 [n_tensors]: gradient addresses
    numel_ptr, work_tensor_ptr, work_start_ptr,
    partial_ptr,  # fp32 [n_programs]: sum of squares (or max |x|) of each chunk
    G_KIND: tl.constexpr, ALIGNED: tl.constexpr, NORM_INF: tl.constexpr,
    CHUNK_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(work_tensor_ptr + pid)
    start = tl.load(work_start_ptr + pid)
    n = tl.load(numel_ptr + t)
    g_ptr = _typed_ptr(tl.load(addr_ptr + t), G_KIND, ALIGNED)
    base = tl.arange(0, BLOCK_SIZE).to(tl.int64)
    acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    if start + CHUNK_SIZE <= n:
        for i in tl.range(0, CHUNK_SIZE, BLOCK_SIZE):
            offs = tl.max_contiguous(tl.multiple_of(start + i + base, BLOCK_SIZE), BLOCK_SIZE)
            x = tl.load(g_ptr + offs).to(tl.float32)
            if NORM_INF:
                acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
            else:
                acc += x * x
    else:
        for j in tl.range(0, n - start, BLOCK_SIZE):  # j, not i: an int64 here, an int32 above
            offs = start + j + base
            x = tl.load(g_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
            if NORM_INF:
                acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
            else:
                acc += x * x
    if NORM_INF:
        # a NaN anywhere must survive the reduction, as it does in torch's norm
        has_nan = tl.sum((acc != acc).to(tl.int32), axis=0) > 0
        out = tl.max(acc, axis=0)
        out = tl.where(has_nan, float("nan"), out)
    else:
        out = tl.sum(acc, axis=0)
    tl.store(partial_ptr + pid, out)


@triton.jit
def _norm_per_tensor_kernel(
    partial_ptr,  # fp32 [n_programs of the partial kernel]
    first_chunk_ptr,  # int64 [n_tensors + 1]: tensor t owns partials [first[t], first[t+1])
    out_ptr,  # fp32 [n_tensors]: the norm of each tensor
    NORM_INF: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    lo = tl.load(first_chunk_ptr + t)
    hi = tl.load(first_chunk_ptr + t + 1)
    base = tl.arange(0, BLOCK_SIZE).to(tl.int64)
    acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    has_nan = tl.zeros((BLOCK_SIZE,), dtype=tl.int32)
    for i in tl.range(lo, hi, BLOCK_SIZE):
        offs = i + base
        x = tl.load(partial_ptr + offs, mask=offs < hi, other=0.0)
        if NORM_INF:
            has_nan += (x != x).to(tl.int32)
            acc = tl.maximum(acc, x)
        else:
            acc += x
    if NORM_INF:
        out = tl.max(acc, axis=0)
        out = tl.where(tl.sum(has_nan, axis=0) > 0, float("nan"), out)
    else:
        out = tl.sqrt(tl.sum(acc, axis=0))
    tl.store(out_ptr + t, out)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def supported_dtype(dtype: torch.dtype) -> bool:
    return dtype in DTYPE_CODES


def chunks_straddle(numel: int, offset: int, chunk: int | None = None) -> bool:
    """Whether a chunk of a tensor of ``numel`` elements whose first has global index ``offset`` would hold
    elements on both sides of a multiple of 2**32 (the kernels fold the high half of the index into one key per
    chunk). Never for offset 0 (chunks divide 2**32) nor for an offset that is a multiple of the chunk."""
    chunk = CHUNK if chunk is None else chunk
    boundary = ((offset >> 32) + 1) << 32  # the first multiple of 2**32 above the first element
    while boundary < offset + numel:
        if (boundary - offset) % chunk:
            return True
        boundary += 1 << 32
    return False


class TensorTable:
    """Addresses, sizes and the (tensor, chunk) work table of a list of tensors, on their device.

    Built on the host as one int64 buffer and copied to the device in one transfer; reused while the
    addresses do not change (the optimizer keys its cache on them). ``salts`` (one int per tensor: the
    parameter's index in the optimizer) seed stochastic rounding; ``offsets`` (one int per tensor, default 0)
    are the global indices of the tensors' first elements, where a tensor is a shard of a larger parameter: the
    rounding draws each element's bits at its global index. A chunk must not straddle a multiple of 2**32 of
    global indices (``chunks_straddle``): a ValueError.
    """

    def __init__(
        self,
        rows: Sequence[Sequence[torch.Tensor | None]],
        device: torch.device,
        chunk: int | None = None,
        salts: Sequence[int] | None = None,
        offsets: Sequence[int] | None = None,
    ):
        chunk = CHUNK if chunk is None else chunk  # read at call time: tests and benchmarks tune it
        if chunk % BLOCK:
            # the kernels tell the compiler that chunk starts are multiples of BLOCK (for vector loads)
            raise ValueError(f"chunk ({chunk}) must be a multiple of BLOCK ({BLOCK})")
        n_tensors = len(rows[0])
        numels = [t.numel() for t in rows[0]]
        addrs = [[0 if t is None else t.data_ptr() for t in row] for row in rows]
        work_tensor: list[int] = []
        work_start: list[int] = []
        first_chunk = [0]
        for i, n in enumerate(numels):
            starts = range(0, n, chunk)
            work_tensor.extend([i] * len(starts))
            work_start.extend(starts)
            first_chunk.append(len(work_start))
        salts = list(salts) if salts is not None else [0] * n_tensors
        offsets = list(offsets) if offsets is not None else [0] * n_tensors
        for i, (n, offset) in enumerate(zip(numels, offsets, strict=True)):
            if chunks_straddle(n, offset, chunk):
                raise ValueError(
                    f"tensor {i}: {n} elements from global index {offset} on: a chunk of {chunk} would straddle "
                    "a multiple of 2**32 (its stochastic rounding bits need two keys)"
                )
        flat = (
            [a for row in addrs for a in row]
            + numels
            + work_tensor
            + work_start
            + first_chunk
            + salts
            + offsets
        )
        host = torch.tensor(flat, dtype=torch.int64)
        if device.type != "cpu":
            host = host.pin_memory()
        buf = host.to(device, non_blocking=True)
        n_rows = len(rows)
        n_work = len(work_start)
        sizes = [n_rows * n_tensors, n_tensors, n_work, n_work, n_tensors + 1, n_tensors, n_tensors]
        (
            self.addrs,
            self.numels,
            self.work_tensor,
            self.work_start,
            self.first_chunk,
            self.salts,
            self.offsets,
        ) = torch.split(buf, sizes)
        self.n_tensors = n_tensors
        self.n_programs = n_work
        self.chunk = chunk
        # 16 bytes = one vectorized access; the allocator aligns to far more, but views need not be
        self.aligned = all(a % 16 == 0 for row in addrs for a in row if a != 0)
        self._host = host  # keep the pinned source alive until the copy has run
        # for with_row: the address rows on the host and whether each row is 16-byte aligned
        self._addrs_host = host[: n_rows * n_tensors]
        self._row_aligned = [all(a % 16 == 0 for a in row if a != 0) for row in addrs]

    def with_row(self, row: int, addrs: Sequence[int]) -> TensorTable:
        """This table with the addresses of row ``row`` replaced (``addrs``: one per tensor, 0 for none), its work
        table shared. The optimizer's gradient row moves every step where gradients are reallocated (HF's
        ``zero_grad(set_to_none=True)``): this copies the address rows (a few KB) to the device, not the work table,
        and leaves the tables already launched untouched (a kernel in flight may still read them)."""
        n = self.n_tensors
        if len(addrs) != n:
            raise ValueError(f"row {row}: {len(addrs)} addresses for a table of {n} tensors")
        host = self._addrs_host.clone()
        host[row * n : (row + 1) * n] = torch.tensor(addrs, dtype=torch.int64)
        row_aligned = list(self._row_aligned)
        row_aligned[row] = not any(map((15).__and__, addrs))  # 0 (no tensor) is aligned
        device = self.addrs.device
        source = host.pin_memory() if device.type != "cpu" else host
        new = copy.copy(self)
        new.addrs = source.to(device, non_blocking=True)
        new.aligned = all(row_aligned)
        new._host = (self._host, source)  # both pinned sources stay alive until their copies have run
        new._addrs_host, new._row_aligned = host, row_aligned
        return new


@dataclass
class StepArgs:
    """The hyperparameters and device scalars of one step of one parameter group.

    ``betas`` is an fp64 [beta1, beta2, 1 - beta1, 1 - beta2] tensor on the device; ``lr`` a float or an fp32
    device scalar; ``clip_coef``, ``grad_scale`` and ``found_inf`` fp32 device scalars read by the kernel (None:
    absent); ``sr_seed`` (an int) turns on stochastic rounding of bf16 parameters.
    """

    lr: float | torch.Tensor
    betas: torch.Tensor
    eps: float
    weight_decay: float
    clip_coef: torch.Tensor | None = None
    grad_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    amsgrad: bool = False
    maximize: bool = False
    sr_seed: int | None = None


def _int32_bits(seed: int) -> int:
    """The seed's low 32 bits as a signed 32-bit argument: the kernel reads them back as uint32, the bits that
    ``fasttrain.optim.rounding.sr_key`` takes (``seed & 0xFFFFFFFF``), so both backends round alike for any int."""
    low = seed & 0xFFFFFFFF
    return low - 2**32 if low >= 2**31 else low


def launch_args(table: TensorTable, args: StepArgs) -> tuple[tuple, dict]:
    """The arguments the AdamW kernels share (after the table), positional and constexpr."""
    dummy = table.numels  # any device pointer for the scalars a launch does not use
    lr_is_tensor = isinstance(args.lr, torch.Tensor)
    positional = (
        args.lr if lr_is_tensor else float(args.lr), args.betas, float(args.eps), float(args.weight_decay),
        dummy if args.clip_coef is None else args.clip_coef,
        dummy if args.grad_scale is None else args.grad_scale,
        dummy if args.found_inf is None else args.found_inf,
        0 if args.sr_seed is None else _int32_bits(args.sr_seed),
    )  # fmt: skip
    constexprs = dict(
        LR_IS_TENSOR=lr_is_tensor, HAS_CLIP=args.clip_coef is not None, HAS_GRAD_SCALE=args.grad_scale is not None,
        HAS_FOUND_INF=args.found_inf is not None, AMSGRAD=args.amsgrad, MAXIMIZE=args.maximize,
        SR=args.sr_seed is not None, USE_LIBDEVICE=not _interpreting(), num_warps=NUM_WARPS,
    )  # fmt: skip
    return positional, constexprs


def adamw_step(
    table: TensorTable, p_dtype: torch.dtype, g_dtype: torch.dtype, m_dtype: torch.dtype, args: StepArgs
) -> None:
    """One AdamW step over every tensor in ``table`` (rows as in ROW_*; steps already incremented), moments
    stored in ``m_dtype``."""
    if table.n_programs == 0:
        return
    positional, constexprs = launch_args(table, args)
    _adamw_kernel[(table.n_programs,)](
        table.addrs, table.numels, table.work_tensor, table.work_start, table.salts, table.offsets, table.n_tensors,
        *positional,
        P_KIND=DTYPE_CODES[p_dtype], G_KIND=DTYPE_CODES[g_dtype], M_KIND=DTYPE_CODES[m_dtype],
        ALIGNED=table.aligned, CHUNK_SIZE=table.chunk, BLOCK_SIZE=BLOCK, **constexprs,
    )  # fmt: skip


def per_tensor_norms(table: TensorTable, g_dtype: torch.dtype, norm_type: float) -> torch.Tensor:
    """fp32 [n_tensors]: the norm of each tensor of a one-row table (2-norm or inf-norm), in one pass."""
    norm_inf = norm_type == float("inf")
    if not norm_inf and norm_type != 2.0:
        raise ValueError(f"the Triton norm kernel supports norm_type 2 and inf, got {norm_type}")
    device = table.addrs.device
    out = torch.empty(table.n_tensors, dtype=torch.float32, device=device)
    if table.n_tensors == 0:
        return out
    partials = torch.empty(max(table.n_programs, 1), dtype=torch.float32, device=device)
    if table.n_programs:
        _norm_partial_kernel[(table.n_programs,)](
            table.addrs, table.numels, table.work_tensor, table.work_start, partials,
            G_KIND=DTYPE_CODES[g_dtype], ALIGNED=table.aligned, NORM_INF=norm_inf,
            CHUNK_SIZE=table.chunk, BLOCK_SIZE=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip
    _norm_per_tensor_kernel[(table.n_tensors,)](
        partials, table.first_chunk, out, NORM_INF=norm_inf, BLOCK_SIZE=BLOCK, num_warps=NUM_WARPS
    )
    return out
