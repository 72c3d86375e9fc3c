"""PyTorch version of one chunk of the per-token log-prob statistics: the same contract as the Triton kernels
in ``fasttrain.kernels.token_logprobs`` (used on CPU and wherever Triton is unavailable).

A chunk is ``logits [rows, V]`` (input dtype, the raw ``hidden @ weight.T (+ bias)``). The head transform is
TRL's: ``z = softcap * tanh(logit_scale * logits / softcap) / temperature`` (softcap optional). Per row, in fp32:

    log_z = logsumexp(z)                  log_prob = z[label] - log_z
    entropy = log_z - sum_j p_j z_j       log_sum_sq_probs = log(sum_j p_j**2)
    mean_logits = mean_j z_j              is_top1 = (label is the first argmax of z)

Gradient with respect to ``z`` for upstream gradients ``g_lp`` (log-prob) and ``g_ent`` (entropy):

    d/dz_j = g_lp * ([j == label] - p_j) - g_ent * p_j * (log p_j + entropy)

then times ``d z / d logits = logit_scale / temperature * (1 - tanh**2)``. Rows whose label is ``ignore_index``
get zeros everywhere (statistics and gradient). Temporaries are chunk-sized, taken from ``scratch`` (reused
from chunk to chunk) when one is given; ``logits`` is consumed (it may come back holding the gradient).
"""

from __future__ import annotations

import torch

from .chunked_head import Scratch

__all__ = ["HeadTransform", "token_grad_chunk", "token_stats_chunk"]


class HeadTransform:
    """TRL's logit transform (scale, optional softcap, temperature) and the ignored label."""

    __slots__ = ("ignore_index", "inv_temperature", "logit_scale", "softcap")

    def __init__(
        self,
        temperature: float = 1.0,
        logit_scale: float = 1.0,
        softcap: float | None = None,
        ignore_index: int = -100,
    ) -> None:
        self.inv_temperature = 1.0 / float(temperature)
        self.logit_scale = float(logit_scale)
        self.softcap = None if softcap is None else float(softcap)
        self.ignore_index = int(ignore_index)


