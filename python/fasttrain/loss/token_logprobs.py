"""``fused_token_log_probs``: per-token log-probs (and entropy, top-1 hits, ...) of ``hidden @ weight.T``
without the full logits — TRL's fused LM-head contract (``trl.kernels.ChunkedLogProbFunction``) served by
fasttrain's chunked kernel.

Layers, as in ``function.py``: the per-chunk math is a Triton kernel (``fasttrain.kernels.token_logprobs``)
or its PyTorch twin (``token_stats_torch``); this module chunks the tokens (``default_chunk_rows``), runs the
output matmuls around it and wraps the whole in a ``torch.autograd.Function``. One pass over each chunk's
logits computes every requested per-token output.

Gradients. The log-probs (and the entropy) get per-token upstream gradients, known only in backward, so by
default the backward recomputes each chunk's logits (4 matmuls in all, like TRL). Two cases avoid that
recompute by computing the gradients in the forward for an upstream gradient of 1 on every scored token:

- only the hidden states need a gradient (a frozen head, e.g. LoRA): each token's row of the hidden gradient
  is its own upstream value times that row (2 matmuls in all), whatever the upstream values;
- ``uniform_grad=True``, a speculation for callers whose loss is ``-sum(log_probs) / n`` (TRL's SFT ``nll``):
  the backward scales the weight, bias and hidden gradients by the upstream value if it is the same on every
  scored token (3 matmuls in all). Checking that reads one value on the host (a sync on a GPU).

Either way, if an entropy gradient arrives or the upstream is not uniform, the backward recomputes as usual,
so the result is right in every case.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._backend import check_backend, resolve_backend
from . import token_stats_torch
from ._matmul import Scratch, addmm_fp32, chunk_logits, has_fp32_addmm
from .function import _check_labels, _check_operand_dtypes, default_chunk_rows
from .token_stats_torch import HeadTransform

__all__ = ["OPTIONAL_OUTPUTS", "TokenStats", "fused_token_log_probs"]

OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class TokenStats(NamedTuple):
    """Per-token outputs, in TRL's order; ``None`` where not requested. fp32 except ``is_top1`` (bool)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    log_sum_sq_probs: torch.Tensor | None
    mean_logits: torch.Tensor | None
    is_top1: torch.Tensor | None


def _chunk_fns(backend: str, device: torch.device) -> tuple[Any, Any]:
    if resolve_backend(backend, device, "fused_token_log_probs") == "torch":
        return token_stats_torch.token_stats_chunk, token_stats_torch.token_grad_chunk
    from fasttrain.kernels.token_logprobs import token_grad_chunk, token_stats_chunk

    return token_stats_chunk, token_grad_chunk


def _grads_buffers(hidden, weight, bias, needs):
    grad_hidden = None
    if needs[0]:
        # fp32 accumulation where it is free (CUDA), like TRL's; on CPU the matmul's own output dtype
        half = hidden.dtype != torch.float32 and has_fp32_addmm(hidden)
        grad_hidden = (
            torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            if half
            else (torch.empty_like(hidden))
        )
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs[2] else None
    return grad_hidden, grad_weight, grad_bias


