"""One chunked LM head: per-token math on ``hidden @ weight.T (+ bias)`` without the ``[tokens, vocab]`` logits.

Both fused heads run here: the cross-entropy (``function.py``) and TRL's per-token statistics
(``token_logprobs.py``). Each brings a ``ChunkMath`` (the per-chunk math: its per-token outputs and the
gradient with respect to the chunk's logits, a Triton kernel on GPU or its torch twin); everything around it
is written once here:

- chunking (``default_chunk_rows``) and one logits buffer reused by every chunk (``Scratch``);
- precision, one contract for every entry: the operands are cast to the compute dtype (the autocast dtype,
  else the inputs') inside the autograd Function, the weight once per pass and the hidden states per chunk,
  so the gradients come back in the inputs' own dtypes, as from autocast ``nn.Linear``. The chunk math
  computes the logit gradient in fp32 with its upstream scale already applied and rounds it once to the
  compute dtype for the matmuls (as autocast ``nn.Linear`` + ``cross_entropy`` and TRL's head do: rounding
  first and scaling after biases the whole gradient at initialisation, where ``1 - p`` rounds to 1 on every
  token). The hidden, weight and bias gradients are accumulated in fp32 and cast to the inputs' dtypes last
  (on CPU each bf16/fp16 chunk's product is rounded once first: ``_Grads``);
- the speculation: when the caller knows which upstream gradient will come (the same value on every scored
  token: ``1/n`` for a mean, ``-1/n`` for SFT's ``nll``), the forward computes the gradients for it (3 matmuls
  in all instead of 4: the backward need not recompute the logits). The backward uses them only where that
  is exact: every scored upstream equal, and a power of two times the prediction (scaling by a power of two
  commutes with rounding). Else it recomputes. The check reads one value on the host (a sync on a GPU).
- the deferral: a weight tagged by ``tied_embedding`` (tied, stepped inside backward) gets no gradient from the
  head's backward; ``deferred()`` on its link computes it later by the same operations (``_defer``).

Memory: one ``[rows, vocab]`` logits buffer in the compute dtype (plus the chunk math's fp32 temporaries on
CPU), the fp32 gradient accumulators, and under autocast one copy of the weight in the compute dtype (as
autocast ``nn.Linear`` makes). On CPU, which has no half-precision matmul with an fp32 output, a bf16/fp16
chunk's gradient products are the half-precision GEMM's, rounded once each before the fp32 accumulation
(``_Grads``), through a weight-sized buffer in the compute dtype reused by every chunk and a small fp32 one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import torch

__all__ = [
    "MIN_CHUNK_ROWS", "ChunkMath", "check_labels", "check_operands", "default_chunk_rows", "run_head",
    "widens_weight_grad",
]  # fmt: skip

MIN_CHUNK_ROWS = 256
# CPU half-precision chunks run their per-row math this many rows at a time (_chunk_grad_in_blocks)
STAT_ROWS = 64
# CPU half-precision weight products are widened to fp32 this many elements at a time (_Grads._add_product)
_WIDEN_ELEMENTS = 1 << 22
# torch >= 2.8 has addmm with bf16/fp16 operands and an fp32 output on CUDA (not on CPU)
_CUDA_MIXED_ADDMM = torch.__version__ >= (2, 8)
# a weight tensor carrying this attribute asks for its gradient later (``_defer``; set by ``tied_embedding``)
DEFER_ATTR = "_fasttrain_defer_weight_grad"
# A one-chunk half-precision weight gradient is one product per block of this many elements' worth of vocabulary
# rows (rounded to whole rows: ``weight_block_rows``), whether it is made whole or block by block: the same values
# either way, so a step inside backward can make, step and free it a block at a time (``RowBlocks``). Equal to the
# optimizer's staged batch (``optim._torch_step.STAGE_ELEMENTS``: tests/test_tied_embedding.py checks), so that
# the blocks fall on the pieces the whole gradient's step and norm are cut into.
WEIGHT_BLOCK_ELEMENTS = 1 << 22


def weight_block_rows(hidden_size: int) -> int:
    """Rows of the weight gradient per block: the fewest whole rows whose elements are a multiple of
    ``WEIGHT_BLOCK_ELEMENTS``."""
    return max(1, WEIGHT_BLOCK_ELEMENTS // math.gcd(WEIGHT_BLOCK_ELEMENTS, max(1, hidden_size)))


def default_chunk_rows(
    n_tokens: int, hidden_size: int, vocab_size: int, *, widened_weight_grad: bool = False
) -> int:
    """Tokens per chunk: the chunk's logits hold about as many values as the hidden states
    (``tokens x hidden / vocab``), rounded up to a power of two, within [``MIN_CHUNK_ROWS``, tokens].

    ``widened_weight_grad`` (``widens_weight_grad``): over several chunks a half-precision head's weight gradient
    is summed in an fp32 ``[V, H]`` accumulator, twice the weight's bytes (1.6 GB at a 4B model's head). Up to
    ``hidden_size`` tokens one chunk's logits hold no more values than the weight, so all tokens go in one chunk
    and the weight gradient is one product in the weight's dtype, rounded once, as the reference's is.

    The floor matters: every chunk reads the weight twice and the weight-gradient accumulator once, so tiny
    chunks turn the matmuls memory-bound (measured on CPU at hidden 256-512, vocab 151,936: 32-row chunks
    ~1.7x slower than 512-row ones, 128-row ones ~1.2x slower than 256-row ones)."""
    if n_tokens <= 0:
        return 1
    if widened_weight_grad and n_tokens <= hidden_size:
        return n_tokens
    rows = 1 << max(0, math.ceil(n_tokens * hidden_size / max(vocab_size, 1)) - 1).bit_length()
    return max(1, min(n_tokens, max(MIN_CHUNK_ROWS, rows)))


def compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's where it is on (like ``nn.Linear``), else the input's."""
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype


