"""``fused_linear_cross_entropy``: cross-entropy of ``hidden @ weight.T (+ bias)`` without the full logits.

Layers: the per-chunk math is a Triton kernel (``fasttrain.kernels.cross_entropy``) or its PyTorch twin
(``torch_backend``); this module chunks the tokens, runs the output matmuls around it and wraps the
whole in a ``torch.autograd.Function``.

Memory: per chunk of ``rows`` tokens one ``[rows, vocab]`` logits buffer (input dtype) exists at a time;
the kernel overwrites it with the logit gradients, which are folded into ``grad_hidden`` (rows of it)
and ``grad_weight`` (an fp32 accumulator, ``[vocab, hidden]``) right away. Extra memory is therefore
O(rows x vocab) + the fp32 weight-gradient accumulator, never O(tokens x vocab).

Chunk size rule (``default_chunk_rows``): the chunk's logits hold about as many values as the hidden
states themselves (``rows ≈ tokens x hidden / vocab``), rounded up to a power of two, at least
``MIN_CHUNK_ROWS`` and at most the number of tokens. The floor matters: every chunk reads the weight
twice and reads and writes the ``[vocab, hidden]`` weight-gradient accumulator once, so tiny chunks turn
the three matmuls memory-bound (measured on CPU at hidden 256-512, vocab 151,936: 32-row chunks were
~1.7x slower than 512-row ones, 128-row ones ~1.2x slower than 256-row ones).

Gradients: for ``reduction="mean"``/``"sum"`` they are computed during the forward (one matmul saved:
the logits are not recomputed) for an upstream gradient of 1 and scaled by the real upstream gradient
(a device scalar, no host sync) in backward. For ``reduction="none"`` each token's upstream gradient is
only known in backward, so the backward recomputes the chunks with those per-row scales.

Empty means keep torch's semantics, because the Trainer relies on them (its evaluation loop drops NaN
batch losses, its training loop NaN/inf steps): a mean over zero non-ignored tokens is ``0 / 0`` = NaN with
zero gradients (``F.cross_entropy``); ``num_items_in_batch=0`` divides by zero like ``ForCausalLMLoss``
(NaN when every token is ignored, with zero gradients; else inf, with non-finite gradients on the scored
tokens). One deliberate difference: the softcap is applied in fp32 (the Gemma2 reference applies it in
the model dtype).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .._backend import check_backend, resolve_backend
from . import torch_backend
from ._matmul import Scratch, addmm_fp32, chunk_logits

__all__ = ["MIN_CHUNK_ROWS", "default_chunk_rows", "fused_linear_cross_entropy"]

MIN_CHUNK_ROWS = 256
_REDUCTIONS = ("mean", "sum", "none")


def default_chunk_rows(n_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Tokens per chunk: the chunk's logits about the size of the hidden states (see module docstring)."""
    if n_tokens <= 0:
        return 1
    rows = 1 << max(0, math.ceil(n_tokens * hidden_size / max(vocab_size, 1)) - 1).bit_length()
    return max(1, min(n_tokens, max(MIN_CHUNK_ROWS, rows)))


