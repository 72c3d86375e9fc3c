"""The Triton chunk kernel (through TRITON_INTERPRET=1 on CPU) against the float64 reference.

The interpreter runs one program per token row in Python, so shapes stay small; the vocab still spans
several vocab blocks (a forced small BLOCK_V on the launcher, and 4,096-wide blocks through the public
function at vocab 5,000).
"""

from __future__ import annotations

import os

import pytest
import torch

from _loss_reference import make_inputs, norm_rel_err, rel_err, run_both

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no GPU and TRITON_INTERPRET is not set",
)

CASES = {
    "plain": ({}, 0.0, False),
    "ignore+bias": ({}, 0.4, True),
    "smoothing": ({"label_smoothing": 0.1}, 0.0, False),
    "z_loss": ({"z_loss": 1e-3}, 0.0, False),
    "softcap": ({"softcap": 2.0}, 0.0, False),
    "all": ({"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 3.0}, 0.25, True),
}


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("block_v", [16, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_several_vocab_blocks(case, block_v):
    from fasttrain.kernels.cross_entropy import cross_entropy_chunk

    opts, ignore_frac, _ = CASES[case]
    (_, _, _), labels = make_inputs(9, 4, 300, ignore_frac=ignore_frac, seed=5)
    logits = torch.randn(9, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3
    scale = torch.rand(9, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 0.5
    ref_logits = logits.clone().requires_grad_()
    x = opts["softcap"] * torch.tanh(ref_logits / opts["softcap"]) if "softcap" in opts else ref_logits
    valid = labels != -100
    per = (
        torch.nn.functional.cross_entropy(
            x, labels, reduction="none", label_smoothing=opts.get("label_smoothing", 0.0)
        )
        + opts.get("z_loss", 0.0) * torch.logsumexp(x, -1) ** 2
    )
    per = torch.where(valid, per, 0.0)
    (per * scale).sum().backward()

    ours = logits.float().to(_device()).contiguous()
    loss, lse = cross_entropy_chunk(
        ours,
        labels.to(_device()),
        scale.float().to(_device()),
        ignore_index=-100,
        label_smoothing=opts.get("label_smoothing", 0.0),
        z_loss=opts.get("z_loss", 0.0),
        softcap=opts.get("softcap"),
        compute_grad=True,
        block_v=block_v,
    )
    assert rel_err(loss.cpu(), per) < 1e-5
    assert rel_err(lse.cpu(), torch.where(valid, torch.logsumexp(x, -1), 0.0)) < 1e-5
    assert rel_err(ours.cpu(), ref_logits.grad) < 1e-5
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
    for name, ours, ref in pairs:
        assert rel_err(ours, ref) < 1e-5, name


@pytest.mark.parametrize("case", ["plain", "all"])
def test_function_triton_bf16(case):
    opts, ignore_frac, bias = CASES[case]
    pairs = run_both(
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
    for name, ours, ref in pairs:
        assert norm_rel_err(ours, ref) < 2e-2, name


def test_triton_matches_torch_backend_bf16():
    # same bf16 logits chunks, same fp32 math: the fp32 losses agree to fp32 rounding; the gradients are
    # rounded to bf16 from slightly different fp32 values, so they agree to about one bf16 ulp
    from fasttrain.loss import fused_linear_cross_entropy

    (hidden, weight, bias), labels = make_inputs(
        20, 16, 600, dtype=torch.bfloat16, ignore_frac=0.2, bias=True
    )
    grads = []
    for backend in ("torch", "triton"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fused_linear_cross_entropy(
            h, w, labels, bias, z_loss=1e-3, label_smoothing=0.1, backend=backend
        )
        loss.backward()
        grads.append((loss.detach(), h.grad, w.grad))
    (loss_a, *grads_a), (loss_b, *grads_b) = grads
    assert rel_err(loss_a, loss_b) < 1e-5
    for a, b in zip(grads_a, grads_b, strict=True):
        assert norm_rel_err(a, b) < 1e-2


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
    for name, ours, ref in pairs:
        assert rel_err(ours, ref) < 1e-5, name