def widens_weight_grad(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a multi-chunk pass would sum the weight's gradient in an fp32 accumulator beside half-precision
    products (``default_chunk_rows``'s ``widened_weight_grad``)."""
    trained = torch.is_grad_enabled() and weight.requires_grad
    return trained and compute_dtype(hidden) in (torch.bfloat16, torch.float16)


class ChunkMath(Protocol):
    """The per-chunk math a head plugs into ``run_head``. ``logits`` is a ``[rows, V]`` buffer in the compute
    dtype that the math may overwrite; a returned gradient is ``d/d logits`` in that dtype (often the buffer)."""

    valid: torch.Tensor  # [N] bool: the scored tokens (the rest get zero outputs and zero gradients)
    # the first outputs take upstream gradients; the others are marked non-differentiable
    n_differentiable: int

    def forward_chunk(
        self, logits, lo: int, hi: int, scale: torch.Tensor | None, scratch
    ) -> torch.Tensor | None:
        """Record rows lo:hi of the outputs; with ``scale``, return the gradient of ``sum(scale * first output)``."""

    def backward_chunk(self, logits, lo: int, hi: int, upstream: tuple, scratch) -> torch.Tensor:
        """The gradient for the per-token upstream gradients of the differentiable outputs (rows lo:hi)."""

    def take_outputs(self) -> tuple[torch.Tensor, ...]:
        """The per-token outputs, once (the math keeps no reference to them: no cycle through autograd)."""


class Scratch:
    """Chunk-sized buffers reused from one chunk to the next (one ``Scratch`` per pass).

    On CPU a fresh ``[rows, vocab]`` tensor per chunk costs its page faults every time (allocations that large
    are mapped from the OS and returned to it when freed): measured 0.06 s for an in-place ``exp`` over
    256 x 151,936 fp32 values against 0.20 s for one that allocates its output.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(
        self, name: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = shape[0] * shape[1]
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)


class _Grads:
    """fp32 accumulators of the hidden, weight and bias gradients over the chunks of one pass.

    Each chunk's products are fp32 where the device has a matmul with an fp32 output for these operands (fp32,
    or bf16/fp16 on CUDA). On CPU a bf16/fp16 chunk's product comes from the half-precision GEMM (fp32 inside,
    rounded once at its output), as autocast ``nn.Linear``'s backward computes it, and is added into the fp32
    accumulator: computing it in fp32 instead costs two fp32 copies of the chunk's gradient and fp32 GEMMs, about
    1.6x the whole head's time at 1,024 tokens x vocab 151,936 on a 2-core CPU with AVX512-BF16. The rounding is
    to nearest, so it adds no bias (tests/test_loss*.py compare the signed error against float64 with the
    reference's); the hidden gradient's reduction over the vocabulary is whole inside one chunk, so it is rounded
    once, as the reference's is.
    """

    def __init__(
        self, hidden: torch.Tensor, w: torch.Tensor, needs: tuple[bool, bool, bool], one_chunk: bool
    ) -> None:
        # Not zero-filled: every hidden row is written by its chunk, and the first chunk writes the weight and bias
        # accumulators (a zero fill of a [V, H] fp32 accumulator is a pass as long as the chunk's GEMM on CPU)
        f32 = {"dtype": torch.float32, "device": w.device}
        self.hidden = torch.empty(hidden.shape, **f32) if needs[0] else None
        # one chunk of half-precision products: the weight gradient is that one product, in its dtype (set by fold)
        self._weight_direct = needs[1] and one_chunk and w.dtype != torch.float32
        self._weight_spec = (w.shape, w.dtype, w.device)  # not w itself: the basis lives until the backward
        self.weight = torch.empty(w.shape, **f32) if needs[1] and not self._weight_direct else None
        self.bias = torch.empty(w.shape[0], **f32) if needs[2] else None
        self._started = False  # the weight and bias accumulators hold a first chunk's products
        self._product = self._product32 = None  # CPU half-precision weight products (fold)

    def fold(self, grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, lo: int, hi: int) -> None:
        # bf16/fp16 operands with an fp32 output: CUDA only (torch >= 2.8's out_dtype); CPU has no such matmul
        mixed = _CUDA_MIXED_ADDMM and grad.is_cuda
        if self.hidden is not None:
            if grad.dtype == torch.float32:
                torch.mm(grad, w, out=self.hidden[lo:hi])
            elif mixed:
                torch.mm(grad, w, out_dtype=torch.float32, out=self.hidden[lo:hi])
            else:
                self.hidden[lo:hi] = torch.mm(grad, w)
        first, self._started = not self._started, True
        if self._weight_direct and grad.device.type != "cpu":
            self.weight = torch.mm(grad.t(), h)
        elif self._weight_direct:  # in row blocks on CPU, as RowBlocks makes it (the tied rows path is CPU's)
            self.weight = torch.empty(w.shape, dtype=grad.dtype, device=grad.device)
            for a, b in _row_blocks(w.shape[0], weight_block_rows(w.shape[1])):
                torch.mm(grad[:, a:b].t(), h, out=self.weight[a:b])
        elif self.weight is not None:
            if grad.dtype == torch.float32:
                if first:
                    torch.mm(grad.t(), h, out=self.weight)
                else:
                    self.weight.addmm_(grad.t(), h)
            elif mixed:
                if first:
                    torch.mm(grad.t(), h, out_dtype=torch.float32, out=self.weight)
                else:
                    torch.addmm(self.weight, grad.t(), h, out_dtype=torch.float32, out=self.weight)
            else:  # into a chunk-reused product buffer: a fresh [V, H] product per chunk, and torch's mixed-dtype
                # add_ (6x slower on CPU than a copy and an fp32 add), would cost more than the GEMM. The product
                # is widened and added a slice of rows at a time through one small fp32 buffer: a weight-sized
                # fp32 copy would cost 1.6 GB more at a 4B model's 151,936 x 2,560 head, for the same sums
                if self._product is None:
                    self._product = torch.empty(self.weight.shape, dtype=grad.dtype, device=grad.device)
                torch.mm(grad.t(), h, out=self._product)
                if first:
                    self.weight.copy_(self._product)
                else:
                    self._add_product()
        if self.bias is not None:
            if first:
                torch.sum(grad, dim=0, dtype=torch.float32, out=self.bias)
            else:
                self.bias += grad.sum(dim=0, dtype=torch.float32)

    def _add_product(self) -> None:
        """``weight += product``, widened to fp32 ``_WIDEN_ELEMENTS`` elements at a time through one reused buffer."""
        rows = max(1, _WIDEN_ELEMENTS // max(1, self.weight.shape[1]))
        if self._product32 is None:
            self._product32 = torch.empty((min(rows, self.weight.shape[0]), *self.weight.shape[1:]),
                                          dtype=torch.float32, device=self.weight.device)  # fmt: skip
        for lo in range(0, self.weight.shape[0], rows):
            part = self._product[lo : lo + rows]
            self.weight[lo : lo + rows] += self._product32[: part.shape[0]].copy_(part)

    def finish(self, ratio: torch.Tensor | None, like: tuple) -> tuple:
        """Scaled by ``ratio`` (a power of two: exact), cast to the dtypes of ``like`` (hidden, weight, bias)."""
        if not self._started:  # no chunk at all (no token): zero gradients, as the reference gives
            if self._weight_direct:
                shape, dtype, device = self._weight_spec
                self.weight = torch.empty(shape, dtype=dtype, device=device)
            for grad in (self.weight, self.bias):
                if grad is not None:
                    grad.zero_()
        out = []
        for grad, ref in zip((self.hidden, self.weight, self.bias), like, strict=True):
            if grad is not None and ratio is not None:
                grad.mul_(ratio)
            out.append(None if grad is None else grad.to(ref.dtype))
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class _Plan:
    compute_dtype: torch.dtype
    chunk_rows: int
    predicted: torch.Tensor | None  # fp32 scalar: the upstream expected on every scored token of output 0
    # where the weight's gradient goes when it is computed later, at a tied embedding's backward (``_defer``)
    defer: Any = None


def _row_blocks(rows: int, per_block: int) -> list[tuple[int, int]]:
    return [(a, min(a + per_block, rows)) for a in range(0, rows, per_block)]


def _sweep(hidden, w, b, plan: _Plan, chunk_grad):
    """The chunks in order: (lo, hi, the chunk's hidden states and logits' gradient in the compute dtype)."""
    scratch = Scratch()
    for lo in range(0, hidden.shape[0], plan.chunk_rows):
        hi = min(lo + plan.chunk_rows, hidden.shape[0])
        h = hidden[lo:hi].to(plan.compute_dtype)
        logits = scratch.take("logits", (hi - lo, w.shape[0]), plan.compute_dtype, hidden.device)
        if b is None:
            torch.mm(h, w.t(), out=logits)
        else:
            torch.addmm(b, h, w.t(), out=logits)
        yield lo, hi, h, _chunk_grad_in_blocks(chunk_grad, logits, lo, hi, scratch, plan.compute_dtype)


def _pass(hidden, weight, bias, plan: _Plan, needs, chunk_grad) -> _Grads | None:
    """One sweep over the chunks: logits in the compute dtype, ``chunk_grad`` on them, gradients folded in."""
    w = weight.to(plan.compute_dtype)
    b = None if bias is None else bias.to(plan.compute_dtype)
    one_chunk = hidden.shape[0] <= plan.chunk_rows
    grads = _Grads(hidden, w, needs, one_chunk) if needs is not None and any(needs) else None
    for lo, hi, h, grad in _sweep(hidden, w, b, plan, chunk_grad):
        if grads is not None and grad is not None:
            grads.fold(grad, h, w, lo, hi)
    return grads


class RowBlocks:
    """A deferred one-chunk half-precision weight gradient, made a block of ``rows`` rows at a time: iterating
    yields ``(first row, end row, the block in the weight's dtype)``, each the rows ``_Grads`` makes for the whole
    gradient (the same products, scaling and cast). Only the chunk's logits gradient and one block exist at once."""

    def __init__(self, hidden, weight, bias, plan: _Plan, ratio, chunk_grad) -> None:
        self._args = (hidden, weight, bias, plan, ratio, chunk_grad)
        self.rows = weight_block_rows(weight.shape[1])
        self.shape = tuple(weight.shape)

    def __iter__(self):
        hidden, weight, bias, plan, ratio, chunk_grad = self._args
        w = weight.to(plan.compute_dtype)
        b = None if bias is None else bias.to(plan.compute_dtype)
        ((_, _, h, grad),) = list(_sweep(hidden, w, b, plan, chunk_grad))  # one chunk
        for a, z in _row_blocks(w.shape[0], self.rows):
            if grad is None:  # nothing scored in the chunk (no token): zeros, as _Grads.finish gives
                block = torch.zeros((z - a, w.shape[1]), dtype=weight.dtype, device=w.device)
            else:
                block = torch.empty((z - a, w.shape[1]), dtype=grad.dtype, device=grad.device)
                torch.mm(grad[:, a:z].t(), h, out=block)
                if ratio is not None:
                    block.mul_(ratio)
                block = block.to(weight.dtype)
            yield a, z, block


def _chunk_grad_in_blocks(chunk_grad, logits, lo, hi, scratch, dtype) -> torch.Tensor | None:
    """``chunk_grad`` on the chunk's logits; for CPU half-precision logits, ``STAT_ROWS`` rows at a time.

    The torch chunk math works on fp32 copies of the rows it is given (``lm_head_torch``: ``[rows, V]`` each,
    twice the bf16 logits' bytes), and writes the gradient back into the logits. A one-chunk half-precision head
    (``default_chunk_rows``) has up to ``hidden_size`` rows: 512 rows of a 151,936 vocabulary are 311 MB per fp32
    temporary, beside the 0.78 GB weight gradient of a 4B model. Every statistic and gradient is per row, so the
    blocks give the same values; the matmuls keep the whole chunk."""
    if logits.device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16) or hi - lo <= STAT_ROWS:
        return chunk_grad(logits, lo, hi, scratch)
    written = False
    for a in range(lo, hi, STAT_ROWS):
        b = min(a + STAT_ROWS, hi)
        rows = logits[a - lo : b - lo]
        grad = chunk_grad(rows, a, b, scratch)
        if grad is not None:
            if grad.data_ptr() != rows.data_ptr():
                rows.copy_(grad)
            written = True
    return logits if written else None


def _exact_ratio(
    upstream: torch.Tensor, valid: torch.Tensor, predicted: torch.Tensor
) -> tuple[torch.Tensor, float] | None:
    """``upstream / predicted`` (as a tensor and as a number) if every scored upstream is the same (+-) power of
    two times the prediction, else None. Equal mantissas (``frexp``) mean an exact ratio +-2^k; scaling by it
    commutes with every rounding of the gradient, so the forward's gradients scaled by it are those for the actual
    upstream with its scale applied before any rounding (up to fp32 rounding, the same formula as a recompute's).
    One host read for both answers: on a GPU each read drains the queue the backward has launched so far."""
    u = upstream.float()
    if u.numel() == 0:
        return None  # no chunk to recompute
    top = torch.where(valid, u, -math.inf).amax()
    bottom = torch.where(valid, u, math.inf).amin()
    predicted = predicted.to(u.device, torch.float32)
    same_mantissa = torch.frexp(top).mantissa.abs() == torch.frexp(predicted).mantissa.abs()
    ratio = top / predicted  # +-2^k exactly where the mantissas agree; NaN for inf / inf (recompute)
    exact = (top == bottom) & same_mantissa & torch.isfinite(ratio)
    is_exact, value = torch.stack([exact.float(), ratio]).tolist()  # the host read (sync)
    return (ratio, value) if is_exact else None


def _make_plan(hidden: torch.Tensor, chunk_rows: int, predicted: Any, defer: Any = None) -> _Plan:
    """Under autocast the matmuls run in the autocast dtype, like ``nn.Linear`` (read before autocast is turned
    off around the passes)."""
    if predicted is not None:
        predicted = torch.as_tensor(predicted, dtype=torch.float32, device=hidden.device)
    return _Plan(compute_dtype(hidden), max(1, chunk_rows), predicted, defer)


def _forward(hidden, weight, bias, chunk_math: ChunkMath, plan: _Plan, needs) -> tuple[_Grads | None, tuple]:
    """The forward sweep: the chunk math's outputs and, where ``needs`` asks and an upstream is predicted, the
    gradients for that upstream folded in on the way (the basis a backward scales instead of recomputing)."""
    scale = plan.predicted if any(needs) else None
    basis = _pass(
        hidden, weight, bias, plan, needs if scale is not None else None,
        lambda logits, lo, hi, scratch: chunk_math.forward_chunk(logits, lo, hi, scale, scratch),
    )  # fmt: skip
    return basis, chunk_math.take_outputs()


def _gradients(
    hidden,
    weight,
    bias,
    chunk_math: ChunkMath,
    plan: _Plan,
    needs,
    basis,
    upstream: tuple,
    defer=None,
    first=True,
) -> tuple:
    """The inputs' gradients for ``upstream`` (one per differentiable output, None where there is none): the
    forward's basis, scaled, when only output 0 has an upstream and it is the predicted one times +-2^k; else a
    second sweep that recomputes the logits. With ``defer`` (``_defer``) the weight's is not computed here (None):
    a function that computes it, by the same operations as this path, is left on ``defer.deferred``. ``first``:
    the node's first backward (a later one recomputes: its basis is spent)."""
    like = (hidden, weight, bias)
    if defer is not None:
        needs = (needs[0], False, needs[2])
    # Without the deferral this backward would scale a basis wherever an upstream is predicted, the weight's
    # included: with it, the forward may have had nothing else to fold (the hidden states need no gradient), and
    # the weight's gradient must still be the basis' formula (replayed), not the recompute's, to be the same bits.
    basis_path = basis is not None or (defer is not None and first and plan.predicted is not None)
    if basis_path and upstream[0] is not None and all(g is None for g in upstream[1:]):
        exact = _exact_ratio(upstream[0], chunk_math.valid, plan.predicted)
        if exact is not None:
            ratio, value = exact
            # a ratio of 1 (the usual case): no pass over the gradients
            ratio = None if value == 1.0 else ratio
            if defer is not None:
                replay = chunk_math.replay_chunk  # type: ignore[attr-defined]  # _defer checked it
                _leave(defer, hidden, weight, bias, plan, ratio,
                       lambda logits, lo, hi, scratch: replay(logits, lo, hi, plan.predicted, scratch))  # fmt: skip
            # no basis: the forward folded nothing (every other input needs no gradient)
            return basis.finish(ratio, like) if basis is not None else (None, None, None)

    def recompute(logits, lo, hi, scratch):
        return chunk_math.backward_chunk(logits, lo, hi, upstream, scratch)

    if defer is not None:
        _leave(defer, hidden, weight, bias, plan, None, recompute)
        if not any(needs):
            return None, None, None
    grads = _pass(hidden, weight, bias, plan, needs, recompute)
    assert grads is not None
    return grads.finish(None, like)


def _leave(defer, hidden, weight, bias, plan: _Plan, ratio, chunk_grad) -> None:
    """The deferred weight gradient on its target: ``deferred()`` makes it whole; ``deferred_rows``, where it is
    one chunk's half-precision product (``_Grads``' direct case), makes it a block of rows at a time."""
    defer.deferred = lambda: _weight_grad(hidden, weight, bias, plan, ratio, chunk_grad)
    direct = (
        0 < hidden.shape[0] <= plan.chunk_rows
        and plan.compute_dtype != torch.float32
        and hidden.device.type == "cpu"
    )
    defer.deferred_rows = RowBlocks(hidden, weight, bias, plan, ratio, chunk_grad) if direct else None


def _weight_grad(hidden, weight, bias, plan: _Plan, ratio, chunk_grad) -> torch.Tensor:
    """The weight's gradient alone: a sweep as ``_gradients``' (the same chunks, chunk math and folds), then the
    same scaling and cast."""
    grads = _pass(hidden, weight, bias, plan, (False, True, False), chunk_grad)
    assert grads is not None
    return grads.finish(ratio, (hidden, weight, bias))[1]


def _defer(plan: _Plan, chunk_math: ChunkMath, needs) -> Any:
    """The target of a deferred weight gradient, or None: only a chunk math that can replay its forward's
    gradient (``replay_chunk``), and only when the weight's gradient is asked for.

    The target (``tied_embedding.Link``) is the weight's tied input embedding of this forward, whose backward runs
    last and adds its rows into the gradient ``deferred()`` returns. Until then no ``[V, H]`` gradient exists:
    under a step inside backward every other gradient is stepped and freed as it is made, so the head's, made at
    the start of the backward and final only at its end, would otherwise be the one weight-sized gradient held
    through it (0.78 GB at a 4B model's bf16 head). The price: the logits and their gradient once more."""
    if plan.defer is None or not needs[1] or not hasattr(chunk_math, "replay_chunk"):
        return None
    return plan.defer


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, chunk_math: ChunkMath, plan: _Plan):  # type: ignore[override]
        ctx.set_materialize_grads(False)  # e.g. the entropy is usually logged, not trained on
        needs = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        defer = _defer(plan, chunk_math, needs)
        basis_needs = needs if defer is None else (needs[0], False, needs[2])
        ctx.basis, outputs = _forward(hidden, weight, bias, chunk_math, plan, basis_needs)
        ctx.save_for_backward(hidden, weight, bias)
        ctx.chunk_math, ctx.plan, ctx.needs, ctx.defer = chunk_math, plan, needs, defer
        ctx.first = True
        ctx.mark_non_differentiable(*outputs[chunk_math.n_differentiable :])
        return outputs

    @staticmethod
    def backward(ctx, *upstream):  # type: ignore[override]
        hidden, weight, bias = ctx.saved_tensors
        basis, ctx.basis = ctx.basis, None  # used at most once: a second backward recomputes
        first, ctx.first = ctx.first, False
        upstream = upstream[: ctx.chunk_math.n_differentiable]
        if all(g is None for g in upstream):
            return None, None, None, None, None
        grads = _gradients(
            hidden, weight, bias, ctx.chunk_math, ctx.plan, ctx.needs, basis, upstream, ctx.defer, first
        )
        if ctx.defer is not None:
            ctx.defer.pending()
        return *grads, None, None