def _chunk_fn(backend: str, device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    if resolve_backend(backend, device, "fused_linear_cross_entropy") == "torch":
        return torch_backend.cross_entropy_chunk
    from fasttrain.kernels.cross_entropy import cross_entropy_chunk

    return cross_entropy_chunk


def _run_chunks(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    labels: torch.Tensor,  # [N] int64
    scale: torch.Tensor | None,  # fp32, 1 or N elements; None: no gradients
    opts: dict[str, Any],
    chunk_rows: int,
    needs: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Per-token loss (fp32 [N]) and, when ``scale`` is given, the gradients it asks for."""
    n_tokens = hidden.shape[0]
    chunk_fn = opts["chunk_fn"]
    compute_grad = scale is not None and any(needs)
    loss = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if compute_grad and needs[0] else None
    grad_weight = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if compute_grad and needs[1]
        else None
    )
    grad_bias = (
        torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        if compute_grad and needs[2] and bias is not None
        else None
    )
    scratch = Scratch()  # one logits buffer for every chunk
    for start in range(0, n_tokens, chunk_rows):
        end = min(start + chunk_rows, n_tokens)
        h = hidden[start:end]
        logits = chunk_logits(h, weight, bias, scratch)  # [rows, V]
        row_scale = None
        if compute_grad:
            assert scale is not None
            row_scale = scale if scale.numel() == 1 else scale[start:end]
        loss[start:end], _ = chunk_fn(
            logits,
            labels[start:end],
            row_scale,
            ignore_index=opts["ignore_index"],
            label_smoothing=opts["label_smoothing"],
            z_loss=opts["z_loss"],
            softcap=opts["softcap"],
            compute_grad=compute_grad,
        )
        if not compute_grad:
            continue
        # logits now hold row_scale * d loss / d logits
        if grad_hidden is not None:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if grad_weight is not None:
            addmm_fp32(grad_weight, logits.t(), h)
        if grad_bias is not None:
            grad_bias += logits.sum(dim=0, dtype=torch.float32)
    return loss, grad_hidden, grad_weight, grad_bias


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, denominator, opts):  # type: ignore[override]
        needs = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        ctx.reduction = opts["reduction"]
        ctx.opts = opts
        ctx.bias_dtype = None if bias is None else bias.dtype
        chunk_rows = opts["chunk_rows"]
        if opts["reduction"] == "none":
            loss, *_ = _run_chunks(hidden, weight, bias, labels, None, opts, chunk_rows, needs)
            ctx.save_for_backward(hidden, weight, bias, labels)
            ctx.needs = needs
            return loss
        # mean / sum: gradients now, for an upstream gradient of 1
        scale = None
        if any(needs):
            # 1 / 0 = inf when nothing is counted: the scored rows get torch's non-finite gradients,
            # ignored rows stay exactly zero (the chunk functions zero them whatever the scale)
            scale = (
                torch.ones((), dtype=torch.float32, device=hidden.device)
                if denominator is None
                else 1.0 / denominator
            )
        loss, grad_hidden, grad_weight, grad_bias = _run_chunks(
            hidden, weight, bias, labels, scale, opts, chunk_rows, needs
        )
        total = loss.sum()
        if denominator is not None:
            total = total / denominator  # torch's semantics: 0 / 0 = NaN, x / 0 = inf
        # Held on ctx, not saved tensors: backward scales them in place (no second [V, H] buffer) and
        # drops them, so a second backward through this graph fails loudly instead of rescaling.
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        if ctx.reduction == "none":
            hidden, weight, bias, labels = ctx.saved_tensors
            scale = grad_output.reshape(-1).float()
            _, grad_hidden, grad_weight, grad_bias = _run_chunks(
                hidden, weight, bias, labels, scale, ctx.opts, ctx.opts["chunk_rows"], ctx.needs
            )
            if grad_weight is not None:
                grad_weight = grad_weight.to(weight.dtype)
        else:
            if ctx.grads is None:
                raise RuntimeError(
                    "fused_linear_cross_entropy: backward through the same graph a second time is not "
                    "supported for reduction='mean'/'sum' (its gradients are precomputed and consumed)"
                )
            grad_hidden, grad_weight, grad_bias = ctx.grads
            ctx.grads = None
            go = grad_output.float()
            if grad_hidden is not None:
                grad_hidden.mul_(go)
            if grad_weight is not None:
                grad_weight = grad_weight.mul_(go).to(ctx.weight_dtype)
            if grad_bias is not None:
                grad_bias.mul_(go)
        if grad_bias is not None:
            grad_bias = grad_bias.to(ctx.bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if labels.device.type == "cpu":
        if bool(bad.any()):
            pos = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"labels[{pos}] = {int(labels[pos])} is outside the vocabulary [0, {vocab}) "
                f"and is not ignore_index ({ignore_index})"
            )
    else:  # no host sync on the accelerator: a device-side assertion
        torch._assert_async(~bad.any(), f"a label is outside [0, {vocab}) and is not ignore_index")


def _check_operand_dtypes(hidden: torch.Tensor, weight: torch.Tensor, bias: Any, labels: Any) -> None:
    """Checks shared by every entry to the LM-head kernels (shapes of hidden/weight checked by the caller)."""
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != hidden.dtype):
        raise ValueError(
            f"bias must have shape ({weight.shape[0]},) and dtype {hidden.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {getattr(labels, 'dtype', type(labels))}")


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
    _check_operand_dtypes(hidden, weight, bias, labels)
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


@torch.compiler.disable  # a Python loop over chunks around a custom Function: run it eagerly under compile
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
    _validate(
        hidden, weight, bias, labels, reduction, label_smoothing, z_loss, softcap, backend, num_items_in_batch
    )
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        cast = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(cast), weight.to(cast)
        bias = None if bias is None else bias.to(cast)
    out_shape = labels.shape
    hidden_2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    labels_1d = labels.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    _check_labels(labels_1d, weight.shape[0], ignore_index)
    n_tokens = hidden_2d.shape[0]
    rows = (
        chunk_rows
        if chunk_rows is not None
        else default_chunk_rows(n_tokens, weight.shape[1], weight.shape[0])
    )
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {rows}")

    denominator = None
    if reduction == "mean":
        if num_items_in_batch is None:
            denominator = (labels_1d != ignore_index).sum().float()
        else:
            denominator = torch.as_tensor(num_items_in_batch, device=hidden.device).float()
    opts = {
        "chunk_fn": _chunk_fn(backend, hidden.device),
        "ignore_index": int(ignore_index),
        "label_smoothing": float(label_smoothing),
        "z_loss": float(z_loss),
        "softcap": None if softcap is None else float(softcap),
        "reduction": reduction,
        "chunk_rows": rows,
    }
    with torch.autocast(device_type, enabled=False):
        loss = _FusedLinearCrossEntropy.apply(hidden_2d, weight, bias, labels_1d, denominator, opts)
    return loss.reshape(out_shape) if reduction == "none" else loss
