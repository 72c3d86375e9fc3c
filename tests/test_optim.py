"""FusedAdamW (torch backend, larger shapes) against torch.optim.AdamW and clip_grad_norm_ + AdamW, in every mode.

Bounds come from the truth (tests/_truth_ops.py): torch's AdamW in float64 on the same start values and the same
gradients. Per tensor, ours may be at most ``k`` times as far from it as torch's AdamW in our dtype, plus a floor
of a rounding step of the parameter's dtype. A missing weight decay (0.1% of the parameter per step, 10% of an
update) or a wrong bias correction moves a parameter by far more than its dtype's roundings.
"""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch

from _optim_reference import (
    LARGE_SHAPES,
    assert_tracks_truth,
    clone_params,
    copy_grads_to_truth,
    make_params,
    quadratic_run,
    run_pair,
    set_grads,
    snapshot,
    state_bytes,
    truth_adamw,
    two_groups,
)
from _truth_ops import assert_truth, distance, magnitude
from fasttrain import FusedAdamW
from fasttrain.optim import blockwise8

pytestmark = [pytest.mark.cuda, pytest.mark.numeric]

LOW = (torch.bfloat16, torch.float16)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CLIP = 200.0  # the gradients' norm is ~537: clipping is active, and the clipped gradients stay above fp16's subnormals


# The same fp32 arithmetic, rounded once per stored value like torch's: twice torch's distance to the truth, plus
# one rounding step of the parameter's dtype (a tensor of one element, rounded the other way once).
TRACK = {"k": 2.0, "ulps": 1.0}
# Gradient norms: fp32 sums of ~10^5 squares in another order (a few fp32 ulps), then rounded to the gradients'
# dtype like torch's (one rounding step of a bf16/fp16 norm).
NORM_FP32 = {"k": 2.0, "ulps": 4.0, "dtype": torch.float32}


def norm_bound(dtype):
    return NORM_FP32 if dtype == torch.float32 else {"k": 2.0, "ulps": 1.0, "dtype": dtype}


def assert_norms(norms, dtype):
    for step, (n_ours, n_ref, n_truth) in enumerate(norms):
        assert n_ours.shape == () and n_ours.dtype == n_ref.dtype
        assert_truth(n_ours, n_ref, n_truth, **norm_bound(dtype), what=f"norm at step {step}")


# -- default mode = the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clip", [None, CLIP])
@pytest.mark.parametrize(("amsgrad", "maximize"), [(False, False), (True, True)])
def test_default_matches_torch_fused(dtype, clip, amsgrad, maximize):
    ours_p = make_params(LARGE_SHAPES, dtype=dtype)
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(two_groups(ours_p), lr=1e-2, amsgrad=amsgrad, maximize=maximize, backend="torch")
    ref = torch.optim.AdamW(two_groups(ref_p), lr=1e-2, amsgrad=amsgrad, maximize=maximize, fused=True)
    truth = truth_adamw(ours_p, two_groups, lr=1e-2, amsgrad=amsgrad, maximize=maximize)
    norms = run_pair(ours, ref, ours_p, ref_p, steps=12, clip=clip, lr_change_at=6, truth=truth)
    assert_norms(norms, dtype)
    if clip is None:
        # without a clip, the torch backend of the default mode is torch's own kernel call on the same tensors
        for a, b in zip(ours_p, ref_p, strict=True):
            assert torch.equal(a, b)
    assert_tracks_truth(ours_p, ref_p, truth[1], **TRACK)
    # same state, same memory: the keys, dtypes and shapes of torch's, and the moments track torch's
    sd_ours, sd_ref = ours.state_dict()["state"], ref.state_dict()["state"]
    for i in sd_ref:
        assert sd_ours[i].keys() == sd_ref[i].keys()
        for key, value in sd_ref[i].items():
            assert (sd_ours[i][key].dtype, sd_ours[i][key].shape) == (value.dtype, value.shape), key
        assert float(sd_ours[i]["step"]) == float(sd_ref[i]["step"]) == 12
    assert state_bytes(ours) == state_bytes(ref)
    assert_tracks_truth(
        [ours.state[p]["exp_avg"] for p in ours_p], [ref.state[q]["exp_avg"] for q in ref_p],
        [truth[0].state[t]["exp_avg"] for t in truth[1]], **TRACK, what="exp_avg",
    )  # fmt: skip


