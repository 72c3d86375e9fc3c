"""The Triton chunk kernel (through TRITON_INTERPRET=1 on CPU), bounded by the truth.

Each value is compared with the float64 truth and may be at most ``k`` times as far from it as the op we
replace in the same dtype (F.cross_entropy on materialised logits), plus a floor (tests/_truth_ops.py).
The interpreter runs one program per token row in Python, so shapes stay small; the vocab still spans
several vocab blocks (a forced small BLOCK_V on the launcher, and 4,096-wide blocks through the public
function at vocab 5,000).
"""

from __future__ import annotations

import os

import pytest
import torch

from _loss_reference import make_inputs, reference_loss, run_both
from _truth_ops import assert_all_truth

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no GPU and TRITON_INTERPRET is not set",
)
pytestmark = [pytestmark, pytest.mark.cuda, pytest.mark.numeric]

CASES = {
    "plain": ({}, 0.0, False),
    "ignore+bias": ({}, 0.4, True),
    "smoothing": ({"label_smoothing": 0.1}, 0.0, False),
    "z_loss": ({"z_loss": 1e-3}, 0.0, False),
    "softcap": ({"softcap": 2.0}, 0.0, False),
    "all": ({"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 3.0}, 0.25, True),
}


# fp32: the same arithmetic in another order (vocab blocks, online log-sum-exp): twice the reference's rounding
# error, plus 4 fp32 roundings of the value (log-sum-exp, difference, sum) where the reference lands on the truth.
FP32 = {"k": 2.0, "ulps": 4.0}
# bf16: both round the logits and their gradients to bf16 once (~0.3 bf16 ulp in norm for both): twice the
# reference's error; a floor of 1/8 ulp of each output's dtype (fp32 for the loss) stays under it, so k decides.
BF16 = {"k": 2.0, "ulps": 0.125}


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("block_v", [16, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_several_vocab_blocks(case, block_v, monkeypatch):
    """The cross-entropy's chunk math on the Triton kernels (row_stats, then row_grad in place), forced to
    several vocab blocks per row."""
    from fasttrain.kernels import lm_head
    from fasttrain.loss.function import _CrossEntropyMath

    monkeypatch.setattr(lm_head, "pick_block_v", lambda n_cols: block_v)
    opts, ignore_frac, _ = CASES[case]
    (_, _, _), labels = make_inputs(9, 4, 300, ignore_frac=ignore_frac, seed=5)
    logits = torch.randn(9, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3
    scale = (torch.rand(9, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 0.5).float()

    def torch_chunk(x):
        """Per-row loss and log-sum-exp of the logits ``x``, and the scaled gradient, with torch's ops."""
        x = x.clone().requires_grad_()
        y = opts["softcap"] * torch.tanh(x / opts["softcap"]) if "softcap" in opts else x
        per = (
            torch.nn.functional.cross_entropy(
                y, labels, reduction="none", label_smoothing=opts.get("label_smoothing", 0.0)
            )
            + opts.get("z_loss", 0.0) * torch.logsumexp(y, -1) ** 2
        )
        per = torch.where(valid, per, 0.0)
        (per * scale.to(x.dtype)).sum().backward()
        lse = torch.where(valid, torch.logsumexp(y, -1), 0.0)
        return per.detach(), lse.detach(), x.grad

    valid = labels != -100
    ref = torch_chunk(logits.float())  # the reference: torch in the kernel's fp32
    truth = torch_chunk(logits.float().double())  # on the exact fp32 values the kernel gets

    ours = logits.float().to(_device()).contiguous()
    full = {"ignore_index": -100, "label_smoothing": 0.0, "z_loss": 0.0, "softcap": None, **opts}
    math = _CrossEntropyMath(labels.to(_device()), "triton", full, vocab=300)
    grad = math.forward_chunk(ours, 0, 9, scale.to(_device()), None)
    assert grad is ours  # in place
    got = (math.take_outputs()[0].cpu(), math.log_z.cpu(), ours.cpu())
    assert_all_truth(list(zip(("loss", "lse", "grad"), got, ref, truth, strict=True)), **FP32)
    assert torch.all(ours.cpu()[~valid] == 0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", ["plain", "all"])
@pytest.mark.parametrize(("n", "h", "v"), [(1, 16, 5), (37, 19, 40), (6, 8, 5000)])
def test_function_triton_backend(n, h, v, case, reduction):
    opts, ignore_frac, bias = CASES[case]
    pairs = run_both(
        n,
        h,
        v,
        opts,
        dtype=torch.float32,
        backend="triton",
        reduction=reduction,
        ignore_frac=ignore_frac,
        bias=bias,
        chunk_rows=16,
    )
    assert_all_truth(pairs, **FP32)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_bf16(case):
    opts, ignore_frac, bias = CASES[case]
    return run_both(
        24,
        32,
        700,
        opts,
        dtype=torch.bfloat16,
        backend="triton",
        reduction="mean",
        ignore_frac=ignore_frac,
        bias=bias,
        chunk_rows=8,
    )


@pytest.mark.parametrize("case", ["plain", "all"])
def test_function_triton_bf16(case):
    triples = _triton_bf16(case)
    # the bias gradient under the interpreter: test_function_triton_bf16_bias_interpreted
    assert_all_truth([t for t in triples if not (INTERPRETED and t[0] == "grad_bias")], **BF16)


@pytest.mark.skipif(not INTERPRETED, reason="compiled Triton rounds to nearest: checked in the test above")
@pytest.mark.xfail(
    strict=True,
    reason="not fasttrain's kernel: triton 3.9's interpreter casts fp32 to bf16 toward zero (its cast ignores the "
    "rounding mode; 50% of 1e5 randn values differ from torch's nearest rounding, all toward zero), a bias that "
    "adds up in the bias gradient (a sum over tokens): measured |ours-f64| 6.49e-4 vs torch's 2.27e-4 (2.86x; "
    "the hidden and weight gradients 1.89x and 1.73x)",
)
def test_function_triton_bf16_bias_interpreted():
    grad_bias = [t for t in _triton_bf16("all") if t[0] == "grad_bias"]
    assert_all_truth(grad_bias, **BF16)


def test_triton_matches_torch_backend_bf16():
    # the same bf16 logits chunks and fp32 math as the torch backend (the reference here), whose gradients are
    # rounded to bf16 from slightly different fp32 values: as close to the float64 truth as it is
    from fasttrain.loss import fused_linear_cross_entropy

    (hidden, weight, bias), labels = make_inputs(
        20, 16, 600, dtype=torch.bfloat16, ignore_frac=0.2, bias=True
    )
    opts = {"z_loss": 1e-3, "label_smoothing": 0.1}
    results = []
    for backend in ("torch", "triton", "truth"):
        h, w, b = (t.detach().double() if backend == "truth" else t.clone() for t in (hidden, weight, bias))
        h.requires_grad_(), w.requires_grad_()
        if backend == "truth":
            loss = reference_loss(h, w, labels, b, **opts)
        else:
            loss = fused_linear_cross_entropy(h, w, labels, b, **opts, backend=backend)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    ref, ours, truth = results
    triples = list(zip(("loss", "grad_hidden", "grad_weight"), ours, ref, truth, strict=True))
    assert_all_truth(triples[:1], **FP32)  # the loss is fp32 from the same bf16 logits
    assert_all_truth(triples[1:], **BF16)


@pytest.mark.slow
def test_function_triton_vocab_above_65536():
    pairs = run_both(
        5,
        8,
        70_001,
        {"label_smoothing": 0.1, "softcap": 5.0},
        dtype=torch.float32,
        backend="triton",
        reduction="mean",
    )
    assert_all_truth(pairs, **FP32)
