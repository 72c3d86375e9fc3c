"""Both LM heads given operands of different dtypes, as autocast hands them over, against the autocast reference.

Under autocast ``nn.Linear`` casts the hidden states, the weight and the bias to the autocast dtype, computes in
it with fp32 accumulation, and its gradients flow back through the casts into each input's own dtype. The cases
users hit: fp16 weights trained with ``bf16=True`` (a checkpoint saved in fp16), bf16 weights under fp16 autocast,
fp32 master weights with bf16 activations, and a frozen head in another dtype than the trainable backbone.

Each value and gradient is bounded by the float64 truth computed on the values autocast multiplies (a cast's
gradient passes through unchanged): ours at most ``k`` times as far from it as the autocast reference, plus a floor
(tests/_truth_ops.py). Outside autocast, mixed dtypes stay an error for the cross-entropy (as for ``F.linear``) and
are cast to the hidden states' dtype by TRL's head (its ``cast_lm_head_to_fp32``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _loss_reference import as_truth, make_inputs
from _truth_ops import assert_all_truth
from fasttrain.loss import fused_linear_cross_entropy
from fasttrain.loss.token_logprobs import fused_token_log_probs

pytestmark = pytest.mark.numeric

HALF = {"k": 2.0, "ulps": 0.125}  # as tests/test_loss.py for half-precision matmuls
FP32 = {"k": 2.0, "ulps": 4.0}

# (autocast dtype, hidden dtype, weight dtype, whether the weight is trained)
CASES = {
    "fp16 weights, bf16 autocast": (torch.bfloat16, torch.float32, torch.float16, True),
    "bf16 weights, fp16 autocast": (torch.float16, torch.float32, torch.bfloat16, True),
    "fp32 master weights, bf16 activations": (torch.bfloat16, torch.bfloat16, torch.float32, True),
    "frozen bf16 head, fp32 backbone, bf16 autocast": (torch.bfloat16, torch.float32, torch.bfloat16, False),
    "frozen fp16 head, bf16 activations, bf16 autocast": (
        torch.bfloat16,
        torch.bfloat16,
        torch.float16,
        False,
    ),
}


def _operands(case, n=96, h=48, v=300, bias=True):
    autocast, h_dtype, w_dtype, train_weight = CASES[case]
    (hidden, weight, b), labels = make_inputs(n, h, v, bias=bias, ignore_frac=0.25)
    hidden, weight = hidden.to(h_dtype), weight.to(w_dtype)
    b = None if b is None else b.to(w_dtype)
    return autocast, hidden, weight, b, labels, train_weight


def _leaves(hidden, weight, bias, train_weight):
    return (
        hidden.clone().requires_grad_(),
        weight.clone().requires_grad_(train_weight),
        None if bias is None else bias.clone().requires_grad_(train_weight),
    )


def _truth_leaves(hidden, weight, bias, autocast, train_weight):
    """float64 copies of the values autocast multiplies."""
    h, w = as_truth(hidden.to(autocast)), as_truth(weight.to(autocast))
    b = None if bias is None else as_truth(bias.to(autocast))
    if not train_weight:
        w.requires_grad_(False)
        if b is not None:
            b.requires_grad_(False)
    return h, w, b


def _grad_triples(ours, ref, truth):
    names = ("hidden", "weight", "bias")
    return [
        (f"grad {name}", a.grad, b.grad, c.grad)
        for name, a, b, c in zip(names, ours, ref, truth, strict=True)
        if a is not None and a.requires_grad
    ]


@pytest.mark.parametrize("case", list(CASES))
def test_cross_entropy_as_autocast_linear(case):
    autocast, hidden, weight, bias, labels, train_weight = _operands(case)
    ours_in, ref_in = _leaves(hidden, weight, bias, train_weight), _leaves(hidden, weight, bias, train_weight)
    truth_in = _truth_leaves(hidden, weight, bias, autocast, train_weight)
    with torch.autocast("cpu", dtype=autocast):
        ours = fused_linear_cross_entropy(*ours_in[:2], labels, ours_in[2])
        ref = F.cross_entropy(
            F.linear(*ref_in).float(), labels
        )  # the model's logits, upcast by ForCausalLMLoss
    truth = F.cross_entropy(F.linear(*truth_in), labels)
    for loss in (ours, ref, truth):
        loss.backward()
    for mine, theirs in zip(ours_in, ref_in, strict=True):  # the gradients come back in each input's dtype
        if mine is not None and mine.requires_grad:
            assert mine.grad.dtype == theirs.grad.dtype == mine.dtype
    triples = [("loss", ours, ref, truth)]
    triples += _grad_triples(ours_in, ref_in, truth_in)
    assert_all_truth(triples, **HALF)


def _trl_reference(hidden, weight, bias, labels):
    """TRL's head written out: the projection (under the caller's autocast), the logits in fp32, log-softmax."""
    z = F.linear(hidden, weight, bias)
    z = z if z.dtype == torch.float64 else z.float()
    log_p = F.log_softmax(z, dim=-1)
    valid = labels != -100
    picked = log_p.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    zero = torch.zeros((), dtype=z.dtype)
    return torch.where(valid, picked, zero), torch.where(valid, entropy, zero)


@pytest.mark.parametrize("case", list(CASES))
def test_trl_head_as_autocast_linear(case):
    autocast, hidden, weight, bias, labels, train_weight = _operands(case)
    ours_in, ref_in = _leaves(hidden, weight, bias, train_weight), _leaves(hidden, weight, bias, train_weight)
    truth_in = _truth_leaves(hidden, weight, bias, autocast, train_weight)
    upstream = torch.randn(labels.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=autocast):
        stats = fused_token_log_probs(*ours_in[:2], labels, ours_in[2], outputs=("log_probs", "entropy"))
        ref = _trl_reference(*ref_in, labels)
    truth = _trl_reference(*truth_in, labels)
    # a per-token upstream (GRPO's, KTO's): the backward recomputes; the entropy trained too (an entropy bonus)
    for (lp, ent), up in (
        ((stats.log_probs, stats.entropy), upstream.float()),
        (ref, upstream.float()),
        (truth, upstream),
    ):
        ((lp * up).sum() + 0.1 * ent.sum()).backward()
    triples = [("log_probs", stats.log_probs, ref[0], truth[0]), ("entropy", stats.entropy, ref[1], truth[1])]
    triples += _grad_triples(ours_in, ref_in, truth_in)
    assert_all_truth(triples, **HALF)


def test_outside_autocast_the_cross_entropy_refuses_mixed_dtypes_as_f_linear_does():
    (hidden, weight, _), labels = make_inputs(8, 16, 40)
    with pytest.raises(RuntimeError):
        F.linear(hidden, weight.bfloat16())
    with pytest.raises(
        TypeError, match=r"weight dtype torch\.bfloat16 differs from hidden dtype torch\.float32"
    ):
        fused_linear_cross_entropy(hidden, weight.bfloat16(), labels)


def test_trl_head_in_fp32_outside_autocast_casts_the_head():
    """``cast_lm_head_to_fp32``: TRL runs its head on fp32 hidden states outside autocast, the bf16 weight cast
    to fp32; the weight's gradient comes back in bf16."""
    (hidden, weight, _), labels = make_inputs(64, 32, 200, ignore_frac=0.2)
    w16 = weight.bfloat16()
    ours_w, ref_w, truth_w = w16.clone().requires_grad_(), w16.clone().requires_grad_(), as_truth(w16)
    h1, h2, h3 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_(), as_truth(hidden)
    ours = fused_token_log_probs(h1, ours_w, labels).log_probs
    ref = _trl_reference(h2, ref_w.float(), None, labels)[0]
    truth = _trl_reference(h3, truth_w, None, labels)[0]
    for lp in (ours, ref, truth):
        lp.sum().backward()
    assert ours_w.grad.dtype == torch.bfloat16 and h1.grad.dtype == torch.float32
    assert_all_truth(
        [
            ("log_probs", ours, ref, truth),
            ("h", h1.grad, h2.grad, h3.grad),
            ("w", ours_w.grad, ref_w.grad, truth_w.grad),
        ],
        **FP32,
    )


def test_forward_only_calls_keep_nothing_for_a_backward():
    """The old policy's and the reference model's log-probs are taken under no_grad: nothing is kept."""
    (hidden, weight, _), labels = make_inputs(32, 16, 100)
    hidden.requires_grad_()
    with torch.no_grad():
        stats = fused_token_log_probs(hidden, weight, labels, outputs=("log_probs", "entropy"))
    assert stats.log_probs.grad_fn is None and stats.entropy.grad_fn is None
