"""``step_in_backward`` (FusedAdamW's update inside backward) against the ordinary loop, bit for bit.

For the same model, data and seeds, N steps of ``loss.backward()`` with the update in backward must leave exactly
the parameters and optimizer states of ``loss.backward(); opt.step(); opt.zero_grad()`` (torch.equal), in every
state layout, parameter dtype, stochastic rounding, two param groups with their own lr and weight decay, and an lr
schedule changing ``group["lr"]`` between steps. The in-backward run calls ``opt.step()`` and ``opt.zero_grad()``
as usual too: they must not step anything twice. Small shapes; the Triton path runs under TRITON_INTERPRET=1 on
CPU (tests/conftest.py) at one tiny model.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from fasttrain import FusedAdamW
from fasttrain.optim.in_backward import step_in_backward

pytestmark = pytest.mark.numeric

STEPS = 3
MIN_8BIT = 256  # the 16x32 and 32x32 weights (512, 1024 elements) get 8-bit moments, the rest fp32


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.hidden = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.hidden(h))
        h = torch.tanh(self.hidden(h))  # used twice: its hook must fire once, on the summed gradient
        return self.out(h) * self.scale


def make_model(dtype: torch.dtype, device: str = "cpu") -> Tiny:
    torch.manual_seed(0)
    return Tiny().to(device=device, dtype=dtype)


def groups(model: Tiny) -> list[dict]:
    """Two groups with their own lr, betas and weight decay: weights decayed, biases and the scale not."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": rest, "lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.0},
    ]


def batch(step: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 16, generator=g).to(device=device, dtype=dtype)
    t = torch.randn(8, 4, generator=g).to(device=device, dtype=dtype)
    return x, t


def run(in_backward: bool, dtype: torch.dtype, device: str = "cpu", steps: int = STEPS, **opt_kwargs):
    """(model, optimizer, gradient norm per step, whether every gradient was None after each backward)."""
    model = make_model(dtype, device)
    opt = FusedAdamW(groups(model), lr=1e-2, min_8bit_size=MIN_8BIT, **opt_kwargs)
    handle = step_in_backward(opt) if in_backward else None
    norms, freed = [], []
    for step in range(steps):
        x, t = batch(step, dtype, device)
        loss = (model(x) - t).float().square().mean()
        loss.backward()
        freed.append(all(p.grad is None for p in model.parameters()))
        if handle is not None:
            norms.append(handle.grad_norm())
            assert handle.stepped == len(list(model.parameters()))
            handle.reset_grad_norm()
        else:
            grads = [p.grad.float() for p in model.parameters()]
            norms.append(torch.nn.utils.get_total_norm(grads))
        opt.step()  # a no-op after the in-backward updates
        opt.zero_grad()
        for i, group in enumerate(opt.param_groups):  # an lr schedule: the next step's hooks must read it
            group["lr"] = group["lr"] * (0.5 if i == 0 else 0.7)
    if handle is not None:
        handle.remove()
    return model, opt, norms, freed


def assert_bit_equal(a_model, a_opt, b_model, b_opt) -> None:
    for (name, p), q in zip(a_model.named_parameters(), b_model.parameters(), strict=True):
        assert p.dtype == q.dtype
        assert torch.equal(p, q), f"parameter {name} differs"
        sa, sb = a_opt.state[p], b_opt.state[q]
        assert sa.keys() == sb.keys(), name
        for key in sa:
            assert torch.equal(sa[key], sb[key]), f"state {key} of {name} differs"
        assert float(sa["step"]) == STEPS  # stepped once per backward, not again by step()


CASES = [
    # (parameter dtype, state_dtype, bf16_stochastic_rounding)
    (torch.float32, None, False),
    (torch.float32, "float32", False),
    (torch.float32, "8bit", False),
    (torch.bfloat16, None, False),
    (torch.bfloat16, "float32", False),
    (torch.bfloat16, "8bit", False),
    (torch.bfloat16, None, True),
    (torch.bfloat16, "float32", True),
    (torch.bfloat16, "8bit", True),
]