@pytest.mark.parametrize("clip", [None, CLIP])
def test_default_fp32_matches_torch_foreach(clip):
    # for bf16/fp16 parameters torch's foreach path computes in the parameter's dtype, its fused path in fp32:
    # the default mode is the fused one (tested above)
    ours_p = make_params(LARGE_SHAPES)
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(two_groups(ours_p), lr=1e-2, amsgrad=True, backend="torch")
    ref = torch.optim.AdamW(two_groups(ref_p), lr=1e-2, amsgrad=True, foreach=True)
    truth = truth_adamw(ours_p, two_groups, lr=1e-2, amsgrad=True)
    norms = run_pair(ours, ref, ours_p, ref_p, steps=12, clip=clip, lr_change_at=6, truth=truth)
    assert_norms(norms, torch.float32)
    assert_tracks_truth(ours_p, ref_p, truth[1], **TRACK)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float16])
def test_grad_scaler_matches_torch_and_skips_inf_step(param_dtype):
    ours_p = make_params(LARGE_SHAPES[:6], dtype=param_dtype)
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(ours_p, lr=1e-3, backend="torch")
    ref = torch.optim.AdamW(ref_p, lr=1e-3, fused=True)
    truth, truth_p = truth_adamw(ours_p, lr=1e-3)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000) for _ in range(2)]
    for s in scalers:
        s.scale(torch.ones(()))  # creates the scale, as scaling the loss would
    for step in range(6):
        set_grads([ours_p, ref_p], step, scale=1024.0)
        if step != 3:  # the truth skips the step the inf is in, and unscales by the same power of two
            copy_grads_to_truth(ours_p, truth_p, divide=scalers[0].get_scale())
            truth.step()
        if step == 3:
            for ps in (ours_p, ref_p):
                ps[3].grad.view(-1)[0] = float("inf")
            before = snapshot(ours_p)
            states = [{k: v.clone() for k, v in ours.state[p].items()} for p in ours_p]
        for opt, scaler in zip((ours, ref), scalers, strict=True):
            scaler.step(opt)
            scaler.update()
        if step == 3:
            assert scalers[0].get_scale() == 512.0  # the inf was seen
            for p, b, st in zip(ours_p, before, states, strict=True):
                assert torch.equal(p.detach(), b)
                for k, v in st.items():
                    assert torch.equal(ours.state[p][k], v), k
    assert_tracks_truth(ours_p, ref_p, truth_p, **TRACK)
    assert float(ours.state[ours_p[0]]["step"]) == 5