def _buffer(scratch: Scratch | None, name: str, like: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor shaped like ``like``: reused from ``scratch``, or new."""
    if scratch is None:
        return torch.empty(like.shape, dtype=torch.float32, device=like.device)
    return scratch.take(name, (like.shape[0], like.shape[1]), torch.float32, like.device)


def _transform(
    logits: torch.Tensor, head: HeadTransform, keep_tanh: bool, scratch: Scratch | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(z fp32, tanh or None); works in place on an fp32 ``logits``, else on one fp32 copy."""
    z = logits if logits.dtype == torch.float32 else _buffer(scratch, "z", logits).copy_(logits)
    if head.logit_scale != 1.0:
        z.mul_(head.logit_scale)
    tanh = None
    if head.softcap is not None:
        z.div_(head.softcap).tanh_()
        if keep_tanh:
            tanh = z
            z = torch.mul(tanh, head.softcap, out=_buffer(scratch, "capped", tanh))
        else:
            z.mul_(head.softcap)
    if head.inv_temperature != 1.0:
        z.mul_(head.inv_temperature)
    return z, tanh


def _finish_grad(
    grad: torch.Tensor,
    valid: torch.Tensor,
    tanh: torch.Tensor | None,
    head: HeadTransform,
    logits: torch.Tensor,
) -> torch.Tensor:
    """d/dz -> d/dlogits (chain rule through the transform), ignored rows zeroed, in ``logits``' dtype."""
    if not bool(valid.all()):
        grad.mul_(valid.unsqueeze(1))
    if tanh is not None:
        grad.mul_(tanh.mul_(tanh).neg_().add_(1.0))
    factor = head.logit_scale * head.inv_temperature
    if factor != 1.0:
        grad.mul_(factor)
    return grad if grad.dtype == logits.dtype else logits.copy_(grad)  # half precision: into the logits


def _row_dot(a: torch.Tensor, b: torch.Tensor, scratch: Scratch | None) -> torch.Tensor:
    """Row-wise dot products of two [rows, V] fp32 tensors through torch's sum (cascade summation): a bmm dot
    product accumulates the vocabulary in one running fp32 sum, 19.7x farther from float64 at vocab 70,001."""
    return torch.mul(a, b, out=_buffer(scratch, "product", a)).sum(dim=-1)


def token_stats_chunk(
    logits: torch.Tensor,  # [rows, V], consumed
    labels: torch.Tensor,  # [rows] int64
    head: HeadTransform,
    *,
    entropy: bool,
    log_sum_sq_probs: bool,
    mean_logits: bool,
    is_top1: bool,
    scale: torch.Tensor | None = None,
    scratch: Scratch | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Per-row statistics ({"log_probs", "log_z", and the requested ones}) and, with ``scale`` (an fp32
    scalar), the gradient of the log-probs for an upstream gradient of ``scale`` on every scored row (input
    dtype; the scale applied in fp32 before the gradient is rounded)."""
    vocab = logits.shape[1]
    z, tanh = _transform(logits, head, scale is not None, scratch)
    valid = labels != head.ignore_index
    safe = torch.where(valid, labels, 0).unsqueeze(1)
    out: dict[str, torch.Tensor] = {}
    target = z.gather(1, safe).squeeze(1)
    if mean_logits:
        out["mean_logits"] = z.sum(dim=-1) / vocab
    if is_top1:
        row_max, first_argmax = z.max(dim=-1)  # the first maximal index, as TRL's kernel counts a tie
        out["is_top1"] = (first_argmax == labels) & valid
    else:
        row_max = z.amax(dim=-1)
    shifted = z.sub_(row_max.unsqueeze(1))  # z - max, in place
    exp = torch.exp(shifted, out=_buffer(scratch, "exp", shifted)) if entropy else shifted.exp_()
    sum_exp = exp.sum(dim=-1)
    log_sum = sum_exp.log()
    log_z = row_max + log_sum
    out["log_z"] = log_z
    out["log_probs"] = target - log_z
    if entropy:  # log_z - sum p z = log(sum e) - sum e (z - max) / sum e
        out["entropy"] = log_sum - _row_dot(exp, shifted, scratch) / sum_exp
    if log_sum_sq_probs:
        out["log_sum_sq_probs"] = _row_dot(exp, exp, scratch).log() - 2.0 * log_sum
    zero = log_z.new_zeros(())
    for name, value in out.items():
        if name != "is_top1":
            out[name] = torch.where(valid, value, zero)
    if scale is None:
        return out, None
    scale = scale.to(device=z.device, dtype=torch.float32)
    grad = exp.mul_((-scale / sum_exp).unsqueeze(1))  # -scale p
    grad.scatter_add_(1, safe, scale.expand_as(target).unsqueeze(1))  # + scale onehot
    return out, _finish_grad(grad, valid, tanh, head, logits)


def token_grad_chunk(
    logits: torch.Tensor,  # [rows, V], consumed
    labels: torch.Tensor,  # [rows]
    log_z: torch.Tensor,  # [rows] fp32
    entropy: torch.Tensor | None,  # [rows] fp32, needed with grad_entropy
    grad_log_probs: torch.Tensor | None,  # [rows] fp32
    grad_entropy: torch.Tensor | None,  # [rows] fp32
    head: HeadTransform,
    scratch: Scratch | None = None,
) -> torch.Tensor:
    """Gradient with respect to the chunk's logits (input dtype) for per-row upstream gradients."""
    z, tanh = _transform(logits, head, True, scratch)
    valid = labels != head.ignore_index
    log_p = z.sub_(log_z.unsqueeze(1))
    if grad_entropy is not None:
        assert entropy is not None
        p = torch.exp(log_p, out=_buffer(scratch, "exp", log_p))
        coef = log_p.add_(entropy.unsqueeze(1)).mul_(grad_entropy.unsqueeze(1))  # g_ent (log p + H)
        if grad_log_probs is not None:
            coef.add_(grad_log_probs.unsqueeze(1))
        grad = p.mul_(coef).neg_()
    else:
        assert grad_log_probs is not None
        grad = log_p.exp_().mul_((-grad_log_probs).unsqueeze(1))
    if grad_log_probs is not None:
        safe = torch.where(valid, labels, 0).unsqueeze(1)
        grad.scatter_add_(1, safe, grad_log_probs.unsqueeze(1).to(grad.dtype))
    return _finish_grad(grad, valid, tanh, head, logits)
