"""FusedAdamW (torch backend, larger shapes) against torch.optim.AdamW and clip_grad_norm_ + AdamW."""

from __future__ import annotations

import logging

import pytest
import torch

from _optim_reference import (
    LARGE_SHAPES,
    assert_bf16_close,
    assert_params_close,
    bf16_reference_run,
    clone_params,
    make_params,
    run_pair,
    set_grads,
    two_groups,
)
from fasttrain import FusedAdamW


@pytest.mark.parametrize("clip", [None, 1.0, 1e6])
@pytest.mark.parametrize(("amsgrad", "maximize"), [(False, False), (True, True)])
def test_fp32_matches_torch_adamw(clip, amsgrad, maximize):
    ours_p = make_params(LARGE_SHAPES)
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(two_groups(ours_p), lr=1e-2, amsgrad=amsgrad, maximize=maximize, backend="torch")
    ref = torch.optim.AdamW(two_groups(ref_p), lr=1e-2, amsgrad=amsgrad, maximize=maximize)
    norms = run_pair(ours, ref, ours_p, ref_p, steps=22, clip=clip)
    for n_ours, n_ref in norms:
        torch.testing.assert_close(n_ours, n_ref, rtol=1e-6, atol=0)
    assert_params_close(ours_p, ref_p)
    for p, q in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(ours.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=1e-5, atol=1e-7)
        assert float(ours.state[p]["step"]) == float(ref.state[q]["step"]) == 22


@pytest.mark.parametrize("clip", [None, 0.5])
def test_bf16_within_bf16_rounding(clip):
    ours_p = make_params(LARGE_SHAPES, dtype=torch.bfloat16)
    ref_p = [torch.nn.Parameter(p.detach().float()) for p in ours_p]
    ours = FusedAdamW(two_groups(ours_p), lr=1e-2, backend="torch")
    bf16_reference_run(ours, ours_p, ref_p, steps=20, clip=clip)
    assert all(p.dtype == torch.bfloat16 for p in ours_p)
    assert all(ours.state[p]["exp_avg"].dtype == torch.float32 for p in ours_p)
    # with clipping the reference rounds the clipped bf16 gradients, we do not: a parameter can land
    # one rounding step away at some step, and over 20 steps x 280K elements a few such steps add up
    assert_bf16_close(ours_p, ref_p, ulps=1 if clip is None else 4)
    if clip is not None:
        a = torch.cat([p.detach().float().reshape(-1) for p in ours_p])
        b = torch.cat([p.detach().float().reshape(-1) for p in ref_p])
        within_one = (a - b).abs() <= torch.maximum(a.abs(), b.abs()) * 2.0**-7
        assert within_one.float().mean() > 0.99  # measured: 99.7%


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
def test_clip_norm_value_and_result(norm_type):
    ours_p = make_params(LARGE_SHAPES)
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(ours_p, lr=1e-2, backend="torch")
    ref = torch.optim.AdamW(ref_p, lr=1e-2)
    for step in range(3):
        set_grads([ours_p, ref_p], step)
        n_ours = ours.defer_clip_grad_norm_(0.7, norm_type=norm_type)
        n_ref = torch.nn.utils.clip_grad_norm_(ref_p, 0.7, norm_type=norm_type)
        assert n_ours.shape == () and n_ours.device == n_ref.device
        torch.testing.assert_close(n_ours, n_ref, rtol=1e-6, atol=0)
        ours.step()
        ref.step()
    assert_params_close(ours_p, ref_p)


