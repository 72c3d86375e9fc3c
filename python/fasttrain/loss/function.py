"""``fused_linear_cross_entropy``: cross-entropy of ``hidden @ weight.T (+ bias)`` without the full logits.

The chunking, matmuls, precision and speculation are ``chunked_head``'s; this module plugs the per-chunk
cross-entropy into it (the Triton kernels of ``fasttrain.kernels.lm_head``, or their torch twins,
``lm_head_torch``) and reduces the per-token losses. For ``"mean"``/``"sum"`` the upstream gradient of every
scored token is known in the forward (``1/denominator``, or 1), so the forward computes the gradients for it
(see ``chunked_head``: used only where exact, else recomputed); ``"none"`` always recomputes in backward.

Empty means keep torch's semantics, because the Trainer relies on them (its evaluation loop drops NaN
batch losses, its training loop NaN/inf steps): a mean over zero non-ignored tokens is ``0 / 0`` = NaN with
zero gradients (``F.cross_entropy``); ``num_items_in_batch=0`` divides by zero like ``ForCausalLMLoss``
(NaN when every token is ignored, with zero gradients; else inf, with non-finite gradients on the scored
tokens). One deliberate difference: the softcap is applied in fp32 (the Gemma2 reference applies it in
the model dtype).
"""

from __future__ import annotations

from typing import Any

import torch

from .._backend import check_backend
from .chunked_head import (
    MIN_CHUNK_ROWS,
    check_labels,
    check_operands,
    default_chunk_rows,
    head_with_grads,
    run_head,
    widens_weight_grad,
)
from .lm_head_torch import HeadTransform, chunk_fns

