"""FusedAdamW's Triton path (under TRITON_INTERPRET=1 on CPU) against torch.optim.AdamW and the torch backend; small
shapes.

The chunk size is lowered so that small tensors still span several programs (tail chunks, the per-tensor norm
reduction over several partials) without the interpreter's cost of large tensors. Bounds come from the truth
(torch's AdamW in float64 on the same values; tests/_truth_ops.py): per tensor, ours may be at most ``k`` times as
far from it as the reference (torch's AdamW in our dtype, or our torch backend for the formats torch lacks), plus
a rounding step of the dtype. Quantization codes are compared through the moments they encode.
"""

from __future__ import annotations

import copy
import os
import weakref

import pytest
import torch

from _optim_reference import (
    SMALL_SHAPES,
    assert_tracks_truth,
    clone_params,
    copy_grads_to_truth,
    run_pair,
    set_grads,
    snapshot,
    state_bytes,
    truth_adamw,
    two_groups,
)
from _optim_reference import make_params as _make_params
from _truth_ops import assert_truth
from fasttrain import FusedAdamW
from fasttrain.optim import blockwise8

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton path needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)",
)
pytestmark = [pytestmark, pytest.mark.cuda, pytest.mark.numeric]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    from fasttrain.kernels import adamw as kernels

    monkeypatch.setattr(kernels, "CHUNK", 2048)
    monkeypatch.setattr(kernels, "BLOCK", 512)


# on a CUDA machine the kernel runs compiled on the GPU; here, interpreted on CPU tensors
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
CLIP = 30.0  # the gradients' norm is ~86: clipping is active
MIN_8BIT = 1000  # SMALL_SHAPES' 1023, 4097 and 33x65 are quantized, the rest not


def make_params(shapes, dtype=torch.float32):
    return _make_params(shapes, dtype=dtype, device=DEVICE)


# The same fp32 arithmetic, one rounding per stored value, in another order across programs: twice the
# reference's distance to the truth, plus one rounding step of the dtype (a one-element tensor rounded otherwise).
TRACK = {"k": 2.0, "ulps": 1.0}


def norm_bound(dtype):
    # fp32 partial sums in another order (a few fp32 ulps), then rounded to the gradients' dtype like torch's norm
    return {"k": 2.0, "ulps": 4.0 if dtype == torch.float32 else 1.0, "dtype": dtype}


def truth_of(params, groups=two_groups, **kwargs):
    return truth_adamw(params, groups, **kwargs)


def share_equal(a, b) -> float:
    return float(sum(int((x == y).sum()) for x, y in zip(a, b, strict=True)) / sum(x.numel() for x in a))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_default_matches_torch_fused(dtype):
    ours_p = make_params(SMALL_SHAPES, dtype=dtype)
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(two_groups(ours_p), lr=1e-2, backend="triton")
    ref = torch.optim.AdamW(two_groups(ref_p), lr=1e-2, fused=True)
    truth = truth_of(ours_p, lr=1e-2)
    norms = run_pair(ours, ref, ours_p, ref_p, steps=10, clip=CLIP, lr_change_at=5, truth=truth)
    for step, norm_triple in enumerate(norms):
        assert_truth(*norm_triple, **norm_bound(dtype), what=f"norm at step {step}")
    assert_tracks_truth(ours_p, ref_p, truth[1], **TRACK)
    for p, q in zip(ours_p, ref_p, strict=True):
        assert ours.state[p]["exp_avg_sq"].dtype == ref.state[q]["exp_avg_sq"].dtype == dtype
    assert state_bytes(ours) == state_bytes(ref)
    sq = [[opt.state[p]["exp_avg_sq"] for p in ps] for opt, ps in ((ours, ours_p), (ref, ref_p), truth)]
    assert_tracks_truth(*sq, **TRACK, what="exp_avg_sq")