def test_nonfinite_norm_gives_what_torch_gives():
    ours_p = make_params(LARGE_SHAPES[:4])
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(ours_p, lr=1e-2, backend="torch")
    ref = torch.optim.AdamW(ref_p, lr=1e-2)
    set_grads([ours_p, ref_p], 0)
    for ps in (ours_p, ref_p):
        ps[2].grad[5] = float("inf")
    n_ours = ours.defer_clip_grad_norm_(1.0)
    n_ref = torch.nn.utils.clip_grad_norm_(ref_p, 1.0)
    assert torch.isinf(n_ours) and torch.isinf(n_ref)
    ours.step()
    ref.step()
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6, equal_nan=True)
    assert torch.isnan(ours_p[2]).any()


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_cross_loading(direction, dtype):
    shapes = LARGE_SHAPES[:6]
    p_a = make_params(shapes, dtype=dtype)
    p_b = clone_params(p_a)
    p_c = clone_params(p_a)
    make_ours = lambda ps: FusedAdamW(two_groups(ps), lr=1e-2, backend="torch")  # noqa: E731
    make_torch = lambda ps: torch.optim.AdamW(two_groups(ps), lr=1e-2)  # noqa: E731
    first, second = (make_torch, make_ours) if direction == "torch_to_ours" else (make_ours, make_torch)
    opt_a = first(p_a)
    for step in range(5):
        set_grads([p_a], step)
        opt_a.step()
    sd = opt_a.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    # the loaded optimizer continues exactly as the one that saved
    with torch.no_grad():
        for b, c, a in zip(p_b, p_c, p_a, strict=True):
            b.copy_(a)
            c.copy_(a)
    opt_b = second(p_b)
    opt_b.load_state_dict(sd)
    opt_c = first(p_c)
    opt_c.load_state_dict(sd)
    if isinstance(opt_b, FusedAdamW):
        assert all(s["exp_avg"].dtype == torch.float32 for s in opt_b.state.values())
    # the loaded moments are the saved ones (cast to the loader's state dtype)
    for p, q in zip(p_b, p_a, strict=True):
        saved = opt_a.state[q]["exp_avg_sq"]
        loaded = opt_b.state[p]["exp_avg_sq"]
        assert torch.equal(loaded, saved.to(loaded.dtype))
    for step in range(5, 10):
        set_grads([p_b, p_c], step)
        opt_b.step()
        opt_c.step()
    if dtype == torch.float32:
        assert_params_close(p_b, p_c)
    else:
        # torch.optim.AdamW keeps bf16 moments and does its math in bf16, ours fp32: after 5 more steps
        # the two agree only to a few bf16 ulps (exactness in bf16 is tested against an fp32 emulation)
        for b, c in zip(p_b, p_c, strict=True):
            torch.testing.assert_close(b.float(), c.float(), rtol=2**-4, atol=0.1)
    assert float(opt_b.state[p_b[0]]["step"]) == 10


