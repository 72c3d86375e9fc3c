"""PyTorch version of one chunk of the chunked cross-entropy: the same contract as the Triton kernel
``fasttrain.kernels.cross_entropy.cross_entropy_chunk`` (per-row loss and log-sum-exp in fp32; with
``compute_grad`` the logits are overwritten in place with ``scale * d loss / d logits``).

Used on CPU (and wherever Triton is unavailable): the chunking around it is the same, so the memory
saving holds here too; the temporaries below are chunk-sized.
"""

from __future__ import annotations

import torch

__all__ = ["cross_entropy_chunk"]


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
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n_cols = logits.shape
    x = logits.float()  # [rows, V] fp32: a copy for bf16/fp16, the logits themselves for fp32
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(x / softcap)
        x = tanh * softcap
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, 0).unsqueeze(1)  # ignored rows read column 0, then masked
    target = x.gather(1, safe_labels).squeeze(1)
    logit_sum = x.sum(dim=-1) if label_smoothing else None
    # One exponential pass serves both the log-sum-exp and the gradient: x <- exp(x - max) in place
    # (x is chunk-owned: a copy, or fp32 logits that are consumed by now).
    row_max = x.amax(dim=-1, keepdim=True)
    x.sub_(row_max).exp_()
    sum_exp = x.sum(dim=-1)
    lse = row_max.squeeze(1) + sum_exp.log()
    loss = lse - target
    if label_smoothing:
        loss = lse - (1.0 - label_smoothing) * target - (label_smoothing / n_cols) * logit_sum
    if z_loss:
        loss = loss + z_loss * lse * lse
    zero = loss.new_zeros(())
    loss = torch.where(valid, loss, zero)
    lse_out = torch.where(valid, lse, zero)
    if not compute_grad:
        return loss, lse_out

    assert scale is not None
    # where, not a product: an ignored row's gradient is exactly 0 even for an inf scale (num_items_in_batch=0)
    row_scale = torch.where(
        valid, scale.to(device=x.device, dtype=torch.float32).reshape(-1).expand(rows), 0.0
    )
    softmax_scale = row_scale * (1.0 + 2.0 * z_loss * lse) if z_loss else row_scale
    # grad = softmax * softmax_scale - smoothing - (1 - eps) * onehot, built in place in x
    grad = x.mul_((softmax_scale / sum_exp).unsqueeze(1))
    if label_smoothing:
        grad.sub_((row_scale * (label_smoothing / n_cols)).unsqueeze(1))
    grad.scatter_add_(1, safe_labels, -(row_scale * (1.0 - label_smoothing)).unsqueeze(1))
    if tanh is not None:
        grad.mul_(tanh.mul_(tanh).neg_().add_(1.0))
    if grad.data_ptr() != logits.data_ptr():
        logits.copy_(grad)
    return loss, lse_out