def test_amsgrad_maximize_tensor_lr():
    ours_p = make_params(SMALL_SHAPES[2:5])
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(
        ours_p, lr=torch.tensor(1e-2, device=DEVICE), amsgrad=True, maximize=True, backend="triton"
    )
    ref = torch.optim.AdamW(ref_p, lr=1e-2, amsgrad=True, maximize=True, fused=True)
    truth = truth_of(ours_p, groups=None, lr=1e-2, amsgrad=True, maximize=True)
    # shrinking gradients make max_exp_avg_sq differ from exp_avg_sq
    for step in range(8):
        set_grads([ours_p, ref_p], step, scale=0.5**step)
        copy_grads_to_truth(ours_p, truth[1])
        for opt in (ours, ref, truth[0]):
            opt.step()
    assert_tracks_truth(ours_p, ref_p, truth[1], **TRACK)
    vmax = [[opt.state[p]["max_exp_avg_sq"] for p in ps] for opt, ps in ((ours, ours_p), (ref, ref_p), truth)]
    assert_tracks_truth(*vmax, **TRACK, what="max_exp_avg_sq")


@pytest.mark.parametrize(
    ("dtype", "state_dtype", "sr", "amsgrad"),
    [
        (torch.bfloat16, torch.float32, False, False),
        (torch.float32, "8bit", False, True),
        (torch.bfloat16, "8bit", True, False),
        (torch.bfloat16, None, True, True),
    ],
)
def test_matches_torch_backend(dtype, state_dtype, sr, amsgrad):
    a = make_params(SMALL_SHAPES, dtype=dtype)
    b = clone_params(a)
    kwargs = {"state_dtype": state_dtype, "bf16_stochastic_rounding": sr, "min_8bit_size": MIN_8BIT}
    oa = FusedAdamW(two_groups(a), lr=1e-2, amsgrad=amsgrad, backend="triton", **kwargs)
    ob = FusedAdamW(two_groups(b), lr=1e-2, amsgrad=amsgrad, backend="torch", **kwargs)
    truth = truth_of(a, lr=1e-2, amsgrad=amsgrad)
    run_pair(oa, ob, a, b, steps=6, clip=CLIP, lr_change_at=3, truth=truth)
    assert_tracks_truth(a, b, truth[1], **TRACK)
    for p, q in zip(a, b, strict=True):
        sa, sb = oa.state[p], ob.state[q]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and sa[key].shape == sb[key].shape, key
    if state_dtype == "8bit":
        quantized = [p for p in a if p.numel() >= MIN_8BIT]
        assert all("exp_avg_codes" in oa.state[p] for p in quantized)
    if state_dtype == "8bit":
        # a code flips where the fp32 moments of the two backends straddle a boundary: compare what they encode,
        # against the truth's moments, with the codes' own resolution as the floor (half a map step: 1/2**8)
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            moments = [
                [blockwise8.dequantize(o.state[p][f"{name}_codes"], o.state[p][f"{name}_absmax"], signed) for p in quantized]
                for o, quantized in ((oa, quantized), (ob, [q for q in b if q.numel() >= MIN_8BIT]))
            ]  # fmt: skip
            truth_moments = [
                truth[0].state[t][name] for t, p in zip(truth[1], a, strict=True) if p.numel() >= MIN_8BIT
            ]
            assert_tracks_truth(
                *moments, truth_moments, k=2.0, ulps=0.5 * 2**-8 / torch.finfo(torch.float32).eps, what=name
            )