def test_tensor_lr_equals_float_lr():
    a = make_params(LARGE_SHAPES[:5])
    b = clone_params(a)
    oa = FusedAdamW(a, lr=torch.tensor(3e-3), backend="torch")
    ob = FusedAdamW(b, lr=3e-3, backend="torch")
    truth = truth_adamw(a, lr=3e-3)
    run_pair(oa, ob, a, b, steps=4, truth=truth)
    # torch computes with a tensor lr in fp32, with a float in fp64: the tensor lr's rounding is the difference
    assert_tracks_truth(a, b, truth[1], **TRACK)


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
def test_clip_norm_value_and_result(norm_type):
    ours_p = make_params(LARGE_SHAPES)
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(ours_p, lr=1e-2, backend="torch")
    ref = torch.optim.AdamW(ref_p, lr=1e-2, fused=True)
    truth, truth_p = truth_adamw(ours_p, lr=1e-2)
    for step in range(3):
        set_grads([ours_p, ref_p], step)
        copy_grads_to_truth(ours_p, truth_p)
        n_ours = ours.defer_clip_grad_norm_(0.7, norm_type=norm_type)
        n_ref = torch.nn.utils.clip_grad_norm_(ref_p, 0.7, norm_type=norm_type)
        n_truth = torch.nn.utils.clip_grad_norm_(truth_p, 0.7, norm_type=norm_type)
        assert n_ours.shape == () and n_ours.device == n_ref.device
        assert_truth(n_ours, n_ref, n_truth, **NORM_FP32, what=f"norm at step {step}")
        for opt in (ours, ref, truth):
            opt.step()
    assert ours.deferred_clips_applied == 3
    assert_tracks_truth(ours_p, ref_p, truth_p, **TRACK)


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
        assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.isnan(ours_p[2]).any()


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_cross_loading_with_torch(direction, dtype):
    shapes = LARGE_SHAPES[:6]
    p_a = make_params(shapes, dtype=dtype)
    p_b = clone_params(p_a)
    p_c = clone_params(p_a)
    make_ours = lambda ps: FusedAdamW(two_groups(ps), lr=1e-2, backend="torch")  # noqa: E731
    make_torch = lambda ps: torch.optim.AdamW(two_groups(ps), lr=1e-2, fused=True)  # noqa: E731
    first, second = (make_torch, make_ours) if direction == "torch_to_ours" else (make_ours, make_torch)
    opt_a = first(p_a)
    for step in range(5):
        set_grads([p_a], step)
        opt_a.step()
    sd = opt_a.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    # the loaded optimizer continues exactly as the one that saved: the default mode keeps torch's state as is
    with torch.no_grad():
        for b, c, a in zip(p_b, p_c, p_a, strict=True):
            b.copy_(a)
            c.copy_(a)
    opt_b = second(p_b)
    opt_b.load_state_dict(sd)
    opt_c = first(p_c)
    opt_c.load_state_dict(sd)
    for step in range(5, 10):
        set_grads([p_b, p_c], step)
        opt_b.step()
        opt_c.step()
    for b, c in zip(p_b, p_c, strict=True):
        assert torch.equal(b, c)
    assert float(opt_b.state[p_b[0]]["step"]) == 10


def test_float32_state_survives_own_round_trip():
    ps = make_params(LARGE_SHAPES[:4], dtype=torch.bfloat16)
    opt = FusedAdamW(ps, lr=1e-2, backend="torch", state_dtype=torch.float32)
    set_grads([ps], 0)
    opt.step()
    before = {i: s["exp_avg"].clone() for i, s in enumerate(opt.state.values())}
    opt.load_state_dict(opt.state_dict())
    for i, s in enumerate(opt.state.values()):
        assert s["exp_avg"].dtype == torch.float32
        assert torch.equal(s["exp_avg"], before[i])  # not rounded through bf16


# -- state_dtype=float32 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [None, 0.5])
def test_float32_states_for_bf16_params_equal_fp32_math_rounded(clip):
    """bf16 parameters with fp32 moments: torch's fused AdamW on fp32 copies, each result rounded to bf16."""
    ours_p = make_params(LARGE_SHAPES, dtype=torch.bfloat16)
    ref_p = [torch.nn.Parameter(p.detach().float()) for p in ours_p]
    ours = FusedAdamW(two_groups(ours_p), lr=1e-2, backend="torch", state_dtype=torch.float32)
    ref = torch.optim.AdamW(two_groups(ref_p), lr=1e-2, fused=True)
    truth, truth_p = truth_adamw(ours_p, two_groups, lr=1e-2)
    for step in range(8):
        set_grads([ours_p], step)
        copy_grads_to_truth(ours_p, truth_p)
        for q, p in zip(ref_p, ours_p, strict=True):
            q.grad = p.grad.float()
        if clip is not None:
            ours.defer_clip_grad_norm_(clip)
            torch.nn.utils.clip_grad_norm_(ref_p, clip)
            torch.nn.utils.clip_grad_norm_(truth_p, clip)
        for opt in (ours, ref, truth):
            opt.step()
        with torch.no_grad():
            for q in ref_p:
                q.copy_(q.bfloat16().float())
    for p, q in zip(ours_p, ref_p, strict=True):
        assert ours.state[p]["exp_avg"].dtype == torch.float32
        if clip is None:
            assert torch.equal(p.float(), q)  # the same fp32 kernel on the same values, one rounding
    assert_tracks_truth(ours_p, [q.bfloat16() for q in ref_p], truth_p, **TRACK)
    assert state_bytes(ours) == 8 * sum(p.numel() for p in ours_p)


