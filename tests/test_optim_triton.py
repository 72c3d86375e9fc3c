"""FusedAdamW's Triton path (under TRITON_INTERPRET=1 on CPU) against torch.optim.AdamW; small shapes.

The chunk size is lowered so that small tensors still span several programs (tail chunks, the
per-tensor norm reduction over several partials) without the interpreter's cost of large tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

from _optim_reference import (
    SMALL_SHAPES,
    assert_bf16_close,
    assert_params_close,
    bf16_reference_run,
    clone_params,
    run_pair,
    set_grads,
    two_groups,
)
from _optim_reference import (
    make_params as _make_params,
)
from fasttrain import FusedAdamW

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton path needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)",
)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    from fasttrain.kernels import adamw as kernels

    monkeypatch.setattr(kernels, "CHUNK", 2048)
    monkeypatch.setattr(kernels, "BLOCK", 512)


# on a CUDA machine the kernel runs compiled on the GPU; here, interpreted on CPU tensors
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def make_params(shapes, dtype=torch.float32):
    return _make_params(shapes, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_fp32_matches_torch_adamw(clip):
    ours_p = make_params(SMALL_SHAPES)
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(two_groups(ours_p), lr=1e-2, backend="triton")
    ref = torch.optim.AdamW(two_groups(ref_p), lr=1e-2)
    norms = run_pair(ours, ref, ours_p, ref_p, steps=20, clip=clip, lr_change_at=9)
    for n_ours, n_ref in norms:
        torch.testing.assert_close(n_ours, n_ref, rtol=1e-6, atol=0)
    assert_params_close(ours_p, ref_p)
    for p, q in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(
            ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-9
        )


def test_amsgrad_maximize_tensor_lr():
    ours_p = make_params(SMALL_SHAPES[2:5])
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(ours_p, lr=torch.tensor(1e-2, device=DEVICE), amsgrad=True, maximize=True, backend="triton")
    ref = torch.optim.AdamW(ref_p, lr=1e-2, amsgrad=True, maximize=True)
    # shrinking gradients make max_exp_avg_sq differ from exp_avg_sq
    for step in range(8):
        set_grads([ours_p, ref_p], step, scale=0.5**step)
        ours.step()
        ref.step()
    assert_params_close(ours_p, ref_p)
    for p, q in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(
            ours.state[p]["max_exp_avg_sq"], ref.state[q]["max_exp_avg_sq"], rtol=1e-5, atol=0
        )


@pytest.mark.parametrize("clip", [None, 0.5])
def test_bf16_within_bf16_rounding(clip):
    ours_p = make_params(SMALL_SHAPES, dtype=torch.bfloat16)
    ref_p = [torch.nn.Parameter(p.detach().float()) for p in ours_p]
    ours = FusedAdamW(two_groups(ours_p), lr=1e-2, backend="triton")
    bf16_reference_run(ours, ours_p, ref_p, steps=12, clip=clip)
    assert_bf16_close(ours_p, ref_p, ulps=1 if clip is None else 2)


def test_same_parameters_as_torch_backend_bf16_clip():
    a = make_params(SMALL_SHAPES, dtype=torch.bfloat16)
    b = clone_params(a)
    oa = FusedAdamW(two_groups(a), lr=1e-2, backend="triton")
    ob = FusedAdamW(two_groups(b), lr=1e-2, backend="torch")
    for step in range(6):
        set_grads([a, b], step)
        torch.testing.assert_close(oa.defer_clip_grad_norm_(0.3), ob.defer_clip_grad_norm_(0.3), rtol=0, atol=0)
        oa.step()
        ob.step()
    # the torch backend rounds clipped gradients to bf16 (as torch's clip_grad_norm_ does), the kernel
    # keeps them in fp32: equal up to bf16 rounding steps
    assert_bf16_close(a, [p.float() for p in b], ulps=2)


def test_clip_does_not_rewrite_gradients():
    ps = make_params(SMALL_SHAPES)
    opt = FusedAdamW(ps, lr=1e-2, backend="triton")
    set_grads([ps], 0, scale=10.0)
    grads = [p.grad.clone() for p in ps]
    norm = opt.defer_clip_grad_norm_(1.0)
    assert float(norm) > 1.0
    for p, g in zip(ps, grads, strict=True):
        assert torch.equal(p.grad, g)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_norm_kernel_matches_torch(norm_type):
    # torch refuses the inf-norm of an empty tensor
    ps = make_params([*SMALL_SHAPES, (5000,)] + ([(0,)] if norm_type == 2.0 else []))
    ref = clone_params(ps)
    opt = FusedAdamW(ps, backend="triton")
    set_grads([ps, ref], 3)
    torch.testing.assert_close(
        opt.defer_clip_grad_norm_(1.0, norm_type),
        torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type),
        rtol=1e-6,
        atol=0,
    )


def test_nonfinite_norm_gives_nan_like_torch():
    ours_p = make_params(SMALL_SHAPES[1:4])
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(ours_p, lr=1e-2, backend="triton")
    ref = torch.optim.AdamW(ref_p, lr=1e-2)
    set_grads([ours_p, ref_p], 0)
    for ps in (ours_p, ref_p):
        ps[1].grad[3] = float("nan")
    assert torch.isnan(ours.defer_clip_grad_norm_(1.0))
    torch.nn.utils.clip_grad_norm_(ref_p, 1.0)
    ours.step()
    ref.step()
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), equal_nan=True)


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
def test_grad_scaler_inf_step_skipped_without_sync(param_dtype, monkeypatch):
    ours_p = make_params(SMALL_SHAPES[:4], dtype=param_dtype)
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(ours_p, lr=1e-3, backend="triton")
    ref = FusedAdamW(ref_p, lr=1e-3, backend="torch")
    scaler = torch.amp.GradScaler(DEVICE, init_scale=256.0)
    ref_scaler = torch.amp.GradScaler(DEVICE, init_scale=256.0)
    for s in (scaler, ref_scaler):
        s.scale(torch.ones(()))
    for step in range(4):
        set_grads([ours_p, ref_p], step, scale=256.0)
        if step == 2:
            ours_p[2].grad[7] = float("inf")
            ref_p[2].grad[7] = float("inf")
            before = [p.detach().clone() for p in ours_p]
            states = [{k: v.clone() for k, v in ours.state[p].items()} for p in ours_p]
            # the Triton path must not read device values on the host while stepping
            monkeypatch.setattr(torch.Tensor, "item", _no_host_sync)
        scaler.step(ours)
        monkeypatch.undo()
        ref_scaler.step(ref)
        scaler.update()
        ref_scaler.update()
        if step == 2:
            for p, b, st in zip(ours_p, before, states, strict=True):
                assert torch.equal(p.detach(), b)
                for k, v in st.items():
                    assert torch.equal(ours.state[p][k], v), k
    assert float(ours.state[ours_p[0]]["step"]) == 3
    for a, b in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(a.detach().float(), b.detach().float(), rtol=2**-7, atol=1e-3)


def _no_host_sync(self):
    raise AssertionError("host sync (.item()) inside the Triton step")


def test_state_dict_round_trip_with_torch_adamw():
    a = make_params(SMALL_SHAPES)
    b = clone_params(a)
    ours = FusedAdamW(two_groups(a), lr=1e-2, backend="triton")
    for step in range(3):
        set_grads([a], step)
        ours.step()
    with torch.no_grad():
        for p, q in zip(b, a, strict=True):
            p.copy_(q)
    ref = torch.optim.AdamW(two_groups(b), lr=1e-2)
    ref.load_state_dict(ours.state_dict())
    back = FusedAdamW(two_groups(a), lr=1e-2, backend="triton")
    back.load_state_dict(ref.state_dict())
    for step in range(3, 6):
        set_grads([a, b], step)
        back.step()
        ref.step()
    assert_params_close(a, b)


def test_noncontiguous_parameter_falls_back_to_torch():
    base = torch.randn(20, 30, device=DEVICE)
    p = torch.nn.Parameter(base.t())  # non-contiguous
    q = torch.nn.Parameter(p.detach().clone())
    ours = FusedAdamW([p], lr=1e-2, backend="triton")
    ref = torch.optim.AdamW([q], lr=1e-2)
    for step in range(3):
        set_grads([[p], [q]], step)
        p.grad = p.grad.t().contiguous().t()
        ours.step()
        ref.step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_launch_covers_all_tensors_of_a_group(monkeypatch):
    from fasttrain.kernels import adamw as kernels

    calls = []
    real = kernels.adamw_step

    def counting(table, *args, **kwargs):
        calls.append(table.n_tensors)
        return real(table, *args, **kwargs)

    monkeypatch.setattr(kernels, "adamw_step", counting)
    ps = make_params(SMALL_SHAPES)
    opt = FusedAdamW(two_groups(ps), backend="triton")
    set_grads([ps], 0)
    opt.step()
    assert calls == [3, 3]  # one launch per group, not one per tensor
