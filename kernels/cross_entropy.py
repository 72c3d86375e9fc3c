"""Triton kernel for one chunk of a chunked cross-entropy: loss and logit gradients in one launch.

The caller (``fasttrain.loss.function``) computes a chunk of logits ``hidden_chunk @ weight.T (+ bias)``
in the input dtype and hands it here. One program per row (token):

- pass 1 streams the row in ``BLOCK_V`` vocab blocks with an online log-sum-exp (running max and
  rescaled sum of exponentials), accumulating in fp32 whatever the logits dtype; it also sums the
  (soft-capped) logits when label smoothing needs them;
- pass 2 (``COMPUTE_GRAD``) streams the row again and overwrites the logits *in place* with
  ``d loss / d logits`` already multiplied by the row's scale (``1/denominator`` for a mean, the
  upstream gradient for ``reduction="none"``), so no second chunk-sized buffer is needed.

Per-token loss on the (soft-capped) logits ``s``, with ``lse = logsumexp(s)``, ``eps`` the label
smoothing and ``V`` the vocabulary size (the same formula as ``F.cross_entropy(label_smoothing=eps)``):

    loss = lse - (1 - eps) * s[y] - eps / V * sum(s) + z_loss * lse**2
    d loss / d s_j = softmax(s)_j * (1 + 2 * z_loss * lse) - eps / V - (1 - eps) * [j == y]
    d s / d x = 1 - tanh(x / softcap)**2            (softcap; s = softcap * tanh(x / softcap))

Ignored rows (``label == ignore_index``) get loss 0 and a zero gradient row. Row offsets are 64-bit
(``row * stride`` overflows int32 above 2**31 elements: 16k tokens x 151,936 vocab already does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["cross_entropy_chunk", "pick_block_v"]


@triton.jit
def _tanh(x):
    # tl has no portable tanh (libdevice is CUDA-only, the interpreter lacks it); this form saturates
    # cleanly to +-1 for large |x| (exp overflows to inf, 2/inf = 0).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _zero_row(row_ptr, n_cols, cols, BLOCK_V: tl.constexpr):
    zeros = tl.zeros([BLOCK_V], dtype=tl.float32).to(row_ptr.dtype.element_ty)
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        tl.store(row_ptr + offs, zeros, mask=offs < n_cols)


@triton.jit
def _cross_entropy_chunk_kernel(
    logits_ptr,  # [rows, n_cols] input dtype; overwritten with d loss / d logits when COMPUTE_GRAD
    logits_row_stride,
    labels_ptr,  # [rows] int64
    scale_ptr,  # fp32: one value (scale_stride = 0) or one per row
    scale_stride,
    loss_ptr,  # [rows] fp32 out
    lse_ptr,  # [rows] fp32 out
    n_cols,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row)
    cols = tl.arange(0, BLOCK_V)

    if label == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        if COMPUTE_GRAD:
            _zero_row(row_ptr, n_cols, cols, BLOCK_V)
    else:
        _loss_and_grad_row(
            row_ptr,
            label,
            scale_ptr + row * scale_stride,
            loss_ptr + row,
            lse_ptr + row,
            n_cols,
            label_smoothing,
            z_loss,
            softcap,
            cols,
            HAS_SMOOTHING,
            HAS_Z_LOSS,
            HAS_SOFTCAP,
            COMPUTE_GRAD,
            BLOCK_V,
        )


@triton.jit
def _loss_and_grad_row(
    row_ptr,
    label,
    scale_ptr,
    loss_ptr,
    lse_ptr,
    n_cols,
    label_smoothing,
    z_loss,
    softcap,
    cols,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # pass 1: online log-sum-exp (+ sum of logits for label smoothing), fp32
    running_max = tl.full([], -float("inf"), tl.float32)
    running_sum = tl.zeros([], dtype=tl.float32)
    logit_sum = tl.zeros([], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            x = softcap * _tanh(x / softcap)
        x = tl.where(mask, x, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
        if HAS_SMOOTHING:
            logit_sum += tl.sum(tl.where(mask, x, 0.0), axis=0)
    lse = running_max + tl.log(running_sum)

    target = tl.load(row_ptr + label).to(tl.float32)
    if HAS_SOFTCAP:
        target = softcap * _tanh(target / softcap)
    loss = lse - target
    if HAS_SMOOTHING:
        loss = lse - (1.0 - label_smoothing) * target - label_smoothing / n_cols * logit_sum
    if HAS_Z_LOSS:
        loss += z_loss * lse * lse
    tl.store(loss_ptr, loss)
    tl.store(lse_ptr, lse)

    if COMPUTE_GRAD:
        scale = tl.load(scale_ptr).to(tl.float32)
        softmax_scale = scale
        if HAS_Z_LOSS:
            softmax_scale = scale * (1.0 + 2.0 * z_loss * lse)
        target_weight = scale
        smooth = 0.0
        if HAS_SMOOTHING:
            target_weight = scale * (1.0 - label_smoothing)
            smooth = scale * label_smoothing / n_cols
        # pass 2: gradient, written in place (each block is read before it is overwritten)
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                t = _tanh(x / softcap)
                x = softcap * t
            grad = tl.exp(x - lse) * softmax_scale
            if HAS_SMOOTHING:
                grad -= smooth
            grad = tl.where(offs == label, grad - target_weight, grad)
            if HAS_SOFTCAP:
                grad = grad * (1.0 - t * t)
            tl.store(row_ptr + offs, grad.to(row_ptr.dtype.element_ty), mask=mask)


def pick_block_v(n_cols: int) -> int:
    """Vocab block: a power of two, at most 4,096 fp32 values per program (registers), at least 16."""
    return max(16, min(4096, triton.next_power_of_2(n_cols)))


def cross_entropy_chunk(
    logits: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor | None,
    *,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    compute_grad: bool,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and log-sum-exp (fp32) of ``logits [rows, vocab]``; with ``compute_grad`` the logits
    are overwritten with ``scale * d loss / d logits``. ``scale``: fp32, one element or one per row."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a 2-D tensor with contiguous rows, got shape {tuple(logits.shape)}")
    rows, n_cols = logits.shape
    if labels.shape != (rows,):
        raise ValueError(f"labels must have shape ({rows},), got {tuple(labels.shape)}")
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return loss, lse
    if compute_grad:
        if scale is None:
            raise ValueError("compute_grad needs a scale tensor")
        scale = scale.to(device=logits.device, dtype=torch.float32).reshape(-1).contiguous()
        if scale.numel() not in (1, rows):
            raise ValueError(f"scale must have 1 or {rows} elements, got {scale.numel()}")
        scale_stride = 0 if scale.numel() == 1 else 1
    else:
        scale, scale_stride = loss, 0  # never read
    _cross_entropy_chunk_kernel[(rows,)](
        logits,
        logits.stride(0),
        labels.contiguous(),
        scale,
        scale_stride,
        loss,
        lse,
        n_cols,
        ignore_index,
        float(label_smoothing),
        float(z_loss),
        float(softcap) if softcap is not None else 1.0,
        HAS_SMOOTHING=label_smoothing != 0.0,
        HAS_Z_LOSS=z_loss != 0.0,
        HAS_SOFTCAP=softcap is not None,
        COMPUTE_GRAD=compute_grad,
        BLOCK_V=block_v or pick_block_v(n_cols),
        num_warps=8 if (block_v or pick_block_v(n_cols)) >= 2048 else 4,
    )
    return loss, lse
