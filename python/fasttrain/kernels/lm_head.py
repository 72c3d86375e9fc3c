"""Triton kernels for one chunk of the chunked LM head (``fasttrain.loss.chunked_head``): ``row_stats`` (an
online log-sum-exp with the sums the statistics need, the label's ``z``, the first argmax; the logits only
read) and ``row_grad`` (the logit gradient, written over the logits in place, each block read before it is
written). The math and the contract are the torch twin's, ``fasttrain.loss.lm_head_torch`` (see its docstring).
One program per row (token), the row streamed in ``BLOCK_V`` vocabulary blocks, fp32 whatever the logits'
dtype; ignored rows get zeros. Row offsets are 64-bit (``row * stride`` overflows int32 above 2**31 elements:
16k tokens x 151,936 vocab already does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["pick_block_v", "row_grad", "row_stats"]


@triton.jit
def _tanh(x):
    # tl has no portable tanh (libdevice is CUDA-only, the interpreter lacks it); this form saturates
    # cleanly to +-1 for large |x| (exp overflows to inf, 2/inf = 0).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _transform(x, logit_scale, softcap, inv_t, HAS_SOFTCAP: tl.constexpr):
    x = x * logit_scale
    if HAS_SOFTCAP:
        x = softcap * _tanh(x / softcap)
    return x * inv_t


@triton.jit
def _row_stats_kernel(
    logits_ptr,  # [rows, n_cols] compute dtype, read only
    logits_row_stride,
    labels_ptr,  # [rows] int64
    log_z_ptr,  # [rows] fp32 out (and every output below)
    target_ptr,
    sum_z_ptr,
    entropy_ptr,
    log_sum_sq_ptr,
    top1_ptr,  # [rows] int8 out
    n_cols,
    ignore_index,
    logit_scale,
    softcap,
    inv_t,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SUM: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_LOG_SUM_SQ: tl.constexpr,
    HAS_TOP1: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    running_max = tl.full([], -float("inf"), tl.float32)
    sum_exp = tl.zeros([], dtype=tl.float32)
    z_sum_exp = tl.zeros([], dtype=tl.float32)
    sq_sum_exp = tl.zeros([], dtype=tl.float32)
    z_sum = tl.zeros([], dtype=tl.float32)
    argmax = tl.zeros([], dtype=tl.int32)
    valid = label != ignore_index
    if valid:
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            z = _transform(
                tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32),
                logit_scale,
                softcap,
                inv_t,
                HAS_SOFTCAP,
            )
            z_or_zero = tl.where(mask, z, 0.0)
            if HAS_SUM:
                z_sum += tl.sum(z_or_zero, axis=0)
            z = tl.where(mask, z, -float("inf"))
            block_max = tl.max(z, axis=0)
            if HAS_TOP1:
                # strictly greater: an earlier block's maximum wins a tie (the first argmax, as TRL counts)
                block_arg = tl.argmax(z, axis=0, tie_break_left=True).to(tl.int32)
                argmax = tl.where(block_max > running_max, start + block_arg, argmax)
            new_max = tl.maximum(running_max, block_max)
            rescale = tl.exp(running_max - new_max)
            e = tl.exp(z - new_max)
            sum_exp = sum_exp * rescale + tl.sum(e, axis=0)
            if HAS_ENTROPY:
                z_sum_exp = z_sum_exp * rescale + tl.sum(e * z_or_zero, axis=0)
            if HAS_LOG_SUM_SQ:
                sq_sum_exp = sq_sum_exp * rescale * rescale + tl.sum(e * e, axis=0)
            running_max = new_max
    # ignored rows: neutral values, so that no log(0) is evaluated (their outputs are zeros)
    sum_exp, sq_sum_exp = tl.where(valid, sum_exp, 1.0), tl.where(valid, sq_sum_exp, 1.0)
    log_z = tl.where(valid, running_max + tl.log(sum_exp), 0.0)
    target = _transform(
        tl.load(row_ptr + tl.where(valid, label, 0)).to(tl.float32), logit_scale, softcap, inv_t, HAS_SOFTCAP
    )
    tl.store(log_z_ptr + row, log_z)
    tl.store(target_ptr + row, tl.where(valid, target, 0.0))
    if HAS_SUM:
        tl.store(sum_z_ptr + row, z_sum)
    if HAS_ENTROPY:
        tl.store(entropy_ptr + row, tl.where(valid, log_z - z_sum_exp / sum_exp, 0.0))
    if HAS_LOG_SUM_SQ:
        tl.store(log_sum_sq_ptr + row, tl.where(valid, tl.log(sq_sum_exp) - 2.0 * tl.log(sum_exp), 0.0))
    if HAS_TOP1:
        tl.store(top1_ptr + row, (valid & (argmax == label)).to(tl.int8))


@triton.jit
def _row_grad_kernel(
    logits_ptr,  # [rows, n_cols] compute dtype; overwritten with the gradient
    logits_row_stride,
    labels_ptr,  # [rows] int64
    log_z_ptr,  # [rows] fp32
    entropy_ptr,  # [rows] fp32 (HAS_ENT_GRAD)
    coef_ptr,  # [rows, 4] fp32: a, c, d, g_ent
    n_cols,
    ignore_index,
    logit_scale,
    softcap,
    inv_t,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ENT_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    valid = label != ignore_index
    a = tl.load(coef_ptr + row * 4)
    c = tl.load(coef_ptr + row * 4 + 1)
    d = tl.load(coef_ptr + row * 4 + 2)
    log_z = tl.load(log_z_ptr + row)
    g_ent = 0.0
    entropy = 0.0
    if HAS_ENT_GRAD:
        g_ent = tl.load(coef_ptr + row * 4 + 3)
        entropy = tl.load(entropy_ptr + row)
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32) * logit_scale
        if HAS_SOFTCAP:
            t = _tanh(x / softcap)
            z = softcap * t * inv_t
        else:
            z = x * inv_t
        log_p = z - log_z
        p = tl.exp(log_p)
        grad = a * p + d + tl.where(offs == label, c, 0.0)
        if HAS_ENT_GRAD:
            grad -= g_ent * p * (log_p + entropy)
        grad = grad * (inv_t * logit_scale)
        if HAS_SOFTCAP:
            grad = grad * (1.0 - t * t)
        grad = tl.where(valid, grad, 0.0)  # not a product: an inf or NaN coefficient stays off ignored rows
        tl.store(row_ptr + offs, grad.to(row_ptr.dtype.element_ty), mask=mask)


def pick_block_v(n_cols: int) -> int:
    """Vocab block: a power of two, at most 4,096 fp32 values per program (registers), at least 16."""
    return max(16, min(4096, triton.next_power_of_2(n_cols)))


def _launch_args(logits, labels, head, block_v):
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a 2-D tensor with contiguous rows, got shape {tuple(logits.shape)}")
    if labels.shape != (logits.shape[0],):
        raise ValueError(f"labels must have shape ({logits.shape[0]},), got {tuple(labels.shape)}")
    block = block_v or pick_block_v(logits.shape[1])
    transform = (
        logits.shape[1],
        head.ignore_index,
        head.logit_scale,
        head.softcap or 1.0,
        head.inv_temperature,
    )
    return transform, {"BLOCK_V": block, "num_warps": 8 if block >= 2048 else 4}


def row_stats(
    logits,
    labels,
    head,
    *,
    sum_z=False,
    entropy=False,
    log_sum_sq=False,
    top1=False,
    scratch=None,
    reuse=False,
    block_v=None,
):
    """Triton twin of ``fasttrain.loss.lm_head_torch.row_stats`` (same arguments and results; ``reuse`` is the
    CPU twin's: the gradient kernel streams the row anyway)."""
    transform, launch = _launch_args(logits, labels, head, block_v)
    rows = logits.shape[0]
    f32 = {"dtype": torch.float32, "device": logits.device}
    names = ("log_z", "target", *(n for n, on in (("sum_z", sum_z), ("entropy", entropy)) if on))
    out = {name: torch.empty(rows, **f32) for name in names}
    if log_sum_sq:
        out["log_sum_sq_probs"] = torch.empty(rows, **f32)
    hits = torch.empty(rows, dtype=torch.int8, device=logits.device) if top1 else None
    if rows:
        dummy = out["log_z"]
        _row_stats_kernel[(rows,)](
            logits, logits.stride(0), labels.contiguous(), out["log_z"], out["target"], out.get("sum_z", dummy),
            out.get("entropy", dummy), out.get("log_sum_sq_probs", dummy), dummy if hits is None else hits,
            *transform, HAS_SOFTCAP=head.softcap is not None, HAS_SUM=sum_z, HAS_ENTROPY=entropy,
            HAS_LOG_SUM_SQ=log_sum_sq, HAS_TOP1=top1, **launch,
        )  # fmt: skip
    if hits is not None:
        out["is_top1"] = hits.bool()
    return out


def row_grad(
    logits,
    labels,
    head,
    log_z,
    a,
    c,
    d=None,
    g_ent=None,
    entropy=None,
    scratch=None,
    exp=None,
    *,
    block_v=None,
):
    """Triton twin of ``fasttrain.loss.lm_head_torch.row_grad``: the gradient, in place (``exp`` unused)."""
    transform, launch = _launch_args(logits, labels, head, block_v)
    if logits.shape[0]:
        zero = torch.zeros_like(a)
        coef = torch.stack((a, c, zero if d is None else d, zero if g_ent is None else g_ent), dim=1).float()
        _row_grad_kernel[(logits.shape[0],)](
            logits, logits.stride(0), labels.contiguous(), log_z.contiguous(),
            log_z if entropy is None else entropy.contiguous(), coef.contiguous(), *transform,
            HAS_SOFTCAP=head.softcap is not None, HAS_ENT_GRAD=g_ent is not None, **launch,
        )  # fmt: skip
    return logits