@pytest.mark.parametrize(("dtype", "state_dtype", "sr"), CASES)
def test_equals_the_ordinary_loop(dtype, state_dtype, sr):
    kwargs = {"backend": "torch", "state_dtype": state_dtype, "bf16_stochastic_rounding": sr}
    ours_model, ours_opt, ours_norms, ours_freed = run(True, dtype, **kwargs)
    ref_model, ref_opt, ref_norms, ref_freed = run(False, dtype, **kwargs)
    assert_bit_equal(ours_model, ours_opt, ref_model, ref_opt)
    if state_dtype == "8bit":
        assert "exp_avg_codes" in ours_opt.state[ours_model.hidden.weight]  # the 8-bit layout was exercised
        assert "exp_avg" in ours_opt.state[ours_model.out.weight]  # below min_8bit_size
    assert all(ours_freed) and not any(ref_freed)
    for ours, ref in zip(ours_norms, ref_norms, strict=True):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, ref, rtol=2e-6, atol=0.0)


@pytest.mark.parametrize("state_dtype", [None, "8bit"])
def test_amsgrad_maximize_equal(state_dtype):
    kwargs = {"backend": "torch", "state_dtype": state_dtype, "amsgrad": True, "maximize": True}
    ours_model, ours_opt, _, _ = run(True, torch.float32, **kwargs)
    ref_model, ref_opt, _, _ = run(False, torch.float32, **kwargs)
    assert_bit_equal(ours_model, ours_opt, ref_model, ref_opt)


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton path needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)",
)
@pytest.mark.parametrize(
    ("dtype", "state_dtype", "sr"), [(torch.float32, None, False), (torch.bfloat16, "8bit", True)]
)
def test_triton_equals_the_ordinary_loop(monkeypatch, dtype, state_dtype, sr):
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    used = []
    original = FusedAdamW._torch_step
    monkeypatch.setattr(FusedAdamW, "_torch_step", lambda self, *a: used.append(1) or original(self, *a))
    kwargs = {"backend": "triton", "state_dtype": state_dtype, "bf16_stochastic_rounding": sr}
    ours_model, ours_opt, _, ours_freed = run(True, dtype, device, **kwargs)
    ref_model, ref_opt, _, _ = run(False, dtype, device, **kwargs)
    assert not used, "a parameter fell back to the torch backend"
    assert all(ours_freed)
    assert_bit_equal(ours_model, ours_opt, ref_model, ref_opt)


def test_grad_norm_accumulates_until_reset():
    model = make_model(torch.float32)
    opt = FusedAdamW(model.parameters(), backend="torch")
    with step_in_backward(opt) as handle:
        assert float(handle.grad_norm()) == 0.0
        expected = []
        for step in range(2):
            x, t = batch(step, torch.float32, "cpu")
            (model(x) - t).square().mean().backward()
            # the gradients are gone: the norm of step 0's is recomputed by an unstepped copy below
            expected.append(handle.grad_norm())
        ref = make_model(torch.float32)
        sq = 0.0
        x, t = batch(0, torch.float32, "cpu")
        (ref(x) - t).square().mean().backward()
        sq += float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])) ** 2
        assert float(expected[0]) == pytest.approx(sq**0.5, rel=1e-6)
        assert float(expected[1]) > float(expected[0])  # not reset between the two backwards: both summed
        handle.reset_grad_norm()
        assert float(handle.grad_norm()) == 0.0 and handle.stepped == 0


def test_grad_norm_is_summed_a_slice_at_a_time(monkeypatch):
    """The hooks square each gradient in slices of ``STAGE_ELEMENTS`` (a whole gradient widened to float64 would
    cost 8 bytes an element): with 7-element slices (the 32x32 weight: 146 slices, the last short) the norm is the
    float64 norm of all the gradients, computed whole."""
    from fasttrain.optim import _torch_step

    monkeypatch.setattr(_torch_step, "STAGE_ELEMENTS", 7)
    ref = make_model(torch.float32)
    x, t = batch(0, torch.float32, "cpu")
    (ref(x) - t).square().mean().backward()
    truth = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1).double() for p in ref.parameters()]))
    model = make_model(torch.float32)
    opt = FusedAdamW(model.parameters(), backend="torch")
    with step_in_backward(opt) as handle:
        (model(x) - t).square().mean().backward()
        # the handle reports the float64 sum as a float32 norm: one rounding
        assert float(handle.grad_norm()) == pytest.approx(float(truth), rel=2**-23)


