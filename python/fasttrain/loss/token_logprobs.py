"""``fused_token_log_probs``: per-token log-probs (and entropy, top-1 hits, ...) of ``hidden @ weight.T``
without the full logits — TRL's fused LM-head contract (``trl.kernels.ChunkedLogProbFunction``) served by
fasttrain's chunked head.

The chunking, matmuls, precision and speculation are ``chunked_head``'s; this module plugs the per-chunk
statistics into it: the Triton kernels of ``fasttrain.kernels.lm_head`` or their torch twins
(``lm_head_torch``). One pass over each chunk's logits computes every requested per-token output.

Gradients. The log-probs (and the entropy) get per-token upstream gradients, known only in backward, so the
backward recomputes each chunk's logits (4 matmuls in all, like TRL) unless the caller says which upstream
will come: ``uniform_grad`` (``True`` for a loss ``-sum(log_probs) / n_scored``, TRL's SFT ``nll``; or the
value itself) lets the forward compute the gradients for it (3 matmuls), used only where exact (see
``chunked_head``); an entropy gradient, or another upstream, recomputes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._backend import check_backend
from .chunked_head import check_labels, check_operands, default_chunk_rows, run_head, widens_weight_grad
from .lm_head_torch import HeadTransform, chunk_fns

__all__ = ["OPTIONAL_OUTPUTS", "TokenStats", "fused_token_log_probs"]

OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class TokenStats(NamedTuple):
    """Per-token outputs, in TRL's order; ``None`` where not requested. fp32 except ``is_top1`` (bool)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    log_sum_sq_probs: torch.Tensor | None
    mean_logits: torch.Tensor | None
    is_top1: torch.Tensor | None


class _TokenStatsMath:
    """The per-chunk statistics for ``chunked_head``: outputs log_probs, entropy (both differentiable), then the
    requested non-differentiable ones. The gradient for upstreams ``g_lp``, ``g_ent``:
    ``d/dz_j = g_lp ([j == y] - p_j) - g_ent p_j (log p_j + H)``."""

    n_differentiable = 2

    def __init__(self, labels: torch.Tensor, head: HeadTransform, outputs: frozenset, backend: str) -> None:
        self.stats_fn, self.grad_fn = chunk_fns(backend, labels.device, "fused_token_log_probs")
        self.labels, self.head, self.outputs = labels, head, outputs
        self.valid = labels != head.ignore_index
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.log_z = self.entropy = None  # for the backward

    def forward_chunk(self, logits, lo, hi, scale, scratch):
        wanted = {"entropy", "log_sum_sq_probs", "mean_logits", "is_top1"} & self.outputs
        stats = self.stats_fn(
            logits, self.labels[lo:hi], self.head, sum_z="mean_logits" in wanted, entropy="entropy" in wanted,
            log_sum_sq="log_sum_sq_probs" in wanted, top1="is_top1" in wanted, scratch=scratch,
            reuse=scale is not None,
        )  # fmt: skip
        stats["log_probs"] = stats["target"] - stats["log_z"]
        if "mean_logits" in wanted:
            stats["mean_logits"] = stats["sum_z"] / logits.shape[1]
        for name in ("log_probs", "log_z", *wanted):
            self.parts.setdefault(name, []).append(stats[name])
        if scale is None:
            return None
        s = scale.float().expand(hi - lo)
        args = (self.head, stats["log_z"], -s, s)
        return self.grad_fn(logits, self.labels[lo:hi], *args, scratch=scratch, exp=stats.get("_exp"))

    def backward_chunk(self, logits, lo, hi, upstream, scratch):
        g_lp, g_ent = (None if g is None else g[lo:hi].float() for g in upstream)
        g_lp = torch.zeros(hi - lo, device=logits.device) if g_lp is None else g_lp
        entropy = None if g_ent is None else self.entropy[lo:hi]
        args = (self.head, self.log_z[lo:hi], -g_lp, g_lp, None, g_ent, entropy, scratch)
        return self.grad_fn(logits, self.labels[lo:hi], *args)

    def take_outputs(self):
        def cat(name, dtype=torch.float32):
            parts = self.parts.get(name)
            return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=self.labels.device)

        self.log_z = cat("log_z")
        outputs = tuple(
            cat(n, torch.bool if n == "is_top1" else torch.float32) for n in ("log_probs", *OPTIONAL_OUTPUTS)
        )
        self.parts = {}
        if "entropy" in self.outputs:  # a copy: holding the output itself would tie it to autograd in a cycle
            self.entropy = outputs[1].clone()
        return outputs


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
    check_operands(
        hidden, weight, bias, labels, cast_head=True
    )  # TRL's head casts the head to the compute dtype
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
    uniform_grad: bool | float | torch.Tensor = False,
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
    labels = labels.to(device=hidden.device, dtype=torch.int64)
    check_labels(labels, weight.shape[0], ignore_index)
    widened = widens_weight_grad(hidden, weight)
    rows = chunk_rows or default_chunk_rows(*hidden.shape, weight.shape[0], widened_weight_grad=widened)
    head = HeadTransform(temperature, logit_scale, softcap, ignore_index)
    math = _TokenStatsMath(labels, head, frozenset(outputs), backend)
    predicted = uniform_grad
    if uniform_grad is True:  # -sum(log_probs) / n_scored: -1 / n on each scored log-prob
        predicted = -1.0 / math.valid.sum().clamp(min=1).float()
    elif uniform_grad is False:
        predicted = None
    log_probs, *rest = run_head(hidden.contiguous(), weight, bias, math, rows, predicted)
    wanted = ("entropy" in outputs, *(name in outputs for name in OPTIONAL_OUTPUTS[1:]))
    return TokenStats(log_probs, *(x if on else None for x, on in zip(rest, wanted, strict=True)))