# -- state_dtype="8bit" ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_8bit_tracks_fp32_states(dtype, amsgrad):
    a = make_params(LARGE_SHAPES, dtype=dtype)
    b = clone_params(a)
    start = snapshot(a)
    oa = FusedAdamW(two_groups(a), lr=1e-2, amsgrad=amsgrad, backend="torch", state_dtype="8bit")
    ob = FusedAdamW(two_groups(b), lr=1e-2, amsgrad=amsgrad, backend="torch", state_dtype=torch.float32)
    truth, truth_p = truth_adamw(a, two_groups, lr=1e-2, amsgrad=amsgrad)
    for step in range(20):
        set_grads([a, b], step, scale=1 + 0.5 * (step % 3))
        copy_grads_to_truth(a, truth_p)
        oa.defer_clip_grad_norm_(CLIP)
        ob.defer_clip_grad_norm_(CLIP)
        torch.nn.utils.clip_grad_norm_(truth_p, CLIP)
        for opt in (oa, ob, truth):
            opt.step()
    big = [i for i, p in enumerate(a) if p.numel() >= 4096]
    small = [i for i, p in enumerate(a) if p.numel() < 4096]
    # The reference is the fp32-moment mode (the same step on unquantized moments). On top of its distance to the
    # truth, 8-bit moments may cost what the format allows: each step requantizes m to within half a gap of its
    # map and rounds v up by at most a whole gap of its own (relative, in a block's top decade), so an update
    # m / sqrt(v) is off by at most half_gap(m) + gap(v) / 2 of itself; at worst those add up over the steps.
    tables = blockwise8.tables(torch.device("cpu"))
    share = _half_gap(tables[blockwise8.SIGNED]) + _half_gap(tables[blockwise8.UNSIGNED])
    for i in big:
        d_ours, d_ref = distance(a[i], truth_p[i]), distance(b[i], truth_p[i])
        update = distance(truth_p[i], start[i])
        allowed = 2.0 * d_ref + share * update + torch.finfo(dtype).eps * magnitude(truth_p[i])
        assert d_ours <= allowed, (i, d_ours, d_ref, share, update)
    for i in small:  # below min_8bit_size: fp32 moments, the same computation
        assert torch.equal(a[i], b[i])
        assert oa.state[a[i]]["exp_avg"].dtype == torch.float32
    for i in big:
        state = oa.state[a[i]]
        assert "exp_avg" not in state and state["exp_avg_codes"].dtype == torch.uint8
        assert state["exp_avg_codes"].shape == a[i].shape
        assert state["exp_avg_sq_absmax"].shape == ((a[i].numel() + 255) // 256,)
        assert ("max_exp_avg_sq_codes" in state) == amsgrad
    assert oa.deferred_clips_applied == 20
    # 2 bytes + 8 per 256 elements for the quantized tensors, 8 bytes for the small ones
    assert state_bytes(oa) <= 0.3 * state_bytes(ob)


def _half_gap(dynamic_map) -> float:
    """Half the largest relative gap between neighbouring entries of a dynamic map in its top decade."""
    entries = dynamic_map.double().abs().unique()
    top = entries[entries >= 0.1]
    return float(((top[1:] - top[:-1]) / top[1:]).max()) / 2


def test_8bit_second_moment_never_rounds_to_zero():
    """The zero-point problem: in a block whose absmax is one large second moment, a small element's v rounded to
    nearest becomes 0 and its update m / (sqrt(0) + eps) is orders of magnitude too large. Rounded up (blockwise8),
    no element of the 8-bit step moves more than the fp32-moment step moves it (up to the first moment's half gap
    and fp32 rounding), and the small ones still move."""
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(3, 4096, generator=g) * 1e-5
    grads[:, ::256] = 1e3  # one large gradient per block of 256: the block's absmax
    moved = {}
    for state_dtype in ("8bit", torch.float32):
        p = torch.nn.Parameter(torch.zeros(4096))
        opt = FusedAdamW([p], lr=1e-3, weight_decay=0.0, backend="torch", state_dtype=state_dtype)
        for grad in grads:
            before = p.detach().clone()
            p.grad = grad.clone()
            opt.step()
        moved[state_dtype] = (p.detach() - before).abs()
    signed_gap = _half_gap(blockwise8.tables(torch.device("cpu"))[blockwise8.SIGNED])
    allowed = moved[torch.float32] * (1 + 2 * signed_gap) + 1e-3 * torch.finfo(torch.float32).eps
    assert (moved["8bit"] <= allowed).all(), float((moved["8bit"] / allowed).max())
    small = torch.ones(4096, dtype=torch.bool)
    small[::256] = False
    # not merely frozen: most small elements still step
    assert (moved["8bit"][small] > 0).float().mean() > 0.5


def test_8bit_threshold():
    ps = make_params([(4096,), (4095,), (64, 64)])
    opt = FusedAdamW(ps, backend="torch", state_dtype="8bit")
    set_grads([ps], 0)
    opt.step()
    assert ["exp_avg_codes" in opt.state[p] for p in ps] == [True, False, True]
    opt = FusedAdamW(ps, backend="torch", state_dtype="8bit", min_8bit_size=5000)
    opt.step()
    assert all("exp_avg" in opt.state[p] for p in ps)


@pytest.mark.parametrize(
    ("state_dtype", "sr", "dtype"),
    [("8bit", False, torch.float32), ("8bit", True, torch.bfloat16), (None, True, torch.bfloat16),
     (torch.float32, True, torch.bfloat16)],
)  # fmt: skip
def test_state_dict_resumes_bit_exactly(state_dtype, sr, dtype):
    make = lambda ps: FusedAdamW(  # noqa: E731
        two_groups(ps), lr=1e-2, amsgrad=True, backend="torch", state_dtype=state_dtype,
        bf16_stochastic_rounding=sr, min_8bit_size=1000,
    )  # fmt: skip
    a = make_params(LARGE_SHAPES[:7], dtype=dtype)
    oa = make(a)
    for step in range(3):
        set_grads([a], step)
        oa.step()
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    buf.seek(0)
    b = clone_params(a)
    ob = make(b)
    ob.load_state_dict(torch.load(buf, weights_only=True))
    for step in range(3, 6):
        set_grads([a, b], step)
        oa.defer_clip_grad_norm_(CLIP)
        ob.defer_clip_grad_norm_(CLIP)
        oa.step()
        ob.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
        assert oa.state[p].keys() == ob.state[q].keys()
        for key, value in oa.state[p].items():
            assert value.dtype == ob.state[q][key].dtype and torch.equal(value, ob.state[q][key]), key


def test_8bit_skipped_step_leaves_codes():
    ps = make_params([(5000,), (3,)])
    opt = FusedAdamW(ps, lr=1e-2, backend="torch", state_dtype="8bit")
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    set_grads([ps], 0, scale=8.0)
    scaler.step(opt)
    scaler.update()
    before = [{k: v.clone() for k, v in opt.state[p].items()} for p in ps]
    params = snapshot(ps)
    set_grads([ps], 1, scale=8.0)
    ps[0].grad[0] = float("nan")
    scaler.step(opt)
    for p, b, st in zip(ps, params, before, strict=True):
        assert torch.equal(p, b)
        for k, v in st.items():
            assert torch.equal(opt.state[p][k], v), k


# -- stochastic rounding ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state_dtype", [None, "8bit"])
def test_stochastic_rounding_tracks_fp32(state_dtype):
    steps = 100
    truth, _ = quadratic_run(torch.float64, steps, "torch")
    ref, _ = quadratic_run(torch.float32, steps, "torch")
    kwargs = {"state_dtype": state_dtype, "min_8bit_size": 1024}
    nearest, _ = quadratic_run(torch.bfloat16, steps, "torch", **kwargs)
    sr, _ = quadratic_run(torch.bfloat16, steps, "torch", bf16_stochastic_rounding=True, **kwargs)
    # Each stochastic rounding adds an unbiased error of variance at most (bf16 step)**2 / 4 to an element: over
    # the steps they add up like a random walk, to at most sqrt(steps / 4) bf16 steps in root mean square.
    walk = (steps / 4) ** 0.5 * torch.finfo(torch.bfloat16).eps * magnitude(truth)
    allowed = 2.0 * distance(ref, truth) + walk
    assert distance(sr, truth) <= allowed, (distance(sr, truth), allowed)
    # updates below half a bf16 step: nearest rounding loses (nearly) all, and the bound above tells it apart
    assert distance(nearest, truth) > allowed, (distance(nearest, truth), allowed)


def test_stochastic_rounding_only_touches_bf16():
    a = make_params(LARGE_SHAPES[:5])
    b = clone_params(a)
    oa = FusedAdamW(a, lr=1e-2, backend="torch", bf16_stochastic_rounding=True)
    ob = FusedAdamW(b, lr=1e-2, backend="torch")
    for step in range(3):
        set_grads([a, b], step)
        oa.step()
        ob.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)


