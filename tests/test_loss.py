"""fused_linear_cross_entropy (PyTorch backend): values and all gradients, bounded by the truth.

Each value is compared with the float64 truth, and may be at most ``k`` times as far from it as the op we
replace (materialised logits in the same dtype, then F.cross_entropy) plus a floor (tests/_truth_ops.py).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from _loss_reference import as_truth, make_inputs, reference_loss, run_both
from _truth_ops import assert_all_truth, assert_bias_no_larger, assert_truth
from fasttrain.loss import default_chunk_rows, fused_linear_cross_entropy

pytestmark = [pytest.mark.cuda, pytest.mark.numeric]

OPTION_SETS = {
    "plain": ({}, 0.0, False),
    "ignore": ({}, 0.3, False),
    "smoothing": ({"label_smoothing": 0.1}, 0.0, False),
    "z_loss": ({"z_loss": 1e-3}, 0.0, False),
    "softcap": ({"softcap": 2.0}, 0.0, False),
    "bias": ({}, 0.0, True),
    "all": ({"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 3.0}, 0.25, True),
}
# The same fp32 arithmetic in another order (chunks, one exponential pass, gradients folded per chunk): twice
# the reference's rounding error, plus 4 fp32 roundings of the value (matmul, log-sum-exp, difference, sum) where
# the reference lands on the truth by chance.
FP32 = {"k": 2.0, "ulps": 4.0}
# bf16/fp16: both round the logits and their gradients to the input dtype once (an error of ~0.3 ulp of the
# dtype in norm for both): twice the reference's error; a floor of 1/8 ulp of each output's own dtype (fp32 for
# the loss) stays under that rounding, so k decides.
HALF = {"k": 2.0, "ulps": 0.125}


def check(triples, **bound):
    for name, ours, _, _ in triples:
        assert torch.isfinite(ours).all(), name
    assert_all_truth(triples, **bound)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", list(OPTION_SETS))
@pytest.mark.parametrize(
    ("n", "h", "v", "chunk_rows"), [(1, 16, 5, None), (37, 33, 5, 8), (423, 67, 257, None)]
)
def test_small_vocab_matrix(n, h, v, chunk_rows, option, reduction):
    opts, ignore_frac, bias = OPTION_SETS[option]
    pairs = run_both(
        n,
        h,
        v,
        opts,
        dtype=torch.float32,
        backend="torch",
        reduction=reduction,
        ignore_frac=ignore_frac,
        bias=bias,
        chunk_rows=chunk_rows,
    )
    check(pairs, **FP32)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("option", ["plain", "all"])
@pytest.mark.parametrize(("n", "h", "v"), [(37, 33, 32_000), (423, 24, 32_000), (37, 17, 65_621)])
def test_large_vocab(n, h, v, option, reduction):
    opts, ignore_frac, bias = OPTION_SETS[option]
    pairs = run_both(
        n,
        h,
        v,
        opts,
        dtype=torch.float32,
        backend="torch",
        reduction=reduction,
        ignore_frac=ignore_frac,
        bias=bias,
    )
    check(pairs, **FP32)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", ["plain", "all"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, option, reduction):
    # Ours rounds the logits and their gradients to the input dtype, as the materialised model does.
    opts, ignore_frac, bias = OPTION_SETS[option]
    pairs = run_both(
        423,
        64,
        1000,
        opts,
        dtype=dtype,
        backend="torch",
        reduction=reduction,
        ignore_frac=ignore_frac,
        bias=bias,
        chunk_rows=100,
    )
    check(pairs, **HALF)


@pytest.mark.parametrize("num_items", [7, 1000, torch.tensor(321)])
def test_num_items_in_batch(num_items):
    opts = {"num_items_in_batch": num_items, "label_smoothing": 0.1}
    check(
        run_both(423, 32, 300, opts, dtype=torch.float32, backend="torch", reduction="mean", ignore_frac=0.3),
        **FP32,
    )


def _grads_of(loss, *tensors):
    loss.backward()
    return [t.grad for t in tensors]


def _same_nonfinite(ours, ref, truth):
    """Same NaN / +inf / -inf pattern as torch, and where finite as close to the truth as torch."""
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(kind(ours), kind(ref)), kind.__name__
        assert torch.equal(kind(ref), kind(truth)), kind.__name__
    finite = torch.isfinite(ref)
    assert_truth(ours[finite], ref[finite], truth[finite], **FP32)


# Empty batches keep torch's semantics (issue 12): the Trainer's evaluation loop drops NaN batch losses,
# so a 0 here would be averaged in. Compared against torch itself, both backends.
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's inf - inf
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    ("case", "num_items"),
    [("all ignored, mean", None), ("all ignored, num_items=0", 0), ("some scored, num_items=0", 0)],
)
def test_empty_denominator_matches_torch(case, num_items, backend):
    if backend == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    (hidden, weight, _), labels = make_inputs(12, 8, 30, seed=4)
    labels[:] = -100
    if case.startswith("some"):
        labels[3:6] = torch.tensor([1, 17, 29])
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h3, w3 = as_truth(hidden), as_truth(weight)
    ours = fused_linear_cross_entropy(
        h1, w1, labels, num_items_in_batch=num_items, chunk_rows=5, backend=backend
    )

    def torch_loss(h, w):
        logits = h @ w.t()
        if num_items is None:
            return torch.nn.functional.cross_entropy(logits, labels)
        # ForCausalLMLoss with num_items_in_batch: a sum divided by it
        return torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / num_items

    ref, truth = torch_loss(h2, w2), torch_loss(h3, w3)
    expected = "inf" if case.startswith("some") else "nan"
    assert str(ref.item()) == expected and str(ours.item()) == expected
    for o, r, t in zip(
        _grads_of(ours, h1, w1), _grads_of(ref, h2, w2), _grads_of(truth, h3, w3), strict=True
    ):
        _same_nonfinite(o, r, t)


def test_one_chunk_fully_ignored():
    opts = {"z_loss": 1e-3}
    (hidden, weight, _), labels = make_inputs(64, 16, 50, seed=3)
    labels[:32] = -100  # the whole first chunk
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h3, w3 = as_truth(hidden), as_truth(weight)
    ours = fused_linear_cross_entropy(h1, w1, labels, chunk_rows=32, **opts)
    ref = reference_loss(h2, w2, labels, **opts)
    truth = reference_loss(h3, w3, labels, **opts)
    for loss in (ours, ref, truth):
        loss.backward()
    check(
        [("loss", ours, ref, truth), ("h", h1.grad, h2.grad, h3.grad), ("w", w1.grad, w2.grad, w3.grad)],
        **FP32,
    )


def test_no_tokens():
    hidden = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    labels = torch.zeros(0, dtype=torch.long)
    for reduction in ("mean", "sum"):
        loss = fused_linear_cross_entropy(hidden, weight, labels, reduction=reduction)
        loss.backward()
        ref = torch.nn.functional.cross_entropy(hidden @ weight.t(), labels, reduction=reduction)
        assert str(loss.item()) == str(ref.item())  # mean: nan (0 / 0), sum: 0.0
    assert fused_linear_cross_entropy(hidden, weight, labels, reduction="none").shape == (0,)


def test_batched_shapes_and_none_shape():
    (hidden, weight, _), labels = make_inputs(3 * 11, 16, 40)
    loss = fused_linear_cross_entropy(
        hidden.reshape(3, 11, 16), weight, labels.reshape(3, 11), reduction="none"
    )
    assert loss.shape == (3, 11) and loss.dtype == torch.float32
    ref = reference_loss(hidden, weight, labels, reduction="none").reshape(3, 11)
    truth = reference_loss(as_truth(hidden), as_truth(weight), labels, reduction="none").reshape(3, 11)
    assert_truth(loss, ref, truth, **FP32)


def test_only_weight_requires_grad_and_no_grad_mode():
    (hidden, weight, _), labels = make_inputs(50, 16, 40)
    weight.requires_grad_()
    fused_linear_cross_entropy(hidden, weight, labels).backward()
    w2, w3 = weight.detach().clone().requires_grad_(), as_truth(weight)
    reference_loss(hidden, w2, labels).backward()
    reference_loss(hidden.double(), w3, labels).backward()
    assert_truth(weight.grad, w2.grad, w3.grad, **FP32)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, labels)
    assert not loss.requires_grad


def test_autocast_matches_linear_under_autocast():
    (hidden, weight, _), labels = make_inputs(64, 32, 100)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    # the truth: float64 on the bf16 values autocast multiplies (a cast's gradient passes through unchanged)
    h3, w3 = as_truth(hidden.bfloat16()), as_truth(weight.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = fused_linear_cross_entropy(h1, w1, labels)
        ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h2, w2).float(), labels)
    truth = torch.nn.functional.cross_entropy(h3 @ w3.t(), labels)
    for loss in (ours, ref, truth):
        loss.backward()
    assert w1.grad.dtype == torch.float32
    triples = [("loss", ours, ref, truth), ("h", h1.grad, h2.grad, h3.grad), ("w", w1.grad, w2.grad, w3.grad)]
    check(triples, **HALF)


def test_second_backward_recomputes():
    (hidden, weight, _), labels = make_inputs(10, 8, 20)
    hidden.requires_grad_()
    loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss.backward(retain_graph=True)  # the forward's gradients, used once
    first = hidden.grad.clone()
    loss.backward()  # recomputed
    torch.testing.assert_close(hidden.grad, 2 * first)


# bf16 rounds every element's gradient; projected on the true gradient over ~10^5 elements that noise averages
# to ~1e-5, while a scale bias (rounding 1 - p before the upstream scale) is ~1e-3: 1/64 of a bf16 ulp (2^-13)
# separates the two.
BIAS_SLACK = 2.0**-13


@pytest.mark.parametrize("n, upstream", [(3000, 1.0), (3000, 3.0), (2048, 0.3)])
def test_bf16_gradient_bias_at_init_no_larger_than_autocast_linear(n, upstream):
    """At initialisation (p ~ 1/V) bf16 rounds 1 - p to 1 on every token: the order of rounding and scaling
    decides a bias on the whole gradient. Ours must be no more biased than autocast nn.Linear + cross_entropy,
    whatever upstream scale the caller applies after the loss (3.0, 0.3: not powers of two)."""
    gen = torch.Generator().manual_seed(n)
    hidden, weight = torch.randn(n, 64, generator=gen), torch.randn(1000, 64, generator=gen) * 0.02
    labels = torch.randint(0, 1000, (n,), generator=gen)
    (h1, w1), (h2, w2) = (
        (hidden.clone().requires_grad_(), weight.clone().requires_grad_()) for _ in range(2)
    )
    h3, w3 = as_truth(hidden.bfloat16()), as_truth(weight.bfloat16())  # on the values autocast multiplies
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = fused_linear_cross_entropy(h1, w1, labels)
        ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h2, w2).float(), labels)
    truth = torch.nn.functional.cross_entropy(h3 @ w3.t(), labels)
    for loss in (ours, ref, truth):
        (loss * upstream).backward()
    assert (h1.grad.dtype, w1.grad.dtype) == (torch.float32, torch.float32)
    assert_bias_no_larger(
        [("hidden", h1.grad, h2.grad, h3.grad), ("weight", w1.grad, w2.grad, w3.grad)], slack=BIAS_SLACK
    )


def test_default_chunk_rows_rule():
    # logits chunk about the size of the hidden states, power of two, >= 256 rows, <= tokens
    assert default_chunk_rows(4096, 512, 151_936) == 256
    assert default_chunk_rows(32_768, 4096, 151_936) == 1024
    assert default_chunk_rows(8192, 4096, 128_256) == 512
    assert default_chunk_rows(10, 4096, 1000) == 10
    assert default_chunk_rows(1000, 64, 5) == 1000
    rows = default_chunk_rows(16_384, 4096, 151_936)
    assert rows * 151_936 >= 16_384 * 4096 and math.log2(rows).is_integer()


def _inputs():
    (hidden, weight, _), labels = make_inputs(6, 8, 20)
    return hidden, weight, labels


@pytest.mark.parametrize(
    ("mutate", "exc", "match"),
    [
        (lambda h, w, y: (h.double(), w, y, {}), TypeError, "weight dtype"),
        (lambda h, w, y: (h, w[:, :5], y, {}), ValueError, "last dimension"),
        (lambda h, w, y: (h, w, y.float(), {}), TypeError, "integer"),
        (lambda h, w, y: (h, w, y[:3], {}), ValueError, "one entry per token"),
        (lambda h, w, y: (h, w, y.index_fill(0, torch.tensor([4]), 20), {}), ValueError, r"labels\[4\] = 20"),
        (lambda h, w, y: (h, w, y, {"reduction": "avg"}), ValueError, "reduction"),
        (lambda h, w, y: (h, w, y, {"backend": "cuda"}), ValueError, "backend"),
        (lambda h, w, y: (h, w, y, {"reduction": "sum", "num_items_in_batch": 3}), ValueError, "num_items"),
        (lambda h, w, y: (h, w, y, {"label_smoothing": 1.5}), ValueError, "label_smoothing"),
        (lambda h, w, y: (h, w, y, {"softcap": 0.0}), ValueError, "softcap"),
        (lambda h, w, y: (h, w, y, {"bias": torch.zeros(3)}), ValueError, "bias"),
    ],
)
def test_bad_input(mutate, exc, match):
    hidden, weight, labels, kwargs = mutate(*_inputs())
    with pytest.raises(exc, match=match):
        fused_linear_cross_entropy(hidden, weight, labels, **kwargs)