@pytest.mark.parametrize("state_dtype", [None, "8bit"])
def test_stochastic_rounding_draws_the_torch_backends_bits(state_dtype):
    # without clipping (whose coefficient comes from norms summed in another order) the fp32 values of the two
    # backends differ by at most a few fp32 ulps, 2**-16 of a bf16 step: with the same random bits a parameter
    # rounds otherwise only where its random threshold falls in between, a few times in 2**16 per element and
    # step. A share of 1e-3 differing (7 of these 7,372 elements, against an expectation under 1) allows that.
    a = make_params(SMALL_SHAPES, dtype=torch.bfloat16)
    b = clone_params(a)
    kwargs = {"state_dtype": state_dtype, "bf16_stochastic_rounding": True, "min_8bit_size": MIN_8BIT}
    oa = FusedAdamW(two_groups(a), lr=1e-2, backend="triton", **kwargs)
    ob = FusedAdamW(two_groups(b), lr=1e-2, backend="torch", **kwargs)
    truth = truth_of(a, lr=1e-2)
    run_pair(oa, ob, a, b, steps=4, truth=truth)
    assert share_equal(a, b) > 1 - 1e-3
    assert_tracks_truth(a, b, truth[1], **TRACK)
    # and they are not the bits of nearest rounding: updates of 1e-2 against bf16 steps of 2**-7 |p| round
    # otherwise in a sizeable share of the elements
    c = clone_params(make_params(SMALL_SHAPES, dtype=torch.bfloat16))
    oc = FusedAdamW(two_groups(c), lr=1e-2, backend="triton", state_dtype=state_dtype, min_8bit_size=MIN_8BIT)
    for step in range(4):
        set_grads([c], step)
        oc.step()
    assert share_equal(a, c) < 0.9


def test_8bit_resumes_bit_exactly():
    make = lambda ps: FusedAdamW(  # noqa: E731
        two_groups(ps), lr=1e-2, backend="triton", state_dtype="8bit", min_8bit_size=MIN_8BIT,
        bf16_stochastic_rounding=True,
    )  # fmt: skip
    a = make_params(SMALL_SHAPES, dtype=torch.bfloat16)
    oa = make(a)
    for step in range(2):
        set_grads([a], step)
        oa.step()
    b = clone_params(a)
    ob = make(b)
    ob.load_state_dict(oa.state_dict())
    for step in range(2, 4):
        set_grads([a, b], step)
        oa.step()
        ob.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
        for key, value in oa.state[p].items():
            assert torch.equal(value, ob.state[q][key]), key


def test_same_norm_and_parameters_as_torch_backend_bf16_clip():
    a = make_params(SMALL_SHAPES, dtype=torch.bfloat16)
    b = clone_params(a)
    oa = FusedAdamW(two_groups(a), lr=1e-2, backend="triton")
    ob = FusedAdamW(two_groups(b), lr=1e-2, backend="torch")
    truth, truth_p = truth_of(a, lr=1e-2)
    for step in range(6):
        set_grads([a, b], step)
        copy_grads_to_truth(a, truth_p)
        norms = (oa.defer_clip_grad_norm_(0.3), ob.defer_clip_grad_norm_(0.3))
        truth_norm = torch.nn.utils.clip_grad_norm_(truth_p, 0.3)
        assert_truth(*norms, truth_norm, **norm_bound(torch.bfloat16), what=f"norm at step {step}")
        for opt in (oa, ob, truth):
            opt.step()
    assert_tracks_truth(a, b, truth_p, **TRACK)


def test_clip_does_not_rewrite_gradients():
    ps = make_params(SMALL_SHAPES)
    opt = FusedAdamW(ps, lr=1e-2, backend="triton", state_dtype="8bit", min_8bit_size=MIN_8BIT)
    set_grads([ps], 0, scale=10.0)
    grads = [p.grad.clone() for p in ps]
    norm = opt.defer_clip_grad_norm_(1.0)
    assert float(norm) > 1.0
    opt.step()
    assert opt.deferred_clips_applied == 1
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
        assert torch.isnan(a).all() and torch.isnan(b).all()