__all__ = ["MIN_CHUNK_ROWS", "default_chunk_rows", "fused_linear_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


class _CrossEntropyMath:
    """The per-chunk cross-entropy for ``chunked_head``: one output, the per-token loss (fp32). On the
    (soft-capped) logits ``s``, with ``eps`` the label smoothing, the formula of ``F.cross_entropy``:

        loss = log_z - (1 - eps) s[y] - eps / V sum(s) + z_loss log_z**2
        d loss / d s_j = p_j (1 + 2 z_loss log_z) - eps / V - (1 - eps) [j == y]
    """

    n_differentiable = 1

    def __init__(self, labels: torch.Tensor, backend: str, opts: dict[str, Any], vocab: int) -> None:
        self.stats_fn, self.grad_fn = chunk_fns(backend, labels.device, "fused_linear_cross_entropy")
        self.head = HeadTransform(softcap=opts["softcap"], ignore_index=opts["ignore_index"])
        self.labels, self.vocab = labels, vocab
        self.eps, self.z_loss = opts["label_smoothing"], opts["z_loss"]
        self.valid = labels != self.head.ignore_index
        f32 = {"dtype": torch.float32, "device": labels.device}
        self.loss: torch.Tensor | None = torch.empty(labels.shape[0], **f32)
        self.log_z = torch.empty(labels.shape[0], **f32)  # for the backward

    def forward_chunk(self, logits, lo, hi, scale, scratch):
        return self._forward_chunk(logits, lo, hi, scale, scratch, record=True)

    def replay_chunk(self, logits, lo, hi, scale, scratch):
        """``forward_chunk``'s gradient for ``scale`` again, the same operations, recording nothing (its ``log_z``
        was recorded by the forward: the same values): a weight gradient computed later (``chunked_head``)."""
        return self._forward_chunk(logits, lo, hi, scale, scratch, record=False)

    def _forward_chunk(self, logits, lo, hi, scale, scratch, record):
        stats = self.stats_fn(
            logits,
            self.labels[lo:hi],
            self.head,
            sum_z=self.eps > 0,
            scratch=scratch,
            reuse=scale is not None,
        )
        log_z, loss = stats["log_z"], stats["log_z"] - (1.0 - self.eps) * stats["target"]
        if self.eps:
            loss = loss - (self.eps / self.vocab) * stats["sum_z"]
        if self.z_loss:
            loss = loss + self.z_loss * log_z * log_z
        if record:
            assert self.loss is not None
            self.loss[lo:hi] = torch.where(self.valid[lo:hi], loss, 0.0)
            self.log_z[lo:hi] = log_z
        return None if scale is None else self._grad(logits, lo, hi, scale, scratch, stats.get("_exp"))

    def backward_chunk(self, logits, lo, hi, upstream, scratch):
        return self._grad(logits, lo, hi, upstream[0][lo:hi], scratch)

    def _grad(self, logits, lo, hi, scale, scratch, exp=None):
        s = scale.float().expand(hi - lo)
        log_z = self.log_z[lo:hi]
        a = s * (1.0 + 2.0 * self.z_loss * log_z) if self.z_loss else s
        smooth = -(self.eps / self.vocab) * s if self.eps else None  # None: no 0 * an inf scale (NaN)
        c = -(1.0 - self.eps) * s
        return self.grad_fn(
            logits, self.labels[lo:hi], self.head, log_z, a, c, smooth, scratch=scratch, exp=exp
        )

    def take_outputs(self):
        loss, self.loss = self.loss, None
        return (loss,)


def _validate(hidden, weight, bias, labels, reduction, label_smoothing, z_loss, softcap, backend, num_items):
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point():
        raise TypeError(
            f"hidden must be a floating-point tensor, got {getattr(hidden, 'dtype', type(hidden))}"
        )
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            f"weight must be a 2-D [vocab, hidden] tensor, got shape {tuple(getattr(weight, 'shape', ()))}"
        )
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden's last dimension ({hidden.shape[-1] if hidden.dim() else None}) must equal weight's "
            f"hidden dimension ({weight.shape[1]}); weight is [vocab, hidden] = {tuple(weight.shape)}"
        )
    check_operands(hidden, weight, bias, labels)
    if labels.numel() != hidden.numel() // hidden.shape[-1]:
        raise ValueError(
            f"labels must have one entry per token: hidden {tuple(hidden.shape)} has "
            f"{hidden.numel() // hidden.shape[-1]} tokens, labels {tuple(labels.shape)} has {labels.numel()}"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    check_backend(backend, "fused_linear_cross_entropy")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if z_loss < 0.0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    if num_items is not None and reduction != "mean":
        raise ValueError(f"num_items_in_batch only applies to reduction='mean', got reduction={reduction!r}")


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | float | None = None,
    backend: str = "auto",
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, chunked over tokens.

    ``hidden``: ``[..., H]``; ``weight``: ``[V, H]``; ``labels``: one integer per token, already aligned
    with ``hidden`` (no shift inside). Semantics of the reference: logits in the input dtype, then in
    fp32 ``softcap * tanh(logits / softcap)`` if set; per-token loss = ``F.cross_entropy(...,
    ignore_index, label_smoothing, reduction="none") + z_loss * logsumexp(logits)**2`` on non-ignored
    tokens (0 on ignored ones); ``"mean"`` divides the sum by the non-ignored count, or by
    ``num_items_in_batch`` when given; ``"none"`` returns fp32 with ``labels``' shape.

    Empty batches behave as in torch (the Trainer relies on it): ``"mean"`` with every label ignored is
    NaN (``0 / 0``) with zero gradients; ``num_items_in_batch=0`` gives ``sum / 0``: NaN with zero
    gradients when every label is ignored, else inf, with non-finite gradients (NaN/inf) on the scored
    tokens' rows and zero ones elsewhere, as ``ForCausalLMLoss`` gives.

    ``backend``: ``"auto"`` (Triton on CUDA, else PyTorch), ``"triton"`` (CPU needs TRITON_INTERPRET=1)
    or ``"torch"``. ``chunk_rows`` overrides the chunk size rule (``default_chunk_rows``). Under autocast
    the matmul runs in the autocast dtype, like ``nn.Linear``.
    """
    options = dict(
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        reduction=reduction,
        backend=backend,
        chunk_rows=chunk_rows,
    )
    if torch.compiler.is_compiling():
        if reduction in ("mean", "sum"):  # a scalar loss: one custom op in the graph (loss/compiled.py)
            from .compiled import fused_in_graph

            return fused_in_graph(
                hidden, weight, labels, bias, num_items_in_batch=num_items_in_batch, **options
            )
        return _eager_outside_graph(
            hidden, weight, labels, bias, num_items_in_batch=num_items_in_batch, **options
        )
    return eager_fused_linear_cross_entropy(
        hidden, weight, labels, bias, num_items_in_batch=num_items_in_batch, **options
    )


def eager_fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    reduction: str = "mean",
    num_items_in_batch: torch.Tensor | int | float | None = None,
    backend: str = "auto",
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``fused_linear_cross_entropy`` run eagerly: the chunk loop around the custom autograd Function."""
    _validate(
        hidden, weight, bias, labels, reduction, label_smoothing, z_loss, softcap, backend, num_items_in_batch
    )
    hidden_2d, rows, denominator, predicted, math = _prepare(
        hidden, weight, labels, ignore_index, label_smoothing, z_loss, softcap, reduction,
        num_items_in_batch, backend, chunk_rows,
    )  # fmt: skip
    (per_token,) = run_head(hidden_2d, weight, bias, math, rows, predicted)
    if reduction == "none":
        return per_token.reshape(labels.shape)
    total = per_token.sum()
    return total if denominator is None else total / denominator  # torch's 0 / 0 = NaN, x / 0 = inf


def _prepare(
    hidden,
    weight,
    labels,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    reduction,
    num_items,
    backend,
    chunk_rows,
):
    """(hidden as [N, H], chunk rows, the mean's denominator or None, the upstream each scored token's loss will
    get, the chunk math), after the checks that need the labels' values."""
    hidden_2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    labels_1d = labels.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    check_labels(labels_1d, weight.shape[0], ignore_index)
    widened = widens_weight_grad(hidden_2d, weight)
    rows = (
        chunk_rows
        if chunk_rows is not None
        else default_chunk_rows(*hidden_2d.shape, weight.shape[0], widened_weight_grad=widened)
    )
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {rows}")
    denominator = None
    if reduction == "mean":
        counted = (labels_1d != ignore_index).sum() if num_items is None else num_items
        denominator = torch.as_tensor(counted, device=hidden.device).float()
    opts = {
        "ignore_index": int(ignore_index),
        "label_smoothing": float(label_smoothing),
        "z_loss": float(z_loss),
        "softcap": None if softcap is None else float(softcap),
    }
    # the upstream gradient each scored token's loss will get from the reduction (1 / 0 = inf when nothing is
    # counted: the scored rows get torch's non-finite gradients, ignored rows stay exactly zero)
    predicted = None if reduction == "none" else (1.0 if denominator is None else 1.0 / denominator)
    return (
        hidden_2d,
        rows,
        denominator,
        predicted,
        _CrossEntropyMath(labels_1d, backend, opts, weight.shape[0]),
    )


def scalar_loss_and_grads(hidden, weight, labels, bias, needs, *, num_items_in_batch, reduction, **options):
    """A ``"mean"`` or ``"sum"`` loss and the gradients of the inputs in ``needs`` (None for the others), computed
    together without autograd: the custom op of the compiled path (``loss/compiled.py``)."""
    _validate(
        hidden, weight, bias, labels, reduction, options["label_smoothing"], options["z_loss"], options["softcap"],
        options["backend"], num_items_in_batch,
    )  # fmt: skip
    hidden_2d, rows, denominator, predicted, math = _prepare(
        hidden, weight, labels, options["ignore_index"], options["label_smoothing"], options["z_loss"],
        options["softcap"], reduction, num_items_in_batch, options["backend"], options["chunk_rows"],
    )  # fmt: skip
    (per_token,), grads = head_with_grads(hidden_2d, weight, bias, math, rows, predicted, needs)
    total = per_token.sum()
    loss = total if denominator is None else total / denominator
    grad_hidden = None if grads[0] is None else grads[0].reshape(hidden.shape)
    return loss, (grad_hidden, grads[1], grads[2])


# a per-token loss ("none") gets a per-token upstream gradient: eager, behind a graph break
_eager_outside_graph = torch.compiler.disable(eager_fused_linear_cross_entropy)