def _fold_grad(grads, grad_logits, weight, h, start, end) -> None:
    """grad_logits [rows, V] of rows start:end into the hidden / weight / bias gradients."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        if grad_hidden.dtype == grad_logits.dtype:
            torch.mm(grad_logits, weight, out=grad_hidden[start:end])
        else:
            addmm_fp32(grad_hidden[start:end], grad_logits, weight)
    if grad_weight is not None:
        addmm_fp32(grad_weight, grad_logits.t(), h)
    if grad_bias is not None:
        grad_bias += grad_logits.sum(dim=0, dtype=torch.float32)


def _cast_grads(grads, hidden, weight, bias):
    grad_hidden, grad_weight, grad_bias = grads
    return (
        None if grad_hidden is None else grad_hidden.to(hidden.dtype),
        None if grad_weight is None else grad_weight.to(weight.dtype),
        None if grad_bias is None else grad_bias.to(bias.dtype),
    )


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, opts):  # type: ignore[override]
        # entropy is usually logged, not trained on: without this, autograd would hand backward zeros for it
        ctx.set_materialize_grads(False)
        needs = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        # Only the hidden gradient needed (a frozen head, e.g. LoRA): any per-token upstream scales its rows,
        # so computing it now always saves the backward's recompute (unless an entropy gradient arrives).
        hidden_only = needs[0] and not (needs[1] or needs[2])
        speculate = any(needs) and (opts["uniform_grad"] or hidden_only)
        stats_fn = opts["stats_fn"]
        wanted = {name: name in opts["outputs"] for name in OPTIONAL_OUTPUTS}
        n_tokens, rows = hidden.shape[0], opts["chunk_rows"]
        parts: dict[str, list[torch.Tensor]] = {}
        grads = _grads_buffers(hidden, weight, bias, needs) if speculate else None
        scratch = Scratch()
        for start in range(0, n_tokens, rows):
            end = min(start + rows, n_tokens)
            h = hidden[start:end]
            out, grad_logits = stats_fn(
                chunk_logits(h, weight, bias, scratch),
                labels[start:end],
                opts["head"],
                compute_grad=speculate,
                scratch=scratch,
                **wanted,
            )
            for name, value in out.items():
                parts.setdefault(name, []).append(value)
            if grads is not None:
                _fold_grad(grads, grad_logits, weight, h, start, end)
        f32 = {"dtype": torch.float32, "device": hidden.device}
        empty = {"is_top1": torch.zeros(0, dtype=torch.bool, device=hidden.device)}
        result = {
            name: torch.cat(parts[name]) if name in parts else empty.get(name, torch.zeros(0, **f32))
            for name in ("log_probs", "log_z", *(n for n in OPTIONAL_OUTPUTS if wanted[n]))
        }
        entropy = result.get("entropy")
        ctx.save_for_backward(hidden, weight, bias, labels, result["log_z"], entropy)
        ctx.opts = opts
        ctx.needs = needs
        ctx.basis = grads  # gradients for an upstream of 1 on every scored token (uniform_grad)
        outputs = TokenStats(
            result["log_probs"],
            entropy,
            result.get("log_sum_sq_probs"),
            result.get("mean_logits"),
            result.get("is_top1"),
        )
        ctx.mark_non_differentiable(*(x for x in outputs[2:] if x is not None))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, *_):  # type: ignore[override]
        hidden, weight, bias, labels, log_z, entropy = ctx.saved_tensors
        no_grad = (None, None, None, None, None)
        if grad_log_probs is None and grad_entropy is None:
            return no_grad
        opts = ctx.opts
        basis, ctx.basis = ctx.basis, None  # used at most once: a second backward recomputes
        if basis is not None and grad_entropy is None:
            grad_hidden, grad_weight, grad_bias = basis
            if grad_weight is None and grad_bias is None:  # rows scale independently (ignored rows are 0)
                grad_hidden.mul_(grad_log_probs.unsqueeze(1))
                return (*_cast_grads(basis, hidden, weight, bias), None, None)
            scale = _uniform_value(grad_log_probs, labels != opts["head"].ignore_index)
            if scale is not None:
                for g in (grad_hidden, grad_weight, grad_bias):
                    if g is not None:
                        g.mul_(scale)
                return (*_cast_grads(basis, hidden, weight, bias), None, None)
        g_lp = None if grad_log_probs is None else grad_log_probs.float().contiguous()
        g_ent = None if grad_entropy is None else grad_entropy.float().contiguous()
        grads = _grads_buffers(hidden, weight, bias, ctx.needs)
        grad_fn, rows = opts["grad_fn"], opts["chunk_rows"]
        scratch = Scratch()
        for start in range(0, hidden.shape[0], rows):
            end = min(start + rows, hidden.shape[0])
            h = hidden[start:end]
            grad_logits = grad_fn(
                chunk_logits(h, weight, bias, scratch),
                labels[start:end],
                log_z[start:end],
                None if entropy is None else entropy[start:end],
                None if g_lp is None else g_lp[start:end],
                None if g_ent is None else g_ent[start:end],
                opts["head"],
                scratch,
            )
            _fold_grad(grads, grad_logits, weight, h, start, end)
        return (*_cast_grads(grads, hidden, weight, bias), None, None)


def _uniform_value(grad: torch.Tensor, valid: torch.Tensor) -> torch.Tensor | None:
    """The upstream gradient's value if it is the same on every scored token (0 when none is scored)."""
    scored = grad[valid] if not bool(valid.all()) else grad
    if scored.numel() == 0:
        return grad.new_zeros(())
    if bool(scored.amax() == scored.amin()):
        return scored[0].float()
    return None