@pytest.mark.parametrize(
    ("param_dtype", "state_dtype", "sr"), [(torch.float16, None, False), (torch.bfloat16, "8bit", True)]
)
def test_grad_scaler_inf_step_skipped_without_sync(param_dtype, state_dtype, sr, monkeypatch):
    kwargs = {"state_dtype": state_dtype, "bf16_stochastic_rounding": sr, "min_8bit_size": MIN_8BIT}
    ours_p = make_params(SMALL_SHAPES[:4], dtype=param_dtype)
    ref_p = clone_params(ours_p)
    ours = FusedAdamW(ours_p, lr=1e-3, backend="triton", **kwargs)
    ref = FusedAdamW(ref_p, lr=1e-3, backend="torch", **kwargs)
    scaler = torch.amp.GradScaler(DEVICE, init_scale=256.0)
    ref_scaler = torch.amp.GradScaler(DEVICE, init_scale=256.0)
    truth, truth_p = truth_of(ours_p, groups=None, lr=1e-3)
    for s in (scaler, ref_scaler):
        s.scale(torch.ones(()))
    for step in range(4):
        set_grads([ours_p, ref_p], step, scale=256.0)
        if step != 2:  # the truth skips the step the inf is in, and unscales by the same power of two
            copy_grads_to_truth(ours_p, truth_p, divide=scaler.get_scale())
            truth.step()
        if step == 2:
            ours_p[2].grad[7] = float("inf")
            ref_p[2].grad[7] = float("inf")
            before = snapshot(ours_p)
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
    assert_tracks_truth(ours_p, ref_p, truth_p, **TRACK)


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
    # through copies, as a checkpoint is: torch's load_state_dict keeps the given tensors when their dtype fits,
    # so ours, ref and back would otherwise share their moments and update them twice a step
    ref = torch.optim.AdamW(two_groups(b), lr=1e-2)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    truth, truth_p = truth_of(a, lr=1e-2)
    truth.load_state_dict(ours.state_dict())  # cast to float64: copies
    back = FusedAdamW(two_groups(a), lr=1e-2, backend="triton")
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    for step in range(3, 6):
        set_grads([a, b], step)
        copy_grads_to_truth(a, truth_p)
        for opt in (back, ref, truth):
            opt.step()
    assert_tracks_truth(a, b, truth_p, **TRACK)


def test_noncontiguous_parameter_falls_back_to_torch():
    base = torch.randn(20, 30, device=DEVICE)
    p = torch.nn.Parameter(base.t())  # non-contiguous
    q = torch.nn.Parameter(p.detach().clone())
    ours = FusedAdamW([p], lr=1e-2, backend="triton")
    ref = torch.optim.AdamW([q], lr=1e-2)
    truth, truth_p = truth_of([q], groups=None, lr=1e-2)
    for step in range(3):
        set_grads([[p], [q]], step)
        p.grad = p.grad.t().contiguous().t()
        copy_grads_to_truth([q], truth_p)
        for opt in (ours, ref, truth):
            opt.step()
    assert_tracks_truth([p], [q], truth_p, **TRACK)


def test_launch_covers_all_tensors_of_a_group(monkeypatch):
    from fasttrain.kernels import adamw as kernels
    from fasttrain.kernels import adamw8bit

    calls = []
    for module, name in ((kernels, "adamw_step"), (adamw8bit, "adamw8bit_step")):
        real = getattr(module, name)

        def counting(table, *args, _name=name, _real=real, **kwargs):
            calls.append((_name, table.n_tensors))
            return _real(table, *args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    ps = make_params(SMALL_SHAPES)
    opt = FusedAdamW(two_groups(ps), backend="triton")
    set_grads([ps], 0)
    opt.step()
    assert calls == [("adamw_step", 3), ("adamw_step", 3)]  # one launch per group, not one per tensor
    calls.clear()
    opt = FusedAdamW(two_groups(ps), backend="triton", state_dtype="8bit", min_8bit_size=MIN_8BIT)
    opt.step()
    # group 0: (), (1,) in fp32, 1023 quantized; group 1: 4097 and 33x65 quantized, (3, 5, 7) in fp32
    assert sorted(calls) == sorted(
        [("adamw_step", 2), ("adamw8bit_step", 1), ("adamw8bit_step", 2), ("adamw_step", 1)]
    )


# -- step plans (optim/_plan.py): a kept plan must step as a freshly built optimizer does, bit for bit --------------

PLAN_SHAPES = [(300,), (17, 33), (5000,), (64,)]  # 5000 spans three programs at the lowered chunk
PLAN_CONFIGS = {
    "fp32": {"dtype": torch.float32, "kwargs": {}},
    "bf16-sr-8bit": {
        "dtype": torch.bfloat16,
        "kwargs": {
            "state_dtype": "8bit",
            "min_8bit_size": MIN_8BIT,
            "bf16_stochastic_rounding": True,
            "sr_seed": 7,
        },
    },
}


def _plan_grad(p, step, j, scale=1.0):
    gen = torch.Generator().manual_seed(1000 * step + j)
    return (scale * torch.randn(p.shape, generator=gen)).to(dtype=p.dtype, device=p.device)


def _plan_params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype=dtype, device=DEVICE)) for s in PLAN_SHAPES
    ]