# -- bad input ---------------------------------------------------------------------------------------------------


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
        ({"state_dtype": "fp8"}, "unknown state_dtype 'fp8'.*'8bit'"),
        ({"state_dtype": torch.bfloat16}, "unknown state_dtype torch.bfloat16"),
        ({"min_8bit_size": 0}, "min_8bit_size"),
    ],
)
def test_invalid_hyperparameters_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedAdamW(make_params([(3,)]), **kwargs)


def test_invalid_group_hyperparameters_refused():
    ps = make_params([(3,), (4,)])
    with pytest.raises(ValueError, match="param group 1: invalid learning rate"):
        FusedAdamW([{"params": ps[:1]}, {"params": ps[1:], "lr": -1.0}])
    with pytest.raises(ValueError, match="param group 1: unknown state_dtype '4bit'"):
        FusedAdamW([{"params": ps[:1]}, {"params": ps[1:], "state_dtype": "4bit"}])


@pytest.mark.parametrize("state_dtype", [None, "8bit"])
def test_sparse_gradients_refused(state_dtype):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    lin = torch.nn.Linear(4, 1)
    opt = FusedAdamW(
        [{"params": lin.parameters()}, {"params": emb.parameters()}], backend="torch", state_dtype=state_dtype
    )
    lin(emb(torch.tensor([1, 2]))).sum().backward()
    match = "param group 1: parameter 0 has a sparse gradient.*SparseAdam"
    with pytest.raises(ValueError, match=match):
        opt.step()
    with pytest.raises(ValueError, match=match):
        opt.defer_clip_grad_norm_(1.0)