def test_fp32_state_survives_own_round_trip():
    ps = make_params(LARGE_SHAPES[:4], dtype=torch.bfloat16)
    opt = FusedAdamW(ps, lr=1e-2, backend="torch")
    set_grads([ps], 0)
    opt.step()
    before = {i: s["exp_avg"].clone() for i, s in enumerate(opt.state.values())}
    opt.load_state_dict(opt.state_dict())
    for i, s in enumerate(opt.state.values()):
        assert s["exp_avg"].dtype == torch.float32
        assert torch.equal(s["exp_avg"], before[i])  # not rounded through bf16


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float16])
def test_grad_scaler_unscales_and_skips_inf_step(param_dtype):
    ours_p = make_params(LARGE_SHAPES[:5], dtype=param_dtype)
    ref_p = [torch.nn.Parameter(p.detach().float()) for p in ours_p]
    ours = FusedAdamW(ours_p, lr=1e-3, backend="torch")
    ref = torch.optim.AdamW(ref_p, lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    scaler.scale(torch.ones(()))  # creates the scale, as scaling the loss would
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        for p, q in zip(ours_p, ref_p, strict=True):
            grad = torch.randn(p.shape, generator=g)
            q.grad = grad.to(param_dtype).float()
            p.grad = (grad.to(param_dtype).float() * scaler.get_scale()).to(param_dtype)
        if step == 3:
            ours_p[1].grad.view(-1)[0] = float("inf")
            snapshot = [p.detach().clone() for p in ours_p]
            states = [{k: v.clone() for k, v in ours.state[p].items()} for p in ours_p]
        scaler.step(ours)
        scaler.update()
        if step == 3:
            assert scaler.get_scale() == 512.0  # the inf was seen
            for p, before, st in zip(ours_p, snapshot, states, strict=True):
                assert torch.equal(p.detach(), before)
                for k, v in st.items():
                    assert torch.equal(ours.state[p][k], v), k
            continue
        ref.step()
        with torch.no_grad():
            for q in ref_p:
                q.copy_(q.to(param_dtype).float())
    for p, q in zip(ours_p, ref_p, strict=True):
        tol = 1e-6 if param_dtype == torch.float32 else 2**-10
        torch.testing.assert_close(p.detach().float(), q.detach(), rtol=tol, atol=tol)
    assert float(ours.state[ours_p[0]]["step"]) == 5


def test_params_without_grad_are_skipped_and_lazy_state():
    ps = make_params(LARGE_SHAPES[:4])
    opt = FusedAdamW(ps, lr=1e-2, backend="torch")
    assert len(opt.state) == 0
    set_grads([ps], 0)
    ps[1].grad = None
    before = ps[1].detach().clone()
    opt.step()
    assert torch.equal(ps[1].detach(), before)
    assert ps[1] not in opt.state and ps[0] in opt.state


def test_tensor_lr_equals_float_lr():
    a = make_params(LARGE_SHAPES[:5])
    b = clone_params(a)
    oa = FusedAdamW(a, lr=torch.tensor(3e-3), backend="torch")
    ob = FusedAdamW(b, lr=3e-3, backend="torch")
    for step in range(4):
        set_grads([a, b], step)
        oa.step()
        ob.step()
    assert_params_close(a, b)  # torch computes with a tensor lr in fp32, with a float in fp64


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "learning rate"),
        ({"eps": -1e-8}, "eps"),
        ({"betas": (1.0, 0.999)}, "beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, "beta parameter at index 1"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"backend": "cuda"}, "backend"),
        ({"capturable": True}, "capturable"),
        ({"differentiable": True}, "differentiable"),
        ({"lr": torch.tensor([1e-3, 1e-3])}, "one element"),
    ],
)
def test_invalid_hyperparameters_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedAdamW(make_params([(3,)]), **kwargs)


def test_invalid_group_hyperparameters_refused():
    ps = make_params([(3,), (4,)])
    with pytest.raises(ValueError, match="param group 1: invalid learning rate"):
        FusedAdamW([{"params": ps[:1]}, {"params": ps[1:], "lr": -1.0}])


def test_sparse_gradients_refused():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = FusedAdamW(emb.parameters(), backend="torch")
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    with pytest.raises(ValueError, match="sparse"):
        opt.defer_clip_grad_norm_(1.0)


def test_auto_backend_on_cpu_uses_torch_and_logs(caplog):
    ps = make_params(LARGE_SHAPES[:3])
    ref_p = clone_params(ps)
    opt = FusedAdamW(ps, lr=1e-2)
    ref = torch.optim.AdamW(ref_p, lr=1e-2)
    from fasttrain import _logging

    _logging._said.discard("fused_adamw.auto.cpu")
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        run_pair(opt, ref, ps, ref_p, steps=3, clip=1.0)
    assert "using torch's fused AdamW" in caplog.text
    assert_params_close(ps, ref_p)


def test_accelerate_wrapped_optimizer():
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ref_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ref_model.load_state_dict(model.state_dict())
    accelerator = accelerate.Accelerator(cpu=True)
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    x = torch.randn(8, 16)
    for _ in range(5):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
        norm = opt.optimizer.defer_clip_grad_norm_(0.1)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.1)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        opt.step()
        ref.step()
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert float(opt.optimizer.state[next(model.parameters())]["step"]) == 5