def _grad_none(opt, ps, step, memo):
    if step == 2:
        ps[2].grad = None  # a frozen or unused parameter: skipped this step, stepped again at the next
    if step == 3:
        ps[3].grad = None  # as many gradients in its group as at step 2, of another parameter


def _grad_replaced(opt, ps, step, memo):
    if (
        step == 2
    ):  # a new gradient tensor at a new address; the old one kept alive (a stale table would read it)
        memo["old"] = ps[2].grad
        ps[2].grad = _plan_grad(ps[2], step, 99)


def _new_grads_every_step(opt, ps, step, memo):
    # HF's zero_grad(set_to_none=True): every gradient a new tensor each step (the old ones kept alive here)
    memo.setdefault("old", []).extend(p.grad for p in ps if p.grad is not None)
    for j, p in enumerate(ps):
        p.grad = _plan_grad(p, step, 50 + j)


def _hyperparameters_changed(opt, ps, step, memo):
    if step == 1:
        opt.param_groups[0]["lr"] *= 0.5  # a scheduler
    if step == 2:
        opt.param_groups[1].update(weight_decay=0.3, betas=(0.8, 0.9), eps=1e-6, maximize=True)


def _amsgrad_switched_on(opt, ps, step, memo):
    if step == 2:
        opt.param_groups[1]["amsgrad"] = True  # a new moment to create, another table


def _rounding_switched(opt, ps, step, memo):
    if step == 2:  # the salts and seed of the launch, and the offsets of the tables, change with it
        group = opt.param_groups[0]
        group["bf16_stochastic_rounding"] = not group["bf16_stochastic_rounding"]


def _group_added(opt, ps, step, memo):
    if step == 2:
        extra = _plan_params(ps[0].dtype, seed=1)[:2]
        for j, p in enumerate(extra):
            p.grad = _plan_grad(p, step, 70 + j)
        memo["extra"] = extra
        opt.add_param_group({"params": extra, "lr": 3e-3})
    elif "extra" in memo:
        for j, p in enumerate(memo["extra"]):
            p.grad = _plan_grad(p, step, 70 + j)


def _state_dict_loaded(opt, ps, step, memo):
    if step == 1:
        memo["saved"] = copy.deepcopy(opt.state_dict())
    if step == 3:
        opt.load_state_dict(memo["saved"])  # back to the state after step 0


def _param_storage_moved(opt, ps, step, memo):
    if step == 2:  # p.data = ...: the same Parameter at a new address (the old storage kept alive)
        memo["old"] = ps[0].data
        ps[0].data = memo["old"].clone()


def _state_replaced_by_hand(opt, ps, step, memo):
    if step == 2:
        state = opt.state[ps[1]]
        for key in [k for k in state if k != "step"]:
            state[key] = state[key].clone()


def _groups_shown_one_at_a_time(opt, ps, step, memo):
    # DeepSpeed ZeRO-1/2 steps one group at a time through a one-group param_groups: salts restart at 0
    if step == 2:
        memo["groups"] = opt.param_groups
        opt.param_groups = [memo["groups"][1]]
    if step == 3:
        opt.param_groups = memo["groups"]


