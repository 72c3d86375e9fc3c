"""A tied input embedding's gradient added into the output layer's, without a dense ``[vocab, hidden]`` copy.

When the output layer's weight is the input embedding's (Qwen3, Llama-3.2, Gemma: ``tie_word_embeddings``), the
weight's gradient is the sum of two parts: the head's, dense over the whole vocabulary, and the embedding's, which
is non-zero only in the rows of the batch's tokens (512 of 151,936 at 512 tokens). torch's embedding backward
nonetheless builds the second part as a zero-filled dense ``[V, H]`` tensor, and autograd then adds the two: at
the end of the backward the process holds two weight-sized gradients (0.78 GB each at a 4B model's bf16 head,
where a step inside backward has freed every other gradient). A sparse gradient would not help: autograd adds a
sparse part to a dense one out of place (a new ``[V, H]`` tensor).

With the fused loss on, the head reads the weight through ``_Expose``, an identity whose backward notes the head's
dense gradient (the tensor autograd is about to sum into the weight's gradient) on this forward's ``Link``; the
embedding's backward, which runs later in the same pass (it is the first layer), adds its rows into that tensor in
place and hands autograd no weight gradient of its own. The values are the reference's, bit for bit:

- the rows are computed by torch's own ``embedding_dense_backward`` on the batch's ids renumbered to their distinct
  values (``torch.unique``, order kept): each row sums its occurrences in the same order, at the same precision,
  with the same ``padding_idx`` and ``scale_grad_by_freq``, as over the whole vocabulary;
- the sum is the same one addition per element (``head + row``, distinct rows); the reference adds zero to every
  other row, which changes nothing but a head gradient of exactly ``-0.0`` (kept as ``-0.0`` here, ``+0.0`` there).

Under a step inside backward (``optim.in_backward``; armed for this backward) the head's gradient is deferred: the
fused head computes it at the embedding's backward instead of at its own (``chunked_head._defer``: the logits and
their gradient once more, by the same operations), and the embedding adds its rows and returns it as the weight's
gradient, which the step then consumes and frees. Every other gradient is freed as it is made there, so without
this the head's, made at the start of the backward and final only at its end, is the one weight-sized gradient held
through the whole backward. Where the head's gradient is one half-precision product (up to ``hidden_size`` tokens)
and the optimizer's step is staged (stochastic rounding, 8-bit or fp32 moments), it is not even made whole: each
block of vocabulary rows is made, gets its embedding rows, and is stepped and dropped
(``optim.in_backward.step_blocks_in_backward``). The values, and the norm the step logs, are the same bit for bit. If the embedding's
backward does not run (its output reached the loss through no gradient), the end of the backward adds the deferred
gradient and runs the weight's post-accumulate hooks (``Link.pending``).

A backward that does not run the head's (the model's own path, logits only, a loss on the embeddings) gets the
embedding's dense reference gradient. On CPU tensors only so far (the CUDA embedding backward's order is not yet
tested against this), and not for DTensor (FSDP2 shards) or DeepSpeed ZeRO-3 partitions, nor under
``torch.compile`` tracing: those take ``nn.Embedding``'s own forward. Under FSDP2 (a model wrapped by
``fully_shard``) the head reads the weight directly and the embedding's gradient stays dense. DDP and DeepSpeed
ZeRO-1/2 hold plain parameters: the path runs there, tested against the dense gradient under DDP
(``tests/test_distributed.py``) and against float64 under ZeRO-1/2 (``tests/test_deepspeed.py``).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .chunked_head import DEFER_ATTR

_LINK_ATTR = "_fasttrain_tied_link"  # the embedding's link of its latest forward
_INSTALLED_ATTR = "_fasttrain_tied_forward"  # set while our instance ``forward`` is installed


class Link:
    """One forward of the embedding: the head's dense weight gradient of the same pass, once its backward ran; or,
    when the head defers it (``deferred``), the function that computes it."""

    __slots__ = ("deferred", "deferred_rows", "head_grad", "weight")

    def __init__(self, weight: torch.Tensor) -> None:
        self.head_grad: torch.Tensor | None = None
        self.deferred: Callable[[], torch.Tensor] | None = None
        self.deferred_rows: Any = None  # chunked_head.RowBlocks: the same gradient, a block of rows at a time
        self.weight = weight  # the tied parameter

    def pending(self) -> None:
        """The head left its gradient in ``deferred`` (its backward ran): if the embedding's backward does not
        take it in this backward (the embedding's output reached the loss through no gradient: detached), the
        end of the backward adds it to the weight's gradient and runs the weight's post-accumulate hooks, as
        autograd would have: nothing lost."""
        torch.autograd.Variable._execution_engine.queue_callback(self._settle)

    def _settle(self) -> None:
        deferred, self.deferred, self.deferred_rows = self.deferred, None, None
        if deferred is None:
            return
        weight = self.weight
        with torch.no_grad():
            grad = deferred()
            weight.grad = grad if weight.grad is None else weight.grad + grad
        hooks = getattr(weight, "_post_accumulate_grad_hooks", None) or {}
        for hook in tuple(hooks.values()):
            hook(weight)


class _Expose(torch.autograd.Function):
    """The weight as the head reads it; backward: the head's gradient, noted on the link and passed on as is."""

    @staticmethod
    def forward(ctx, weight, link: Link):  # type: ignore[override]
        ctx.link = link
        ctx.set_materialize_grads(False)  # a head that defers its gradient hands none: no zero [V, H] made
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if grad is not None and grad.layout == torch.strided:
            ctx.link.head_grad = grad
        return grad, None


class _TiedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, link: Link, padding_idx: int, scale_grad_by_freq: bool):  # type: ignore[override]
        ctx.save_for_backward(ids)
        ctx.link, ctx.padding_idx, ctx.scale = link, padding_idx, scale_grad_by_freq
        ctx.vocab = weight.shape[0]
        return F.embedding(
            ids, weight, padding_idx if padding_idx >= 0 else None, None, 2.0, scale_grad_by_freq
        )

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        link = ctx.link
        head_grad, link.head_grad = link.head_grad, None  # autograd must hold the last reference
        deferred, blocks = link.deferred, link.deferred_rows
        link.deferred = link.deferred_rows = None
        if deferred is None and head_grad is None:  # no head gradient in this pass: the reference's, dense
            return None, _dense(grad, ids, ctx.vocab, ctx.padding_idx, ctx.scale), None, None, None
        rows, renumbered = torch.unique(ids, sorted=True, return_inverse=True)
        padding = -1
        if ctx.padding_idx >= 0:
            at = int(torch.searchsorted(rows, ctx.padding_idx))
            if at < rows.numel() and int(rows[at]) == ctx.padding_idx:
                padding = at
        dense_rows = _dense(grad, renumbered, rows.numel(), padding, ctx.scale)
        if deferred is None:  # the head's gradient came through _Expose, and goes on to the weight from there
            head_grad.index_add_(0, rows, dense_rows)
            return None, None, None, None, None
        if blocks is not None and _step_blocks(link.weight, blocks, rows, dense_rows):
            return None, None, None, None, None  # made, stepped and freed a block at a time
        head_grad = deferred()  # made now and returned: nothing else reaches the weight
        head_grad.index_add_(0, rows, dense_rows)
        return None, head_grad, None, None, None


