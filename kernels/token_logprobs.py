"""Triton kernels for one chunk of per-token log-prob statistics (TRL's fused LM-head contract).

The caller (``fasttrain.loss.token_logprobs``) computes a chunk of logits ``hidden_chunk @ weight.T (+ bias)``
in the input dtype and hands it here; one program per row (token). The math and the contract are those of
the PyTorch twin ``fasttrain.loss.token_stats_torch`` (see its docstring):

- ``token_stats_chunk``: pass 1 streams the row in ``BLOCK_V`` blocks with an online log-sum-exp (running
  max, rescaled sums of ``e``, ``e * z`` for the entropy and ``e**2`` for ``log_sum_sq_probs``, the sum of
  ``z`` and the first argmax), all in fp32; with ``COMPUTE_GRAD`` pass 2 streams it again and overwrites the
  logits in place with ``d log_prob / d logits`` for an upstream gradient of 1.
- ``token_grad_chunk``: the backward for per-row upstream gradients of the log-prob and the entropy, in place.

Ignored rows get zeros. Row offsets are 64-bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cross_entropy import _tanh, _zero_row, pick_block_v

__all__ = ["token_grad_chunk", "token_stats_chunk"]


@triton.jit
def _transform(x, logit_scale, softcap, inv_t, HAS_SOFTCAP: tl.constexpr):
    x = x * logit_scale
    if HAS_SOFTCAP:
        x = softcap * _tanh(x / softcap)
    return x * inv_t


@triton.jit
def _grad_pass(
    row_ptr,
    label,
    log_z,
    entropy,
    g_lp,
    g_ent,
    n_cols,
    logit_scale,
    softcap,
    inv_t,
    cols,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LP_GRAD: tl.constexpr,
    HAS_ENT_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # d/dz_j = g_lp ([j == label] - p_j) - g_ent p_j (log p_j + H), then the transform's chain rule
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
        grad = tl.zeros([BLOCK_V], dtype=tl.float32)
        if HAS_LP_GRAD:
            grad += g_lp * (tl.where(offs == label, 1.0, 0.0) - p)
        if HAS_ENT_GRAD:
            grad -= g_ent * p * (log_p + entropy)
        grad = grad * (inv_t * logit_scale)
        if HAS_SOFTCAP:
            grad = grad * (1.0 - t * t)
        tl.store(row_ptr + offs, grad.to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_stats_kernel(
    logits_ptr,  # [rows, n_cols] input dtype; overwritten with the gradient when COMPUTE_GRAD
    logits_row_stride,
    labels_ptr,  # [rows] int64
    log_probs_ptr,  # [rows] fp32 out (and every output below)
    log_z_ptr,
    entropy_ptr,
    log_sum_sq_ptr,
    mean_ptr,
    top1_ptr,  # [rows] int8 out
    scale_ptr,  # fp32 scalar: the upstream gradient of every scored log-prob (COMPUTE_GRAD)
    n_cols,
    ignore_index,
    logit_scale,
    softcap,
    inv_t,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_LOG_SUM_SQ: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    HAS_TOP1: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    if label == ignore_index:
        tl.store(log_probs_ptr + row, 0.0)
        tl.store(log_z_ptr + row, 0.0)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)
        if HAS_LOG_SUM_SQ:
            tl.store(log_sum_sq_ptr + row, 0.0)
        if HAS_MEAN:
            tl.store(mean_ptr + row, 0.0)
        if HAS_TOP1:
            tl.store(top1_ptr + row, 0)
        if COMPUTE_GRAD:
            _zero_row(row_ptr, n_cols, cols, BLOCK_V)
    else:
        running_max = tl.full([], -float("inf"), tl.float32)
        sum_exp = tl.zeros([], dtype=tl.float32)
        z_sum_exp = tl.zeros([], dtype=tl.float32)
        sq_sum_exp = tl.zeros([], dtype=tl.float32)
        z_sum = tl.zeros([], dtype=tl.float32)
        argmax = tl.zeros([], dtype=tl.int32)
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            z = _transform(z, logit_scale, softcap, inv_t, HAS_SOFTCAP)
            z_or_zero = tl.where(mask, z, 0.0)
            if HAS_MEAN:
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
        log_z = running_max + tl.log(sum_exp)
        target = _transform(tl.load(row_ptr + label).to(tl.float32), logit_scale, softcap, inv_t, HAS_SOFTCAP)
        tl.store(log_probs_ptr + row, target - log_z)
        tl.store(log_z_ptr + row, log_z)
        entropy = log_z - z_sum_exp / sum_exp
        if HAS_ENTROPY:
            tl.store(entropy_ptr + row, entropy)
        if HAS_LOG_SUM_SQ:
            tl.store(log_sum_sq_ptr + row, tl.log(sq_sum_exp) - 2.0 * tl.log(sum_exp))
        if HAS_MEAN:
            tl.store(mean_ptr + row, z_sum / n_cols)
        if HAS_TOP1:
            tl.store(top1_ptr + row, (argmax == label).to(tl.int8))
        if COMPUTE_GRAD:
            _grad_pass(
                row_ptr,
                label,
                log_z,
                entropy,
                tl.load(scale_ptr),
                0.0,
                n_cols,
                logit_scale,
                softcap,
                inv_t,
                cols,
                HAS_SOFTCAP,
                True,
                False,
                BLOCK_V,
            )


@triton.jit
def _token_grad_kernel(
    logits_ptr,  # [rows, n_cols] input dtype; overwritten with the gradient
    logits_row_stride,
    labels_ptr,
    log_z_ptr,
    entropy_ptr,
    g_lp_ptr,
    g_ent_ptr,
    n_cols,
    ignore_index,
    logit_scale,
    softcap,
    inv_t,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LP_GRAD: tl.constexpr,
    HAS_ENT_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    if label == ignore_index:
        _zero_row(row_ptr, n_cols, cols, BLOCK_V)
    else:
        g_lp = 0.0
        g_ent = 0.0
        entropy = 0.0
        if HAS_LP_GRAD:
            g_lp = tl.load(g_lp_ptr + row)
        if HAS_ENT_GRAD:
            g_ent = tl.load(g_ent_ptr + row)
            entropy = tl.load(entropy_ptr + row)
        _grad_pass(
            row_ptr,
            label,
            tl.load(log_z_ptr + row),
            entropy,
            g_lp,
            g_ent,
            n_cols,
            logit_scale,
            softcap,
            inv_t,
            cols,
            HAS_SOFTCAP,
            HAS_LP_GRAD,
            HAS_ENT_GRAD,
            BLOCK_V,
        )


def _check(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a 2-D tensor with contiguous rows, got shape {tuple(logits.shape)}")
    if labels.shape != (logits.shape[0],):
        raise ValueError(f"labels must have shape ({logits.shape[0]},), got {tuple(labels.shape)}")


def _num_warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


def token_stats_chunk(
    logits,
    labels,
    head,
    *,
    entropy,
    log_sum_sq_probs,
    mean_logits,
    is_top1,
    scale=None,
    scratch=None,
    block_v=None,
):
    """Triton twin of ``fasttrain.loss.token_stats_torch.token_stats_chunk`` (same arguments and results);
    the gradient, when asked for, is written into ``logits`` and returned."""
    _check(logits, labels)
    rows, n_cols = logits.shape
    f32 = {"dtype": torch.float32, "device": logits.device}
    out = {"log_probs": torch.empty(rows, **f32), "log_z": torch.empty(rows, **f32)}
    wanted = {"entropy": entropy, "log_sum_sq_probs": log_sum_sq_probs, "mean_logits": mean_logits}
    for name, on in wanted.items():
        if on:
            out[name] = torch.empty(rows, **f32)
    top1 = torch.empty(rows, dtype=torch.int8, device=logits.device) if is_top1 else None
    if rows:
        block = block_v or pick_block_v(n_cols)
        dummy = out["log_z"]
        _token_stats_kernel[(rows,)](
            logits,
            logits.stride(0),
            labels.contiguous(),
            out["log_probs"],
            out["log_z"],
            out.get("entropy", dummy),
            out.get("log_sum_sq_probs", dummy),
            out.get("mean_logits", dummy),
            dummy if top1 is None else top1,
            dummy if scale is None else scale.to(device=logits.device, dtype=torch.float32).reshape(1),
            n_cols,
            head.ignore_index,
            head.logit_scale,
            head.softcap or 1.0,
            head.inv_temperature,
            HAS_SOFTCAP=head.softcap is not None,
            HAS_ENTROPY=entropy,
            HAS_LOG_SUM_SQ=log_sum_sq_probs,
            HAS_MEAN=mean_logits,
            HAS_TOP1=is_top1,
            COMPUTE_GRAD=scale is not None,
            BLOCK_V=block,
            num_warps=_num_warps(block),
        )
    if top1 is not None:
        out["is_top1"] = top1.bool()
    return out, (None if scale is None else logits)


def token_grad_chunk(
    logits, labels, log_z, entropy, grad_log_probs, grad_entropy, head, scratch=None, *, block_v=None
):
    """Triton twin of ``fasttrain.loss.token_stats_torch.token_grad_chunk``: the gradient, in place."""
    _check(logits, labels)
    rows, n_cols = logits.shape
    if rows:
        block = block_v or pick_block_v(n_cols)
        _token_grad_kernel[(rows,)](
            logits,
            logits.stride(0),
            labels.contiguous(),
            log_z,
            log_z if entropy is None else entropy,
            log_z if grad_log_probs is None else grad_log_probs.contiguous(),
            log_z if grad_entropy is None else grad_entropy.contiguous(),
            n_cols,
            head.ignore_index,
            head.logit_scale,
            head.softcap or 1.0,
            head.inv_temperature,
            HAS_SOFTCAP=head.softcap is not None,
            HAS_LP_GRAD=grad_log_probs is not None,
            HAS_ENT_GRAD=grad_entropy is not None,
            BLOCK_V=block,
            num_warps=_num_warps(block),
        )
    return logits