def run_head(
    hidden: torch.Tensor,  # [N, H], contiguous
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    chunk_math: ChunkMath,
    chunk_rows: int,
    predicted: Any = None,  # the upstream gradient expected on each scored token of output 0, or None
) -> tuple[torch.Tensor, ...]:
    """The chunk math's per-token outputs, differentiable through ``hidden``, ``weight`` and ``bias``. Under
    autocast the matmuls run in the autocast dtype, like ``nn.Linear``; the gradients keep the inputs' dtypes."""
    plan = _make_plan(hidden, chunk_rows, predicted, getattr(weight, DEFER_ATTR, None))
    with torch.autocast(hidden.device.type, enabled=False):
        return _ChunkedHead.apply(hidden, weight, bias, chunk_math, plan)


def head_with_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_math: ChunkMath,
    chunk_rows: int,
    predicted: Any,
    needs: tuple[bool, bool, bool],
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]:
    """``run_head``'s outputs and, without autograd, the gradients of the inputs in ``needs`` for an upstream of
    ``predicted`` on every token of output 0: what ``run_head``'s forward and backward give for a loss whose
    upstream is that (a ``"mean"`` or ``"sum"`` reduction), the same passes, the same roundings."""
    plan = _make_plan(hidden, chunk_rows, predicted)
    needs = (needs[0], needs[1], bias is not None and needs[2])
    with torch.autocast(hidden.device.type, enabled=False):
        basis, outputs = _forward(hidden, weight, bias, chunk_math, plan, needs)
        if basis is None:  # no gradient asked for
            return outputs, (None, None, None)
        upstream = (plan.predicted.expand(hidden.shape[0]),)
        return outputs, _gradients(hidden, weight, bias, chunk_math, plan, needs, basis, upstream)


