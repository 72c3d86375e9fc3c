"""fused_token_log_probs (TRL's fused LM-head contract): every per-token output and every gradient, both backends,
bounded by the truth.

Each value is compared with the float64 truth (plain logits) and may be at most ``k`` times as far from it as the
same computation in our dtype with torch's ops, or as TRL's own ``ChunkedLogProbFunction``, plus a floor
(tests/_truth_ops.py). Top-1 hits are compared where the label's logit margin exceeds the logits' resolution.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from _loss_reference import as_truth
from _truth_ops import assert_all_truth, assert_bias_no_larger, assert_truth
from fasttrain.loss.token_logprobs import OPTIONAL_OUTPUTS, fused_token_log_probs

pytestmark = [pytest.mark.cuda, pytest.mark.numeric]

ALL = ("log_probs", *OPTIONAL_OUTPUTS)
OUTPUTS = [name for name in ALL if name != "is_top1"]  # the values; is_top1 is checked through its margin
HEADS = {  # temperature, logit_scale, softcap, bias
    "plain": (1.0, 1.0, None, False),
    "temperature+scale": (0.7, 1.3, None, False),
    "softcap+bias": (1.0, 1.0, 3.0, True),
    "all": (1.4, 0.8, 5.0, True),
}
BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
            reason="no GPU and TRITON_INTERPRET is not set",
        ),
    ),
]


# fp32: the same arithmetic in another order (chunks, online log-sum-exp, speculative gradients): twice the
# reference's rounding error, plus 4 fp32 roundings of the value where the reference lands on the truth by chance.
FP32 = {"k": 2.0, "ulps": 4.0}
# bf16/fp16: both round the logits and their gradients to the input dtype once (~0.3 ulp of the dtype in norm):
# twice the reference's error; a floor of 1/8 ulp of each output's own dtype stays under it, so k decides.
HALF = {"k": 2.0, "ulps": 0.125}


def _device(backend):
    return "cuda" if torch.cuda.is_available() and backend == "triton" else "cpu"


def make(n, h, v, *, bias, ignore_frac=0.3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (2.0 / h**0.5)
    b = torch.randn(v, generator=g, dtype=torch.float64) * 0.5 if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = -100
    return [t if t is None else t.to(dtype) for t in (hidden, weight, b)], labels


def reference(hidden, weight, bias, labels, temperature=1.0, logit_scale=1.0, softcap=None):
    """Materialised logits: the contract written out. The matmul in the inputs' dtype, then the logits in fp32
    (as TRL's head upcasts them); on float64 inputs, the truth. ``top1_margin`` is the label's logit minus the
    best other one: the value ``is_top1`` thresholds."""
    x = torch.nn.functional.linear(hidden, weight, bias)
    if x.dtype != torch.float64:
        x = x.float()
    z = x * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = F.log_softmax(z, dim=-1)
    p = log_p.exp()
    valid = labels != -100
    safe = torch.where(valid, labels, 0)
    label_logit = z.gather(1, safe[:, None]).squeeze(1)
    others = z.scatter(1, safe[:, None], float("-inf"))
    out = {
        "log_probs": log_p.gather(1, safe[:, None]).squeeze(1),
        "entropy": -(p * log_p).sum(-1),
        "log_sum_sq_probs": (p * p).sum(-1).log(),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == labels,
        "top1_margin": label_logit - others.amax(-1),
        "max_abs_logit": z.abs().amax(-1),
    }
    return {k: torch.where(valid, v, torch.zeros((), dtype=v.dtype)) for k, v in out.items()}


def assert_top1(ours, truth, dtype, ulps=4.0):
    """Top-1 hits equal the truth's wherever the label's margin exceeds ``ulps`` rounding steps of the logits'
    dtype at the row's largest logit; closer calls may go either way (the reference's may too)."""
    decided = truth["top1_margin"].abs() > ulps * torch.finfo(dtype).eps * truth["max_abs_logit"]
    assert torch.equal(ours[decided], truth["is_top1"][decided])
    assert not ours[~decided & (truth["max_abs_logit"] == 0)].any()  # ignored rows


def run(
    backend,
    head,
    n=37,
    h=24,
    v=301,
    *,
    uniform=False,
    upstream="random",
    chunk_rows=8,
    dtype=torch.float32,
    seed=0,
    ignore_frac=0.3,
):
    """(name, ours, reference, truth) for every output and every gradient (top-1 hits checked here, through their
    margin); the loss is sum(g_lp * log_probs + g_ent * entropy)."""
    temperature, logit_scale, softcap, bias = HEADS[head]
    (hidden, weight, b), labels = make(n, h, v, bias=bias, seed=seed, dtype=dtype, ignore_frac=ignore_frac)
    dev = _device(backend)
    ours_in = [t if t is None else t.clone().to(dev).requires_grad_() for t in (hidden, weight, b)]
    ref_in = [t if t is None else t.clone().requires_grad_() for t in (hidden, weight, b)]
    truth_in = [as_truth(t) for t in (hidden, weight, b)]
    ours = fused_token_log_probs(
        ours_in[0],
        ours_in[1],
        labels.to(dev),
        ours_in[2],
        temperature=temperature,
        logit_scale=logit_scale,
        softcap=softcap,
        outputs=ALL,
        uniform_grad=uniform,
        backend=backend,
        chunk_rows=chunk_rows,
    )
    ref = reference(*ref_in, labels, temperature, logit_scale, softcap)
    truth = reference(*truth_in, labels, temperature, logit_scale, softcap)
    g = torch.Generator().manual_seed(seed + 1)
    if upstream == "sft":  # -sum(log_probs) / n: the same value on every token, no entropy gradient
        g_lp, g_ent = torch.full((n,), -1.0 / 7), None
    else:
        g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    for out, get, to in (
        (ours, lambda k: getattr(ours, k), dev),
        (ref, ref.get, "cpu"),
        (truth, truth.get, "cpu"),
    ):
        wide = torch.float64 if out is truth else torch.float32  # the same fp32 upstream values for all three
        loss = (get("log_probs") * g_lp.to(to, wide)).sum()
        if g_ent is not None:
            loss = loss + (get("entropy") * g_ent.to(to, wide)).sum()
        loss.backward()
    assert_top1(ours.is_top1.cpu(), truth, dtype)
    triples = [
        (name, getattr(ours, name).detach().cpu(), ref[name].detach(), truth[name].detach())
        for name in OUTPUTS
    ]
    for name, o, r, t in zip(("hidden", "weight", "bias"), ours_in, ref_in, truth_in, strict=True):
        if o is not None:
            assert o.grad.dtype == o.dtype, name
            triples.append((f"grad_{name}", o.grad.cpu(), r.grad, t.grad))
    return triples


def check(triples, **bound):
    for name, ours, _, _ in triples:
        assert torch.isfinite(ours).all(), name
    assert_all_truth(triples, **bound)


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("upstream", ["random", "sft"])
@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_values_and_grads_fp32(backend, head, upstream, uniform):
    # uniform=True with a random upstream: the speculation fails and backward recomputes: still exact
    check(run(backend, head, upstream=upstream, uniform=uniform), **FP32)


@pytest.mark.parametrize(
    ("n", "h", "v", "chunk_rows"), [(1, 8, 5, None), (423, 17, 257, None), (64, 8, 33, 64)]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_shapes(backend, n, h, v, chunk_rows):
    if backend == "triton" and n > 100 and not torch.cuda.is_available():
        n = 97  # the interpreter runs one Python program per row
    check(run(backend, "all", n, h, v, chunk_rows=chunk_rows), **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_by_norm(backend, dtype):
    # the logits and their gradients are rounded to the input dtype (as the materialised model does)
    check(
        run(backend, "softcap+bias", 96, 64, 500, dtype=dtype, chunk_rows=40, uniform=True, upstream="sft"),
        **HALF,
    )


def test_large_vocab_torch():
    # log_sum_sq_probs and entropy sum over the vocabulary with torch's cascade sum (a bmm dot product was
    # 19.7x farther from float64 than the reference at vocab 70,001)
    check(run("torch", "all", 40, 16, 70_001, chunk_rows=16), **FP32)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_large_vocab_triton(backend):
    check(run(backend, "all", 6, 16, 70_001, chunk_rows=4), **FP32)


@pytest.mark.parametrize("head", ["plain", "all"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_equals_trl_chunked_logprob(backend, head):
    """TRL's own ChunkedLogProbFunction (its torch path on CPU) on the same fp32 inputs."""
    kernels = pytest.importorskip("trl.kernels")
    temperature, logit_scale, softcap, bias = HEADS[head]
    (hidden, weight, b), labels = make(53, 32, 1000, bias=bias, seed=3)
    valid = labels != -100
    dev = _device(backend)
    trl_in = [t if t is None else t.clone().to(dev).requires_grad_() for t in (hidden, weight, b)]
    our_in = [t if t is None else t.clone().to(dev).requires_grad_() for t in (hidden, weight, b)]
    theirs = kernels.ChunkedLogProbFunction.apply(
        trl_in[0][valid.to(dev)],
        trl_in[1],
        trl_in[2],
        labels[valid].to(dev),
        temperature,
        256,
        softcap,
        logit_scale,
        ALL,
    )
    ours = fused_token_log_probs(
        our_in[0][valid.to(dev)],
        our_in[1],
        labels[valid].to(dev),
        our_in[2],
        temperature=temperature,
        logit_scale=logit_scale,
        softcap=softcap,
        outputs=ALL,
        backend=backend,
        chunk_rows=16,
    )
    # the truth: float64 on the same values, with the same upstream gradient
    truth_in = [as_truth(t) for t in (hidden, weight, b)]
    truth = reference(
        truth_in[0][valid], truth_in[1], truth_in[2], labels[valid], temperature, logit_scale, softcap
    )
    assert_top1(ours.is_top1.cpu(), truth, torch.float32)
    assert_top1(theirs[ALL.index("is_top1")].cpu(), truth, torch.float32)  # the margin rule holds for TRL too
    values = [
        (name, ours[i].cpu(), theirs[i].cpu(), truth[name]) for i, name in enumerate(ALL) if name != "is_top1"
    ]
    assert_all_truth(values, **FP32)
    g = torch.randn(int(valid.sum()), generator=torch.Generator().manual_seed(9))
    ((theirs[0] + 0.1 * theirs[1]) * g.to(dev)).sum().backward()
    ((ours[0] + 0.1 * ours[1]) * g.to(dev)).sum().backward()
    ((truth["log_probs"] + 0.1 * truth["entropy"]) * g.double()).sum().backward()
    grads = [
        (name, o.grad.cpu(), t.grad.cpu(), x.grad)
        for name, o, t, x in zip(("hidden", "weight", "bias"), our_in, trl_in, truth_in, strict=True)
        if o is not None
    ]
    assert_all_truth(grads, **FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top1_ties_count_the_first_argmax(backend):
    # duplicated vocabulary rows give exact ties: the label is top-1 only if it is the first of them
    dev = _device(backend)
    hidden = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    weight = torch.zeros(40, 8)
    weight[7] = hidden.sum(0)  # a big logit for every row
    weight[30] = weight[7]
    labels = torch.tensor([7, 30, 3, -100, 7, 30])
    out = fused_token_log_probs(
        hidden.to(dev), weight.to(dev), labels.to(dev), outputs=ALL, backend=backend, chunk_rows=4
    )
    logits = hidden @ weight.t()
    expected = (logits.argmax(-1) == labels) & (labels != -100)
    assert expected.tolist() == [True, False, False, False, True, False]
    assert torch.equal(out.is_top1.cpu(), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_and_all_ignored(backend):
    dev = _device(backend)
    for labels in (torch.zeros(0, dtype=torch.long), torch.full((5,), -100)):
        hidden = torch.randn(labels.numel(), 8, device=dev, requires_grad=True)
        weight = torch.randn(20, 8, device=dev, requires_grad=True)
        out = fused_token_log_probs(
            hidden, weight, labels.to(dev), outputs=ALL, backend=backend, uniform_grad=True
        )
        assert all(x.shape == labels.shape for x in out)
        assert not out.log_probs.any() and not out.is_top1.any()
        (-out.log_probs.sum()).backward()
        assert not hidden.grad.any() and not weight.grad.any()


def test_requested_outputs_only_and_no_grad_mode():
    (hidden, weight, _), labels = make(20, 8, 50, bias=False)
    out = fused_token_log_probs(hidden, weight, labels, outputs=("log_probs", "is_top1"))
    assert out.entropy is None and out.mean_logits is None and out.log_sum_sq_probs is None
    assert out.is_top1.dtype == torch.bool and out.log_probs.dtype == torch.float32
    with torch.no_grad():
        assert not fused_token_log_probs(hidden, weight.requires_grad_(), labels).log_probs.requires_grad


def test_second_backward_recomputes():
    (hidden, weight, _), labels = make(20, 8, 50, bias=False)
    weight.requires_grad_()
    out = fused_token_log_probs(hidden, weight, labels, uniform_grad=True)
    loss = -out.log_probs.sum()
    loss.backward(retain_graph=True)
    speculative, weight.grad = weight.grad, None
    loss.backward()  # the speculative gradients are used once; the second backward recomputes
    truth_weight = as_truth(weight)
    (-reference(hidden.double(), truth_weight, None, labels)["log_probs"].sum()).backward()
    # the recomputed gradient is as exact as the speculative one (the reference here)
    assert_truth(weight.grad, speculative, truth_weight.grad, **FP32)


def test_autocast_computes_in_the_autocast_dtype():
    (hidden, weight, _), labels = make(30, 16, 80, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = fused_token_log_probs(hidden, weight, labels)
        ref = reference(hidden, weight, None, labels)["log_probs"]  # F.linear under autocast: bf16 logits
    # the truth: float64 on the bf16 values autocast multiplies
    truth = reference(hidden.bfloat16().double(), weight.bfloat16().double(), None, labels)["log_probs"]
    assert ref.dtype == ours.log_probs.dtype == torch.float32
    assert_truth(ours.log_probs, ref, truth, **HALF)


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        (lambda h, w, y: (h, w.to(torch.int32), y, {}), TypeError, "weight dtype"),
        (lambda h, w, y: (h[:, :3], w, y, {}), ValueError, "weight must be"),
        (lambda h, w, y: (h, w, y.float(), {}), TypeError, "integer"),
        (lambda h, w, y: (h, w, y[:2], {}), ValueError, "one per token"),
        (lambda h, w, y: (h, w, y.index_fill(0, torch.tensor([3]), 50), {}), ValueError, r"labels\[3\] = 50"),
        (lambda h, w, y: (h, w, y, {"temperature": 0.0}), ValueError, "temperature"),
        (lambda h, w, y: (h, w, y, {"softcap": -1.0}), ValueError, "softcap"),
        (lambda h, w, y: (h, w, y, {"outputs": ("log_probs", "logits")}), ValueError, "unknown outputs"),
        (lambda h, w, y: (h, w, y, {"backend": "cuda"}), ValueError, "backend"),
    ],
)
def test_bad_input(change, exc, match):
    (hidden, weight, _), labels = make(6, 8, 50, bias=False, ignore_frac=0.0)
    hidden, weight, labels, kwargs = change(hidden, weight, labels)
    with pytest.raises(exc, match=match):
        fused_token_log_probs(hidden, weight, labels, **kwargs)


@pytest.mark.parametrize("factor, refolds", [(1.0, False), (2.0, False), (-0.25, False), (3.0, True)])
@pytest.mark.parametrize("frozen_head", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_speculation_used_only_where_exact(backend, frozen_head, factor, refolds, monkeypatch):
    """uniform_grad: the forward's gradients (for -1/n on each scored log-prob) serve an upstream that is a power
    of two times that (rounding commutes with it); any other upstream recomputes. A frozen head (LoRA: only the
    hidden states need a gradient) follows the same rule."""
    from fasttrain.loss import chunked_head

    original, folds = chunked_head._Grads.fold, []
    monkeypatch.setattr(chunked_head._Grads, "fold", lambda *a: folds.append(1) or original(*a))
    (hidden, weight, _), labels = make(45, 16, 120, bias=False, seed=6)
    dev = _device(backend)
    ours = [hidden.clone().to(dev).requires_grad_(), weight.clone().to(dev).requires_grad_(not frozen_head)]
    ref = [hidden.clone().requires_grad_(), weight.clone().requires_grad_(not frozen_head)]
    truth = [as_truth(hidden), as_truth(weight) if not frozen_head else weight.double()]
    out = fused_token_log_probs(
        *ours, labels.to(dev), outputs=ALL, uniform_grad=True, backend=backend, chunk_rows=8
    )
    in_forward = len(folds)
    n_scored = int((labels != -100).sum())
    (-factor * out.log_probs.sum() / n_scored).backward()
    (-factor * reference(*ref, None, labels)["log_probs"].sum() / n_scored).backward()
    (-factor * reference(*truth, None, labels)["log_probs"].sum() / n_scored).backward()
    assert in_forward == 6 and len(folds) == in_forward * (2 if refolds else 1)
    for o, r, t in zip(ours, ref, truth, strict=True):
        if o.requires_grad:
            assert_truth(o.grad.cpu(), r.grad, t.grad, **FP32)


@pytest.mark.parametrize("n, factor", [(3000, 1.0), (2048, 3.0)])
def test_bf16_gradient_bias_at_init_no_larger_than_trls_head(n, factor):
    """At initialisation (p ~ 1/V) bf16 rounds 1 - p to 1 on every token, so whether the upstream scale is
    applied before or after that rounding decides a bias on the whole gradient. Under SFT's loss
    (-sum(log_probs) / n, times a caller's factor), ours must be no more biased than TRL's own head."""
    trl_kernels = pytest.importorskip("trl.kernels")
    gen = torch.Generator().manual_seed(n)
    hidden, weight = torch.randn(n, 64, generator=gen), torch.randn(1000, 64, generator=gen) * 0.02
    labels = torch.randint(0, 1000, (n,), generator=gen)
    (h1, w1), (h2, w2) = (
        [hidden.clone().requires_grad_(), weight.clone().requires_grad_()] for _ in range(2)
    )
    h3, w3 = as_truth(hidden.bfloat16()), as_truth(weight.bfloat16())  # on the values autocast multiplies
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = fused_token_log_probs(h1, w1, labels, uniform_grad=True).log_probs
        theirs = trl_kernels.ChunkedLogProbFunction.apply(
            h2, w2, None, labels, 1.0, 32768, None, 1.0, ("log_probs",)
        )
    truth = F.log_softmax(h3 @ w3.t(), dim=-1).gather(1, labels[:, None]).squeeze(1)
    for log_probs in (ours, theirs[0], truth):
        (-factor * log_probs.sum() / n).backward()
    assert (h1.grad.dtype, w1.grad.dtype) == (torch.float32, torch.float32)
    triples = [("hidden", h1.grad, h2.grad, h3.grad), ("weight", w1.grad, w2.grad, w3.grad)]
    assert_bias_no_larger(triples, slack=2.0**-13)  # as tests/test_loss.py's BIAS_SLACK
