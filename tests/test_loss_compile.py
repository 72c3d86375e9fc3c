"""``torch.compile`` with fasttrain's head: one custom op in the graph (no graph break), the eager path's values."""

from __future__ import annotations

import pytest
import torch

import _tiny
from fasttrain import fused_linear_cross_entropy
from fasttrain.loss.compiled import loss_and_grads
from fasttrain.loss.model_patch import enable_fused_loss

pytestmark = pytest.mark.gpu_versions
# The op's own checks and values also run at the dependency floors (torch 2.6 read the op's annotations more
# narrowly: `list[bool]` failed there at import). The whole-model graph test stays at the GPU's versions: at torch
# 2.6 the patched forward traces in three graphs, not one (docs/support.md).
AT_THE_FLOORS = pytest.mark.dropin

OPTIONS = dict(
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    reduction="mean",
    backend="torch",
    chunk_rows=3,
)


def _operands(bias: bool, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, 8, generator=g, dtype=dtype)
    weight = torch.randn(11, 8, generator=g, dtype=dtype)
    b = torch.randn(11, generator=g, dtype=dtype) if bias else None
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, :2] = -100
    return hidden, weight, b, labels


@AT_THE_FLOORS
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_custom_op_passes_torch_s_operator_checks(reduction, bias):
    # schema, fake tensor, autograd registration and AOT dispatch, as torch.library.opcheck defines them
    hidden, weight, b, labels = _operands(bias)
    needs = [True, True, bias]
    args = (hidden.requires_grad_(), weight.requires_grad_(), b, labels, None, needs)
    kwargs = {**OPTIONS, "reduction": reduction}
    torch.library.opcheck(loss_and_grads, (*args, *kwargs.values()))


@AT_THE_FLOORS
@pytest.mark.parametrize(
    "case", ["mean", "sum", "num_items", "softcap+smoothing+z_loss", "every label ignored"]
)
def test_compiled_loss_and_gradients_are_the_eager_path_s(case):
    hidden, weight, bias, labels = _operands(bias=True, seed=1)
    kwargs = dict(reduction="sum" if case == "sum" else "mean", chunk_rows=3)
    if case == "num_items":
        kwargs["num_items_in_batch"] = torch.tensor(13)
    if case == "softcap+smoothing+z_loss":
        kwargs.update(softcap=3.0, label_smoothing=0.1, z_loss=1e-3)
    if case == "every label ignored":
        labels[:] = -100

    def loss_and_grads_of(fn):
        inputs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss = fn(inputs[0], inputs[1], labels, inputs[2])
        loss.backward()
        return loss.detach(), [t.grad for t in inputs]

    def eager(h, w, y, b):
        return fused_linear_cross_entropy(h, w, y, b, **kwargs)

    compiled = torch.compile(eager, backend="aot_eager", fullgraph=True)  # fullgraph: a break is an error
    (eager_loss, eager_grads), (loss, grads) = loss_and_grads_of(eager), loss_and_grads_of(compiled)
    # the same passes over the same chunks, the same roundings: equal, NaN where the eager loss is NaN
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0, equal_nan=True)
    for ours, theirs in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


def test_a_per_token_loss_stays_eager_under_compile():
    hidden, weight, _, labels = _operands(bias=False)

    def fn(h):
        return fused_linear_cross_entropy(h * 2.0, weight, labels, reduction="none") * 3.0

    explanation = torch._dynamo.explain(fn)(hidden)
    # "none" runs outside the graph, where its upstream is per token: the work before and after it are two graphs
    assert explanation.graph_break_count == 1 and explanation.graph_count == 2
    compiled = torch.compile(fn, backend="aot_eager")
    torch.testing.assert_close(compiled(hidden), fn(hidden), rtol=0, atol=0)


def test_a_patched_causal_lm_compiles_into_one_graph_with_the_head_inside():
    model = _tiny.model("qwen3")
    model.train()
    assert enable_fused_loss(model) is None
    ids = torch.randint(3, _tiny.VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    explanation = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation.break_reasons
    assert not explanation.break_reasons, explanation.break_reasons
    ops = {str(node.target) for graph in explanation.graphs for node in graph.graph.nodes}
    assert any("fasttrain.fused_linear_cross_entropy" in op for op in ops), sorted(ops)
