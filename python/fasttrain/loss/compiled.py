"""The fused-linear cross-entropy inside a ``torch.compile`` graph: one opaque custom op, no graph break.

The eager head is a Python loop over chunks around a custom autograd Function, with data-dependent checks (label
range, the speculation's exactness): Dynamo cannot trace it. Under compilation, a scalar loss (``"mean"`` or
``"sum"``) goes through ``fasttrain::fused_linear_cross_entropy``, a ``torch.library`` custom op whose
implementation runs the eager head's passes without autograd (``chunked_head.head_with_grads``): it returns the loss
and the gradients of the inputs that need one, computed in the forward as the eager head's speculation does for a
scalar loss, so the values are the eager path's. Its backward scales
them by the upstream gradient, which is exact for a scalar loss. The graph holds the op as one node: AOTAutograd
saves its gradients for the backward (the memory the eager head holds between forward and backward too), and
Inductor compiles everything around it. ``"none"`` (a per-token upstream gradient) stays eager, behind a graph break.
"""

# No ``from __future__ import annotations``: ``torch.library.custom_op`` reads the schema from the annotations, and
# typing's Optional, List and Tuple are what every torch since 2.4 understands there (torch 2.6 rejects list[bool]).
from typing import List, Optional, Tuple  # noqa: UP035

import torch

_NAME = "fasttrain::fused_linear_cross_entropy"


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0)


@torch.library.custom_op(_NAME, mutates_args=())
def loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],  # noqa: UP045
    labels: torch.Tensor,
    num_items_in_batch: Optional[torch.Tensor],  # noqa: UP045
    needs: List[bool],  # noqa: UP006
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: Optional[float],  # noqa: UP045
    reduction: str,
    backend: str,
    chunk_rows: Optional[int],  # noqa: UP045
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: UP006
    """(loss, d loss / d hidden, d loss / d weight, d loss / d bias); a gradient not asked for (``needs``) is an
    empty tensor."""
    from .function import scalar_loss_and_grads

    loss, grads = scalar_loss_and_grads(
        hidden,
        weight,
        labels,
        bias,
        tuple(needs),
        num_items_in_batch=num_items_in_batch,
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        backend=backend,
        chunk_rows=chunk_rows,
    )
    out = [_empty(hidden) if g is None else g for g in grads]
    return loss, out[0], out[1], out[2]


@loss_and_grads.register_fake
def _(hidden, weight, bias, labels, num_items_in_batch, needs, *args):
    def like(t, need):
        return torch.empty_like(t) if t is not None and need else _empty(hidden)

    loss = hidden.new_empty((), dtype=torch.float32)
    return loss, like(hidden, needs[0]), like(weight, needs[1]), like(bias, needs[2])


def _setup_context(ctx, inputs, output) -> None:
    ctx.needs = inputs[5]
    ctx.save_for_backward(*output[1:])


def _backward(ctx, upstream, *_):
    grads = [g * upstream if need else None for g, need in zip(ctx.saved_tensors, ctx.needs, strict=True)]
    return (*grads, None, None, None, None, None, None, None, None, None, None)


loss_and_grads.register_autograd(_backward, setup_context=_setup_context)


def fused_in_graph(hidden, weight, labels, bias, *, num_items_in_batch, **options) -> torch.Tensor:
    """The loss, through the custom op (called while Dynamo traces)."""
    if num_items_in_batch is not None and not isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = torch.as_tensor(num_items_in_batch, device=hidden.device)
    needs = [hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad]
    loss, *_ = loss_and_grads(hidden, weight, bias, labels, num_items_in_batch, needs, **options)
    return loss