def _validate(hidden, weight, bias, labels, temperature, softcap, outputs, backend) -> None:
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() != 2:
        raise TypeError(
            "hidden must be a 2-D [tokens, hidden] floating-point tensor, got "
            f"{getattr(hidden, 'dtype', type(hidden))} {tuple(getattr(hidden, 'shape', ()))}"
        )
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be [vocab, {hidden.shape[1]}] (hidden's last dimension), "
            f"got {tuple(getattr(weight, 'shape', ()))}"
        )
    _check_operand_dtypes(hidden, weight, bias, labels)
    if labels.shape != (hidden.shape[0],):
        raise ValueError(
            f"labels must have shape ({hidden.shape[0]},) (one per token), got {tuple(labels.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    unknown = set(outputs) - {"log_probs", *OPTIONAL_OUTPUTS}
    if unknown:
        raise ValueError(
            f"unknown outputs {sorted(unknown)}; known: log_probs, {', '.join(OPTIONAL_OUTPUTS)}"
        )
    check_backend(backend, "fused_token_log_probs")


@torch.compiler.disable  # a Python loop over chunks around a custom Function: run it eagerly under compile
def fused_token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    outputs: tuple[str, ...] = ("log_probs",),
    ignore_index: int = -100,
    uniform_grad: bool = False,
    backend: str = "auto",
    chunk_rows: int | None = None,
) -> TokenStats:
    """Per-token statistics of ``softmax(z)``, ``z = softcap * tanh(logit_scale * (hidden @ weight.T + bias) /
    softcap) / temperature`` (softcap optional), without the ``[tokens, vocab]`` logits.

    ``hidden``: ``[N, H]``; ``weight``: ``[V, H]``; ``labels``: ``[N]``, already aligned with ``hidden``.
    Returns ``TokenStats(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each ``[N]`` (fp32;
    ``is_top1`` bool) and ``None`` unless named in ``outputs`` (``log_probs`` always). Every field is 0 (False)
    where the label is ``ignore_index``. ``log_probs`` and ``entropy`` are differentiable; the rest are not.
    The same values as TRL's ``ChunkedLogProbFunction`` (``is_top1``: the label is the first argmax).
    ``uniform_grad``: see the module docstring. ``backend``/``chunk_rows``: as ``fused_linear_cross_entropy``.
    """
    _validate(hidden, weight, bias, labels, temperature, softcap, outputs, backend)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # the matmul in the autocast dtype, like nn.Linear
        cast = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(cast), weight.to(cast)
        bias = None if bias is None else bias.to(cast)
    labels = labels.to(device=hidden.device, dtype=torch.int64)
    _check_labels(labels, weight.shape[0], ignore_index)
    rows = chunk_rows or default_chunk_rows(hidden.shape[0], weight.shape[1], weight.shape[0])
    stats_fn, grad_fn = _chunk_fns(backend, hidden.device)
    opts = {
        "stats_fn": stats_fn,
        "grad_fn": grad_fn,
        "head": HeadTransform(temperature, logit_scale, softcap, ignore_index),
        "outputs": frozenset(outputs),
        "uniform_grad": bool(uniform_grad),
        "chunk_rows": max(1, rows),
    }
    with torch.autocast(device_type, enabled=False):
        result = _TokenLogProbs.apply(hidden.contiguous(), weight, bias, labels, opts)
    return TokenStats(*result)