def _dense(grad: torch.Tensor, ids: torch.Tensor, rows: int, padding_idx: int, scale: bool) -> torch.Tensor:
    # what autograd's embedding backward calls for a dense weight (aten::embedding_backward, sparse=False)
    return torch.ops.aten.embedding_dense_backward(grad, ids, rows, padding_idx, scale)


def _takes_rows_path(module: nn.Embedding, ids: torch.Tensor) -> bool:
    weight = module.weight
    return (
        torch.is_grad_enabled()
        and weight.requires_grad
        and weight.device.type == "cpu"
        and type(weight) in (torch.Tensor, nn.Parameter)  # not a DTensor shard or another subclass
        and not hasattr(weight, "ds_id")  # a DeepSpeed ZeRO-3 partition
        and module.max_norm is None  # max_norm renormalises rows in place inside the forward
        and not module.sparse
        and not torch.compiler.is_compiling()
        and ids.dtype in (torch.int32, torch.int64)
    )


def _forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    if not _takes_rows_path(self, ids):
        self.__dict__.pop(_LINK_ATTR, None)
        return nn.Embedding.forward(self, ids)
    link = self.__dict__[_LINK_ATTR] = Link(self.weight)
    padding = -1 if self.padding_idx is None else self.padding_idx  # nn.Embedding made it non-negative
    return _TiedEmbedding.apply(ids, self.weight, link, padding, self.scale_grad_by_freq)


