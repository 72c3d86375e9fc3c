"""PyTorch twin of the chunked LM head's per-chunk math: the same contract as the Triton kernels in
``fasttrain.kernels.lm_head`` (used on CPU and wherever Triton is unavailable).

A chunk is ``logits [rows, V]`` (the compute dtype, the raw ``hidden @ weight.T (+ bias)``); it is read, never
written, by ``row_stats``, and receives the gradient from ``row_grad``. The head transform is TRL's:
``z = softcap * tanh(logit_scale * logits / softcap) / temperature`` (softcap optional; the cross-entropy uses
the softcap alone). Per row, in fp32:

    log_z = logsumexp(z)        target = z[label]         sum_z = sum_j z_j
    entropy = log_z - sum_j p_j z_j     log_sum_sq_probs = log(sum_j p_j**2)    is_top1 = label is the first argmax

and the gradient, for per-row coefficients ``a, c, d, g_ent`` chosen by each head (the cross-entropy, log-prob
and entropy gradients all have this form):

    d/dz_j = a p_j + c [j == label] + d - g_ent p_j (log p_j + entropy)

then times ``d z / d logits = logit_scale / temperature * (1 - tanh**2)``, computed in fp32 and rounded once to
the logits' dtype. Rows whose label is ``ignore_index`` get zeros (statistics and gradient). Temporaries are
chunk-sized, taken from ``scratch`` (reused from chunk to chunk) when one is given.
"""

from __future__ import annotations

import torch

from .chunked_head import Scratch

__all__ = ["HeadTransform", "row_grad", "row_stats"]


class HeadTransform:
    """TRL's logit transform (scale, optional softcap, temperature) and the ignored label."""

    __slots__ = ("ignore_index", "inv_temperature", "logit_scale", "softcap")

    def __init__(self, temperature=1.0, logit_scale=1.0, softcap=None, ignore_index=-100) -> None:
        self.inv_temperature = 1.0 / float(temperature)
        self.logit_scale = float(logit_scale)
        self.softcap = None if softcap is None else float(softcap)
        self.ignore_index = int(ignore_index)


def _buffer(scratch: Scratch | None, name: str, like: torch.Tensor) -> torch.Tensor:
    if scratch is None:
        return torch.empty(like.shape, dtype=torch.float32, device=like.device)
    return scratch.take(name, (like.shape[0], like.shape[1]), torch.float32, like.device)


def _transform(logits, head: HeadTransform, scratch, keep_tanh: bool):
    """(z, tanh or None): ``logits`` itself (only read) where the transform is the identity, the common case,
    else an fp32 buffer; ``logits`` stays as it is."""
    if head.logit_scale == 1.0 and head.softcap is None and head.inv_temperature == 1.0:
        return logits, None
    z = _buffer(scratch, "z", logits).copy_(logits)
    if head.logit_scale != 1.0:
        z.mul_(head.logit_scale)
    tanh = None
    if head.softcap is not None:
        z.div_(head.softcap).tanh_()
        if keep_tanh:
            tanh = _buffer(scratch, "tanh", z).copy_(z)
        z.mul_(head.softcap)
    if head.inv_temperature != 1.0:
        z.mul_(head.inv_temperature)
    return z, tanh


def _minus(z, logits, row_value, out):
    """``z - row_value`` (fp32): in place in a buffer of ours, else into ``out``. From bf16/fp16 logits, a copy
    into ``out`` then an in-place subtraction: torch's mixed-dtype ``sub(out=)`` was 6x slower on CPU (74 ms
    against 12 ms for 256 x 151,936 values)."""
    if z is not logits:
        return z.sub_(row_value.unsqueeze(1))
    if out is logits or out.dtype == z.dtype:
        return torch.sub(z, row_value.unsqueeze(1), out=out)
    return out.copy_(z).sub_(row_value.unsqueeze(1))