@pytest.mark.parametrize("saved_by", ["torch", "FusedAdamW"])
def test_torch_state_dict_loads_into_float32_mode(saved_by):
    # FusedAdamW's default state is torch's (moments in the parameter's dtype), and its state dict says so as
    # torch's does: both load into float32 moments, cast as torch's loader casts them
    ps = make_params([(300,)], dtype=torch.bfloat16)
    ref = torch.optim.AdamW(ps, fused=True) if saved_by == "torch" else FusedAdamW(ps, backend="torch")
    set_grads([ps], 0)
    ref.step()
    opt = FusedAdamW(ps, backend="torch", state_dtype=torch.float32, bf16_stochastic_rounding=True)
    opt.load_state_dict(ref.state_dict())
    state = opt.state[ps[0]]
    assert state["exp_avg"].dtype == torch.float32
    assert torch.equal(state["exp_avg"], ref.state[ps[0]]["exp_avg"].float())
    assert opt.param_groups[0]["bf16_stochastic_rounding"]  # our settings are the constructor's


@pytest.mark.parametrize("loading_by", ["torch", "FusedAdamW"])
def test_float32_moments_load_as_torch_loads_them(loading_by):
    # float32 moments of bf16 parameters are torch's state in another dtype: torch's AdamW and FusedAdamW's default
    # both load them cast to the parameter's dtype (a sharded load casts into the loading optimizer's tensors alike)
    ps = make_params([(300,)], dtype=torch.bfloat16)
    first = FusedAdamW(ps, backend="torch", state_dtype=torch.float32)
    set_grads([ps], 0)
    first.step()
    second = torch.optim.AdamW(ps, fused=True) if loading_by == "torch" else FusedAdamW(ps, backend="torch")
    second.load_state_dict(first.state_dict())
    for key in ("exp_avg", "exp_avg_sq"):
        assert second.state[ps[0]][key].dtype == torch.bfloat16
        assert torch.equal(second.state[ps[0]][key], first.state[ps[0]][key].to(torch.bfloat16))