def tied_embedding(model: nn.Module) -> nn.Embedding | None:
    """The model's input embedding when it is a plain ``nn.Embedding`` whose weight is the output layer's."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embedding) is not nn.Embedding or head is None:
        return None
    weights = (embedding._parameters.get("weight"), head._parameters.get("weight"))
    return embedding if weights[0] is not None and weights[0] is weights[1] else None


def install(model: nn.Module) -> bool:
    """Give a tied ``nn.Embedding`` of ``model`` this forward (the instance only). True when installed."""
    embedding = tied_embedding(model)
    if embedding is None:
        return False
    if _INSTALLED_ATTR in embedding.__dict__:
        return True
    if "forward" in embedding.__dict__:  # someone else's instance forward: theirs runs, untouched
        return False
    embedding.__dict__[_INSTALLED_ATTR] = True
    embedding.forward = types.MethodType(_forward, embedding)
    return True


def uninstall(model: nn.Module) -> None:
    embedding = model.get_input_embeddings()
    if not isinstance(embedding, nn.Module) or not embedding.__dict__.pop(_INSTALLED_ATTR, False):
        return
    del embedding.forward
    embedding.__dict__.pop(_LINK_ATTR, None)


def forget(model: nn.Module) -> None:
    """Before a forward: drop the link of an earlier one, so that ``expose`` finds only this forward's."""
    embedding = model.get_input_embeddings()
    if isinstance(embedding, nn.Module):
        embedding.__dict__.pop(_LINK_ATTR, None)


def expose(model: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The weight for the head of a fused forward: through ``_Expose`` when this forward's embedding (tied to it)
    took the rows path, so that its backward adds into the head's gradient; else ``weight`` itself."""
    embedding = tied_embedding(model)
    link: Any = None if embedding is None else embedding.__dict__.get(_LINK_ATTR)
    if link is None or embedding.weight is not weight or not torch.is_grad_enabled() or _fsdp2(model):
        return weight
    exposed = _Expose.apply(weight, link)
    if _steps_in_backward(weight):
        setattr(exposed, DEFER_ATTR, link)  # the fused head computes its gradient at the embedding's backward
    return exposed


def _step_blocks(weight: torch.Tensor, blocks: Any, rows: torch.Tensor, dense_rows: torch.Tensor) -> bool:
    """The deferred head gradient plus the embedding's rows, stepped a block of vocabulary rows at a time by the
    step inside backward (``optim.in_backward.step_blocks_in_backward``); False: not stepped, nothing consumed."""
    from ..optim.in_backward import step_blocks_in_backward

    hidden = blocks.shape[1]

    def with_rows():
        for a, z, block in blocks:
            inside = (rows >= a) & (rows < z)
            block.index_add_(0, rows[inside] - a, dense_rows[inside])  # what index_add_ adds to these rows
            yield a * hidden, z * hidden, block

    return step_blocks_in_backward(weight, blocks.rows * hidden, with_rows())


def _steps_in_backward(weight: torch.Tensor) -> bool:
    from ..optim.in_backward import frees_gradient_in_backward

    return frees_gradient_in_backward(weight)


def _fsdp2(model: nn.Module) -> bool:
    # FSDP2 swaps whole nn.Parameters in for its shards during the forward: a plain tensor then, but its
    # gradient is reduce-scattered by FSDP's own hooks, not tested with this path; its embedding stays dense
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in (model, model.get_input_embeddings()))