def _row_dot(a, b, scratch) -> torch.Tensor:
    """Row-wise dot products through torch's sum (cascade summation): for sum p**2 a bmm dot product (one running
    fp32 sum over the vocabulary) was 19.7x farther from float64 than the reference at vocab 70,001."""
    return torch.mul(a, b, out=_buffer(scratch, "product", a)).sum(dim=-1)


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
):
    """{"log_z", "target", and the requested "sum_z", "entropy", "log_sum_sq_probs", "is_top1"}, each [rows].

    ``reuse``: a ``row_grad`` on the same logits follows; where the transform is the identity, ``"_exp"`` then
    hands it this pass's exponentials (one exp pass over the chunk instead of two), and fp32 logits are used as
    the buffer (consumed)."""
    z, _ = _transform(logits, head, scratch, keep_tanh=False)
    reuse = reuse and z is logits
    valid = labels != head.ignore_index
    safe = torch.where(valid, labels, 0).unsqueeze(1)
    out = {"target": z.gather(1, safe).squeeze(1).float()}
    if sum_z:
        out["sum_z"] = z.sum(dim=-1, dtype=torch.float32)
    if top1:
        row_max, first_argmax = z.max(dim=-1)  # the first maximal index, as TRL's kernel counts a tie
        out["is_top1"] = (first_argmax == labels) & valid
    else:
        row_max = z.amax(dim=-1)
    row_max = row_max.float()
    consume = reuse and logits.dtype == torch.float32
    shifted = _minus(z, logits, row_max, logits if consume else _buffer(scratch, "shifted", logits))
    exp = torch.exp(shifted, out=_buffer(scratch, "exp", shifted)) if entropy else shifted.exp_()
    sum_exp = exp.sum(dim=-1)
    log_sum = sum_exp.log()
    out["log_z"] = row_max + log_sum
    if entropy:  # log_z - sum p z = log(sum e) - sum e (z - max) / sum e; a bmm dot product: no temporary,
        # and within the bound at vocab 70,001 (3.2x the reference's distance where log_sum_sq_probs was 19.7x)
        out["entropy"] = log_sum - torch.bmm(exp.unsqueeze(1), shifted.unsqueeze(2)).reshape(-1) / sum_exp
    if log_sum_sq:
        out["log_sum_sq_probs"] = _row_dot(exp, exp, scratch).log() - 2.0 * log_sum
    zero = sum_exp.new_zeros(())
    out = {k: v if k == "is_top1" else torch.where(valid, v, zero) for k, v in out.items()}
    if reuse:
        out["_exp"] = (exp, sum_exp)
    return out


def row_grad(logits, labels, head, log_z, a, c, d=None, g_ent=None, entropy=None, scratch=None, exp=None):
    """The gradient with respect to ``logits`` for the per-row coefficients ``a``, ``c`` and, where not None,
    ``d`` and ``g_ent`` (with ``entropy``) of the module docstring, written into ``logits`` and returned.
    ``exp``: ``row_stats``' ``"_exp"`` for these logits (then ``p = exp / sum``, no second exp pass)."""
    valid = labels != head.ignore_index
    if exp is not None and g_ent is None:  # the identity transform (row_stats hands exp only then)
        e, sum_exp = exp
        grad, tanh = e.mul_((a / sum_exp).unsqueeze(1)), None  # a p
    else:
        grad, tanh = _grad_from_logits(logits, head, log_z, a, g_ent, entropy, scratch)
    if d is not None:
        grad.add_(d.unsqueeze(1))
    grad.scatter_add_(1, torch.where(valid, labels, 0).unsqueeze(1), c.unsqueeze(1))
    if tanh is not None:
        grad.mul_(tanh.mul_(tanh).neg_().add_(1.0))
    factor = head.logit_scale * head.inv_temperature
    if factor != 1.0:
        grad.mul_(factor)
    if not bool(valid.all()):  # zeros, not a product: an inf or NaN coefficient stays off these rows
        grad[~valid] = 0.0
    return grad if grad is logits else logits.copy_(grad)


def _grad_from_logits(logits, head, log_z, a, g_ent, entropy, scratch):
    """``a p - g_ent p (log p + H)`` (fp32; in ``logits`` itself where they are fp32 and untransformed), tanh."""
    z, tanh = _transform(logits, head, scratch, keep_tanh=True)
    in_place = z is logits and logits.dtype == torch.float32
    log_p = _minus(z, logits, log_z, logits if in_place else _buffer(scratch, "shifted", logits))
    if g_ent is None:
        return log_p.exp_().mul_(a.unsqueeze(1)), tanh
    p = torch.exp(log_p, out=_buffer(scratch, "exp", log_p))
    return p.mul_(log_p.add_(entropy.unsqueeze(1)).mul_(g_ent.unsqueeze(1)).sub_(a.unsqueeze(1))).neg_(), tanh


def chunk_fns(backend: str, device: torch.device, what: str):
    """(row_stats, row_grad) for ``backend`` on ``device``: the Triton kernels or this module's twins."""
    from .._backend import resolve_backend

    if resolve_backend(backend, device, what) == "torch":
        return row_stats, row_grad
    from fasttrain.kernels.lm_head import row_grad as triton_grad
    from fasttrain.kernels.lm_head import row_stats as triton_stats

    return triton_stats, triton_grad
