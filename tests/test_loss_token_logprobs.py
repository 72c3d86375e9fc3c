"""fused_token_log_probs (TRL's fused LM-head contract) against a float64 plain-logits reference and against
TRL's own ``ChunkedLogProbFunction``: every per-token output and every gradient, both backends."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from _loss_reference import norm_rel_err, rel_err
from fasttrain.loss.token_logprobs import OPTIONAL_OUTPUTS, fused_token_log_probs

ALL = ("log_probs", *OPTIONAL_OUTPUTS)
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
    """Materialised logits in float64: the contract written out."""
    x = hidden.double() @ weight.double().t()
    if bias is not None:
        x = x + bias.double()
    z = x * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    log_p = F.log_softmax(z, dim=-1)
    p = log_p.exp()
    valid = labels != -100
    safe = torch.where(valid, labels, 0)
    out = {
        "log_probs": log_p.gather(1, safe[:, None]).squeeze(1),
        "entropy": -(p * log_p).sum(-1),
        "log_sum_sq_probs": (p * p).sum(-1).log(),
        "mean_logits": z.mean(-1),
        "is_top1": z.argmax(-1) == labels,
    }
    return {k: torch.where(valid, v, torch.zeros((), dtype=v.dtype)) for k, v in out.items()}


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
    """(ours, ref) for every output and every gradient; the loss is sum(g_lp * log_probs + g_ent * entropy)."""
    temperature, logit_scale, softcap, bias = HEADS[head]
    (hidden, weight, b), labels = make(n, h, v, bias=bias, seed=seed, dtype=dtype, ignore_frac=ignore_frac)
    dev = _device(backend)
    ours_in = [t if t is None else t.clone().to(dev).requires_grad_() for t in (hidden, weight, b)]
    ref_in = [t if t is None else t.double().clone().requires_grad_() for t in (hidden, weight, b)]
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
    g = torch.Generator().manual_seed(seed + 1)
    if upstream == "sft":  # -sum(log_probs) / n: the same value on every token, no entropy gradient
        g_lp, g_ent = torch.full((n,), -1.0 / 7, dtype=torch.float64), None
    else:
        g_lp, g_ent = (
            torch.randn(n, generator=g, dtype=torch.float64),
            torch.randn(n, generator=g, dtype=torch.float64),
        )
    loss_ours = (ours.log_probs * g_lp.to(dev, torch.float32)).sum()
    loss_ref = (ref["log_probs"] * g_lp).sum()
    if g_ent is not None:
        loss_ours = loss_ours + (ours.entropy * g_ent.to(dev, torch.float32)).sum()
        loss_ref = loss_ref + (ref["entropy"] * g_ent).sum()
    loss_ours.backward()
    loss_ref.backward()
    pairs = [(name, getattr(ours, name).detach().cpu(), ref[name]) for name in ALL]
    for name, o, r in zip(("hidden", "weight", "bias"), ours_in, ref_in, strict=True):
        if o is not None:
            assert o.grad.dtype == o.dtype, name
            pairs.append((f"grad_{name}", o.grad.cpu(), r.grad))
    return pairs


def check(pairs, tol, err=rel_err):
    for name, ours, ref in pairs:
        if ref.dtype == torch.bool:
            assert torch.equal(ours, ref), name
            continue
        assert torch.isfinite(ours).all(), name
        e = err(ours, ref)
        assert e < tol, f"{name}: relative error {e:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("upstream", ["random", "sft"])
@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_values_and_grads_fp32(backend, head, upstream, uniform):
    # uniform=True with a random upstream: the speculation fails and backward recomputes: still exact
    check(run(backend, head, upstream=upstream, uniform=uniform), 2e-5)


@pytest.mark.parametrize(
    ("n", "h", "v", "chunk_rows"), [(1, 8, 5, None), (423, 17, 257, None), (64, 8, 33, 64)]
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_shapes(backend, n, h, v, chunk_rows):
    if backend == "triton" and n > 100 and not torch.cuda.is_available():
        n = 97  # the interpreter runs one Python program per row
    check(run(backend, "all", n, h, v, chunk_rows=chunk_rows), 2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_half_precision_by_norm(backend, dtype):
    # the logits and their gradients are rounded to the input dtype (as the materialised model does)
    pairs = run(
        backend, "softcap+bias", 96, 64, 500, dtype=dtype, chunk_rows=40, uniform=True, upstream="sft"
    )
    check(
        [p for p in pairs if p[0] != "is_top1"], 3e-2 if dtype == torch.bfloat16 else 5e-3, err=norm_rel_err
    )


def test_large_vocab_torch():
    check(run("torch", "all", 40, 16, 70_001, chunk_rows=16), 2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_large_vocab_triton(backend):
    check(run(backend, "all", 6, 16, 70_001, chunk_rows=4), 2e-5)


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
    for name, a, r in zip(ALL, ours, theirs, strict=True):
        if name == "is_top1":
            assert torch.equal(a, r)
        else:
            assert rel_err(a, r) < 2e-6, name
    g = torch.randn(int(valid.sum()), generator=torch.Generator().manual_seed(9)).to(dev)
    ((theirs[0] + 0.1 * theirs[1]) * g).sum().backward()
    ((ours[0] + 0.1 * ours[1]) * g).sum().backward()
    for o, t in zip(our_in, trl_in, strict=True):
        if o is not None:
            assert rel_err(o.grad, t.grad) < 1e-5


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
    first = weight.grad.clone()
    loss.backward()  # the speculative gradients are used once; the second backward recomputes
    assert rel_err(weight.grad, 2 * first) < 1e-6


def test_autocast_computes_in_the_autocast_dtype():
    (hidden, weight, _), labels = make(30, 16, 80, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = fused_token_log_probs(hidden, weight, labels)
    ref = reference(hidden.bfloat16(), weight.bfloat16(), None, labels)["log_probs"]
    assert norm_rel_err(ours.log_probs, ref) < 1e-2


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        (lambda h, w, y: (h.double(), w, y, {}), TypeError, "weight dtype"),
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


def test_fp32_hidden_gradient_buffer(monkeypatch):
    # the CUDA layout (fp32 accumulation of the hidden gradient for bf16 inputs), exercised on CPU
    from fasttrain.loss import token_logprobs

    monkeypatch.setattr(token_logprobs, "has_fp32_addmm", lambda t: True)
    for uniform, upstream in ((True, "sft"), (False, "random")):
        pairs = run("torch", "all", 64, 32, 300, dtype=torch.bfloat16, uniform=uniform, upstream=upstream)
        check([p for p in pairs if p[0] != "is_top1"], 3e-2, err=norm_rel_err)


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_head_any_upstream(backend, monkeypatch):
    """Only the hidden states need a gradient (LoRA): the forward's per-row gradients serve any upstream."""
    from fasttrain.loss import token_logprobs

    original, folds = token_logprobs._fold_grad, []

    def counting(*args):
        folds.append(1)
        return original(*args)

    monkeypatch.setattr(token_logprobs, "_fold_grad", counting)
    (hidden, weight, _), labels = make(45, 16, 120, bias=False, seed=6)
    dev = _device(backend)
    ours_h = hidden.clone().to(dev).requires_grad_()
    ref_h = hidden.double().requires_grad_()
    g = torch.randn(45, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = fused_token_log_probs(
        ours_h, weight.to(dev), labels.to(dev), outputs=ALL, backend=backend, chunk_rows=8
    )
    in_forward = len(folds)
    (out.log_probs * g.float().to(dev)).sum().backward()
    (reference(ref_h, weight, None, labels)["log_probs"] * g).sum().backward()
    assert in_forward == 6 and len(folds) == in_forward  # folded in the forward, none again in backward
    assert rel_err(ours_h.grad.cpu(), ref_h.grad) < 2e-5