def test_remove_hands_the_step_back():
    model = make_model(torch.float32)
    opt = FusedAdamW(model.parameters(), backend="torch")
    handle = step_in_backward(opt)
    handle.remove()
    x, t = batch(0, torch.float32, "cpu")
    (model(x) - t).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert not opt.state
    step_in_backward(opt).remove()  # a removed handle frees the optimizer for another registration


def test_frozen_parameters_are_skipped():
    model = make_model(torch.float32)
    model.inp.weight.requires_grad_(False)
    opt = FusedAdamW(model.parameters(), backend="torch")
    with step_in_backward(opt):
        x, t = batch(0, torch.float32, "cpu")
        (model(x) - t).square().mean().backward()
    assert model.inp.weight not in opt.state
    assert float(opt.state[model.hidden.weight]["step"]) == 1


# -- refusals ------------------------------------------------------------------------------------------------


def test_refuses_a_pending_deferred_clip():
    model = make_model(torch.float32)
    opt = FusedAdamW(model.parameters(), backend="torch")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.defer_clip_grad_norm_(1.0)
    opt.zero_grad()
    with pytest.raises(ValueError, match="defer_clip_grad_norm_"):
        step_in_backward(opt)


def test_refuses_a_clip_armed_after_registration():
    model = make_model(torch.float32)
    opt = FusedAdamW(model.parameters(), backend="torch")
    before = [p.detach().clone() for p in model.parameters()]
    with step_in_backward(opt):
        model.scale.grad = torch.ones_like(model.scale)
        opt.defer_clip_grad_norm_(1.0)
        model.scale.grad = None
        x, t = batch(0, torch.float32, "cpu")
        with pytest.raises(ValueError, match="defer_clip_grad_norm_"):
            (model(x) - t).square().mean().backward()
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, b)  # the first hook refused: nothing was stepped


def test_refuses_sparse_gradients():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = FusedAdamW(emb.parameters(), backend="torch")
    with step_in_backward(opt), pytest.raises(ValueError, match="sparse gradient"):
        emb(torch.tensor([1, 2])).sum().backward()


def test_refuses_a_non_leaf_parameter():
    leaf = nn.Parameter(torch.ones(3))
    opt = FusedAdamW([leaf], backend="torch")
    opt.param_groups[0]["params"].append(leaf * 2)  # the constructor refuses it; put in afterwards
    with pytest.raises(ValueError, match="not a leaf"):
        step_in_backward(opt)


def test_refuses_a_second_registration():
    opt = FusedAdamW([nn.Parameter(torch.ones(3))], backend="torch")
    with step_in_backward(opt), pytest.raises(ValueError, match="already steps in backward"):
        step_in_backward(opt)


def test_armed_gate_accumulates_until_armed():
    """Gradient accumulation: backwards while ``armed()`` is False only accumulate; the armed one steps on the
    summed gradient, bit for bit as accumulate-then-step."""
    results = []
    for in_backward in (True, False):
        model = make_model(torch.float32, "cpu")
        opt = FusedAdamW(groups(model), lr=1e-2, backend="torch")
        sync = [False]
        handle = step_in_backward(opt, armed=lambda sync=sync: sync[0]) if in_backward else None
        for step in range(4):
            sync[0] = step % 2 == 1
            x, t = batch(step, torch.float32, "cpu")
            ((model(x) - t).square().mean() / 2).backward()
            if in_backward:
                assert all((p.grad is None) == sync[0] for p in model.parameters())
            if sync[0]:
                opt.step()
                opt.zero_grad()
        if handle is not None:
            assert handle.updates == 2 * len(list(model.parameters()))
            handle.remove()
        results.append((model, opt))
    (a_model, a_opt), (b_model, b_opt) = results
    for (name, p), q in zip(a_model.named_parameters(), b_model.parameters(), strict=True):
        assert torch.equal(p, q), f"parameter {name} differs"
        assert float(a_opt.state[p]["step"]) == float(b_opt.state[q]["step"]) == 2
