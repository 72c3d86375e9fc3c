"""On CPU a bf16/fp16 head adds each chunk's half-precision weight product into its fp32 accumulator through a
small fp32 buffer, a slice of rows at a time (``chunked_head._Grads._add_product``), not a weight-sized fp32 copy
(1.6 GB at a 4B model's head): the gradients must be those of the whole-weight widening, bit for bit, and the
buffer no larger than its slice."""

from __future__ import annotations

import pytest
import torch

from fasttrain.loss import chunked_head
from fasttrain.loss.function import fused_linear_cross_entropy

pytestmark = pytest.mark.numeric  # half-precision GEMMs on CPU: another instruction set rounds its own way


def _grads(monkeypatch, widen: int, dtype):
    monkeypatch.setattr(chunked_head, "_WIDEN_ELEMENTS", widen)
    seen = []
    add = chunked_head._Grads._add_product

    def spy(self):
        add(self)
        seen.append(self._product32.numel())

    monkeypatch.setattr(chunked_head._Grads, "_add_product", spy)
    torch.manual_seed(0)
    hidden = torch.randn(300, 48, dtype=dtype, requires_grad=True)
    weight = (torch.randn(1001, 48) * 0.1).to(dtype).requires_grad_()
    labels = torch.randint(0, 1001, (300,))
    labels[::7] = -100
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_rows=64, backend="torch")
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad, seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sliced_widening_equals_the_whole_weight_widening(monkeypatch, dtype):
    whole = _grads(monkeypatch, 1 << 30, dtype)
    sliced = _grads(
        monkeypatch, 48 * 100 + 5, dtype
    )  # 100 rows a slice: the last slice is short (1,001 rows)
    for a, b in zip(whole[:3], sliced[:3], strict=True):
        assert torch.equal(a, b)
    assert whole[3] and max(whole[3]) == 1001 * 48  # one slice: the whole weight
    assert sliced[3] and max(sliced[3]) == 100 * 48  # chunks after the first added through a 100-row buffer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_up_to_hidden_size_tokens_one_chunk_gives_the_weight_gradient_in_its_dtype(monkeypatch, dtype):
    """Up to ``hidden_size`` tokens a half-precision head with a trained weight runs in one chunk, and its weight
    gradient is that chunk's product in the weight's dtype (no fp32 [V, H] accumulator: 1.6 GB at a 4B model's
    head), rounded once as the reference's is: as close to the float64 truth as the reference."""
    from _loss_reference import run_both
    from _truth_ops import assert_all_truth

    assert chunked_head.default_chunk_rows(512, 1024, 151_936, widened_weight_grad=True) == 512
    assert chunked_head.default_chunk_rows(2048, 1024, 151_936, widened_weight_grad=True) == 256
    assert chunked_head.default_chunk_rows(512, 1024, 151_936) == 256
    made = []
    init = chunked_head._Grads.__init__

    def spy(self, *args):
        init(self, *args)
        made.append(self)

    monkeypatch.setattr(chunked_head._Grads, "__init__", spy)
    triples = run_both(40, 64, 1001, {}, dtype=dtype, backend="torch", reduction="mean", ignore_frac=0.2)
    assert made and all(g._weight_direct for g in made)
    assert all(g.weight.dtype == dtype for g in made)  # the product itself, never an fp32 accumulator
    assert_all_truth(triples, k=2.0, ulps=1.0, dtype=dtype)


def _run_heads(dtype):
    from fasttrain.loss.token_logprobs import fused_token_log_probs

    torch.manual_seed(0)
    hidden = torch.randn(300, 320, dtype=dtype, requires_grad=True)  # tokens <= hidden size: one chunk
    weight = (torch.randn(1001, 320) * 0.05).to(dtype).requires_grad_()
    labels = torch.randint(0, 1001, (300,))
    labels[::7] = -100
    out = []
    for loss in (
        fused_linear_cross_entropy(hidden, weight, labels, backend="torch", label_smoothing=0.1, softcap=5.0),
        fused_linear_cross_entropy(hidden, weight, labels, backend="torch", z_loss=1e-3, reduction="sum"),
        # TRL's statistics: the entropy's gradient takes the recompute path
        sum(t.float().sum() for t in fused_token_log_probs(
            hidden, weight, labels, outputs=("log_probs", "entropy"), temperature=0.7, backend="torch")
            if t is not None),
    ):  # fmt: skip
        hidden.grad = weight.grad = None
        loss.backward()
        out += [loss.detach(), hidden.grad, weight.grad]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_per_row_math_in_blocks_equals_the_whole_chunk(monkeypatch, dtype):
    """A CPU half-precision chunk runs its per-row math ``STAT_ROWS`` rows at a time (its fp32 temporaries: 311 MB
    each for 512 rows of a 151,936 vocabulary): bit for bit the whole chunk's, with no larger fp32 buffer."""
    sizes = []
    take = chunked_head.Scratch.take

    def spy(self, name, shape, dtype, device):
        if dtype == torch.float32:
            sizes.append(shape[0])
        return take(self, name, shape, dtype, device)

    monkeypatch.setattr(chunked_head.Scratch, "take", spy)
    monkeypatch.setattr(chunked_head, "STAT_ROWS", 1 << 20)
    whole = _run_heads(dtype)
    assert max(sizes) == 300  # one chunk (widened weight gradient), its fp32 temporaries over every row
    sizes.clear()
    monkeypatch.setattr(chunked_head, "STAT_ROWS", 64)
    blocks = _run_heads(dtype)
    assert sizes and max(sizes) == 64
    for a, b in zip(whole, blocks, strict=True):
        assert torch.equal(a, b)