def test_default_state_dict_is_keyed_as_torch_adamw():
    # a sharded (torch.distributed.checkpoint) load refuses a key its checkpoint lacks: FusedAdamW's default state
    # dict carries torch.optim.AdamW's keys and no others, so FSDP2 checkpoints cross between the two both ways;
    # float32 moments are torch's state in another dtype, 8-bit moments another state, recorded
    ps = make_params([(300,), (7,)])
    set_grads([ps], 0)
    ref = torch.optim.AdamW(ps)
    ref.step()
    ours = FusedAdamW(ps, backend="torch", bf16_stochastic_rounding=True, sr_seed=3)
    ours.step()
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert [sorted(g) for g in our_sd["param_groups"]] == [sorted(g) for g in ref_sd["param_groups"]]
    assert {i: sorted(s) for i, s in our_sd["state"].items()} == {
        i: sorted(s) for i, s in ref_sd["state"].items()
    }
    assert ours.param_groups[0]["sr_seed"] == 3  # the optimizer's own groups keep every setting
    group = FusedAdamW(ps, backend="torch", state_dtype=torch.float32).state_dict()["param_groups"][0]
    assert sorted(group) == sorted(ref_sd["param_groups"][0])
    group = FusedAdamW(ps, backend="torch", state_dtype="8bit").state_dict()["param_groups"][0]
    assert group["state_dtype"] == "8bit"
    assert sorted(set(group) - {"state_dtype"}) == sorted(ref_sd["param_groups"][0])


# -- plumbing ----------------------------------------------------------------------------------------------------


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


def test_deferred_clips_counted_only_when_finite():
    ps = make_params([(10,)])
    opt = FusedAdamW(ps, backend="torch", state_dtype="8bit")
    set_grads([ps], 0)
    opt.defer_clip_grad_norm_(1.0)
    opt.step()
    opt.defer_clip_grad_norm_(float("inf"))
    opt.step()
    opt.step()
    assert opt.deferred_clips_applied == 1


def test_auto_backend_on_cpu_uses_torch_and_logs(caplog):
    ps = make_params(LARGE_SHAPES[:3])
    ref_p = clone_params(ps)
    opt = FusedAdamW(ps, lr=1e-2)
    ref = torch.optim.AdamW(ref_p, lr=1e-2)
    truth = truth_adamw(ps, lr=1e-2)
    from fasttrain import _logging

    _logging._said.discard("fused_adamw.auto.cpu")
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        norms = run_pair(opt, ref, ps, ref_p, steps=3, clip=1.0, truth=truth)
    assert "using torch's fused AdamW" in caplog.text
    assert_norms(norms, torch.float32)
    assert_tracks_truth(ps, ref_p, truth[1], **TRACK)


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
    truth_model = copy.deepcopy(ref_model).double()  # the same training in float64
    truth = torch.optim.AdamW(truth_model.parameters(), lr=1e-2, foreach=False)
    x = torch.randn(8, 16)
    for step in range(5):
        for m, o, inputs in ((model, opt, x), (ref_model, ref, x), (truth_model, truth, x.double())):
            o.zero_grad()
            m(inputs).pow(2).mean().backward()
        norm = opt.optimizer.defer_clip_grad_norm_(0.1)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.1)
        truth_norm = torch.nn.utils.clip_grad_norm_(truth_model.parameters(), 0.1)
        assert_truth(norm, ref_norm, truth_norm, **NORM_FP32, what=f"norm at step {step}")
        for o in (opt, ref, truth):
            o.step()
    assert_tracks_truth(
        list(model.parameters()), list(ref_model.parameters()), list(truth_model.parameters()), **TRACK
    )
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert float(opt.optimizer.state[next(model.parameters())]["step"]) == 5