def check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every label in ``[0, vocab)`` or ``ignore_index``: an exception on CPU, a device-side assert elsewhere."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if labels.device.type == "cpu":
        if bool(bad.any()):
            pos = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"labels[{pos}] = {int(labels[pos])} is outside the vocabulary [0, {vocab}) "
                f"and is not ignore_index ({ignore_index})"
            )
    else:  # no host sync on the accelerator
        torch._assert_async(~bad.any(), f"a label is outside [0, {vocab}) and is not ignore_index")


_AUTOCAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what autocast casts to its dtype


def check_operands(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Any, labels: Any, *, cast_head: bool = False
) -> None:
    """Checks shared by both heads (the shapes of hidden and weight are checked by each entry).

    The operands' dtypes follow the op each head replaces. Under autocast, hidden, weight and bias may be any of
    fp32, bf16 and fp16, mixed (fp16 weights under bf16 autocast, fp32 master weights, a frozen head in another
    dtype): autocast ``nn.Linear`` casts them all to its dtype, and ``run_head`` does the same. Without autocast
    they must agree, as ``F.linear`` requires, unless ``cast_head``: TRL's fused head casts the head to the
    hidden states' dtype (``cast_lm_head_to_fp32`` runs it in fp32 outside autocast), and so does ``run_head``."""
    floating = weight.is_floating_point() and (bias is None or bias.is_floating_point())
    autocast = torch.is_autocast_enabled(hidden.device.type) and all(
        t.dtype in _AUTOCAST_DTYPES for t in (hidden, weight, *(() if bias is None else (bias,)))
    )
    mixed_ok = floating and (autocast or cast_head)
    if weight.dtype != hidden.dtype and not mixed_ok:
        raise TypeError(
            f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype} (outside autocast they must "
            "agree, as for F.linear; under autocast fp32, bf16 and fp16 may be mixed)"
        )
    if bias is not None and (
        bias.shape != (weight.shape[0],) or (bias.dtype != weight.dtype and not mixed_ok)
    ):
        raise ValueError(
            f"bias must have shape ({weight.shape[0]},) and dtype {weight.dtype}, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {getattr(labels, 'dtype', type(labels))}")
