"""References for fused_linear_cross_entropy and the helpers the loss tests share.

``reference_loss`` is the op fasttrain replaces, written out with materialised logits: ``F.linear`` in the
inputs' dtype, the logits upcast to fp32 as ``ForCausalLMLoss`` does, then ``F.cross_entropy``. Given float64
inputs it is the truth; given the inputs ours gets, it is the same-dtype reference (tests/_truth_ops.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_loss(
    hidden,
    weight,
    labels,
    bias=None,
    *,
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    reduction="mean",
    num_items_in_batch=None,
):
    """Materialised logits; the DESIGN.md contract (an empty mean is NaN, as in torch)."""
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
    if logits.dtype != torch.float64:
        logits = logits.float()  # ForCausalLMLoss upcasts the model's logits before the loss
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = labels.reshape(-1)
    valid = flat != ignore_index
    per_token = F.cross_entropy(
        logits, flat, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none"
    )
    per_token = per_token + z_loss * torch.logsumexp(logits, dim=-1) ** 2
    per_token = torch.where(valid, per_token, torch.zeros_like(per_token))
    if reduction == "none":
        return per_token.reshape(labels.shape)
    if reduction == "sum":
        return per_token.sum()
    denominator = valid.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    return per_token.sum() / denominator


def as_truth(t: torch.Tensor | None) -> torch.Tensor | None:
    """The exact value ours was given, in float64, as a leaf that records its gradient."""
    return None if t is None else t.detach().double().clone().requires_grad_()


def make_inputs(n, h, v, *, dtype=torch.float32, ignore_frac=0.0, bias=False, seed=0, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (2.0 / h**0.5)
    b = torch.randn(v, generator=g, dtype=torch.float64) * 0.5 if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    if ignore_frac:
        labels[torch.rand(n, generator=g) < ignore_frac] = ignore_index
    cast = [hidden.to(dtype), weight.to(dtype), None if b is None else b.to(dtype)]
    return cast, labels


def run_both(
    n, h, v, opts, *, dtype, backend, reduction, ignore_frac=0.0, bias=False, chunk_rows=None, seed=0
):
    """(name, ours, reference, truth) for the loss and every gradient, with a random upstream gradient.

    The reference is ``reference_loss`` on the inputs ours gets (torch's ops in ``dtype``), the truth the same
    in float64 on those exact values (the upstream gradient too)."""
    from fasttrain.loss import fused_linear_cross_entropy

    (hidden, weight, b), labels = make_inputs(
        n, h, v, dtype=dtype, ignore_frac=ignore_frac, bias=bias, seed=seed
    )
    ours_in = [t.clone().requires_grad_() if t is not None else None for t in (hidden, weight, b)]
    ref_in = [t.clone().requires_grad_() if t is not None else None for t in (hidden, weight, b)]
    truth_in = [as_truth(t) for t in (hidden, weight, b)]
    ours = fused_linear_cross_entropy(
        ours_in[0],
        ours_in[1],
        labels,
        ours_in[2],
        reduction=reduction,
        backend=backend,
        chunk_rows=chunk_rows,
        **opts,
    )
    ref = reference_loss(ref_in[0], ref_in[1], labels, ref_in[2], reduction=reduction, **opts)
    truth = reference_loss(truth_in[0], truth_in[1], labels, truth_in[2], reduction=reduction, **opts)
    upstream = (
        torch.randn(truth.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) + 0.5
    ).to(ours.dtype)
    (ours * upstream).sum().backward()
    (ref * upstream.to(ref.dtype)).sum().backward()
    (truth * upstream.double()).sum().backward()
    out = [("loss", ours.detach(), ref.detach(), truth.detach())]
    for name, o, r, t in zip(("hidden", "weight", "bias"), ours_in, ref_in, truth_in, strict=True):
        if o is not None:
            assert o.grad is not None and o.grad.dtype == o.dtype, name
            out.append((f"grad_{name}", o.grad, r.grad, t.grad))
    return out