PLAN_SCENARIOS = {
    "grad_set_to_none": _grad_none,
    "grad_replaced": _grad_replaced,
    "new_grads_every_step": _new_grads_every_step,
    "hyperparameters_changed": _hyperparameters_changed,
    "amsgrad_switched_on": _amsgrad_switched_on,
    "stochastic_rounding_switched": _rounding_switched,
    "param_group_added": _group_added,
    "state_dict_loaded": _state_dict_loaded,
    "param_storage_moved": _param_storage_moved,
    "state_replaced_by_hand": _state_replaced_by_hand,
    "groups_shown_one_at_a_time": _groups_shown_one_at_a_time,
}


def _fresh_step(ref: FusedAdamW, backend: str, clip: bool) -> None:
    """Step ``ref``'s parameters and state through an optimizer built for this step only: nothing is kept from
    an earlier step but the state."""
    fresh = FusedAdamW([dict(g) for g in ref.param_groups], backend=backend)
    fresh.state = ref.state
    if clip:
        fresh.defer_clip_grad_norm_(CLIP)
    fresh.step()


@pytest.mark.parametrize("config", list(PLAN_CONFIGS))
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("scenario", list(PLAN_SCENARIOS))
def test_kept_plan_steps_as_a_fresh_optimizer(scenario, backend, config):
    dtype, kwargs = PLAN_CONFIGS[config]["dtype"], PLAN_CONFIGS[config]["kwargs"]
    mutate = PLAN_SCENARIOS[scenario]
    sides = {}
    for side in ("kept", "fresh"):
        ps = _plan_params(dtype)
        groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 2e-2}]
        sides[side] = (FusedAdamW(groups, lr=1e-2, weight_decay=0.1, backend=backend, **kwargs), ps, {})
    for step in range(5):
        for opt, ps, memo in sides.values():
            for j, p in enumerate(
                ps
            ):  # in place where a gradient exists: addresses stay, as DDP's buckets keep them
                g = _plan_grad(p, step, j)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.copy_(g)
            mutate(opt, ps, step, memo)
        kept = sides["kept"][0]
        kept.defer_clip_grad_norm_(CLIP)
        kept.step()
        _fresh_step(sides["fresh"][0], backend, clip=True)
        (kept_opt, kept_ps, _), (ref_opt, ref_ps, _) = sides["kept"], sides["fresh"]
        for i, (p, q) in enumerate(zip(kept_ps, ref_ps, strict=True)):
            assert torch.equal(p, q), f"{scenario}: parameter {i} after step {step}"
            sp, sq = kept_opt.state.get(p, {}), ref_opt.state.get(q, {})
            assert sp.keys() == sq.keys(), f"{scenario}: state keys of parameter {i} after step {step}"
            for key in sp:
                assert torch.equal(sp[key], sq[key]), f"{scenario}: {key} of parameter {i} after step {step}"
    assert kept_opt._plans, "the plan was not kept: this test would not test it"


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_plan_kept_across_steps_and_holds_no_gradient(backend, monkeypatch):
    from fasttrain.optim import _state

    inits = []
    real_init = _state.init
    monkeypatch.setattr(_state, "init", lambda *a, **k: inits.append(1) or real_init(*a, **k))
    ps = _plan_params(torch.float32)
    opt = FusedAdamW(two_groups(ps), backend=backend)
    for j, p in enumerate(ps):
        p.grad = _plan_grad(p, 0, j)
    opt.step()
    assert len(inits) == len(ps)
    for step in (1, 2):
        for j, p in enumerate(ps):
            p.grad = _plan_grad(p, step, j)  # new gradient tensors (zero_grad(set_to_none=True)): plan kept
        opt.defer_clip_grad_norm_(CLIP)
        opt.step()
    assert len(inits) == len(ps), "a kept plan decides nothing per parameter"
    ps[0].grad = None
    opt.step()
    assert len(inits) > len(ps), "a gradient that disappeared must make the group decided again"
    grad = ps[1].grad
    gone = weakref.ref(grad)
    del grad
    opt.zero_grad(set_to_none=True)
    assert gone() is None, "a plan must not keep a gradient alive (set_to_none frees it)"
