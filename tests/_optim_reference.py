"""Shared helpers of the optimizer tests: parameter sets, seeded gradients, runs against torch's AdamW and
against the truth (torch's AdamW in float64 on the same start values and the same gradients)."""

from __future__ import annotations

import torch

from _truth_ops import check_truth
from fasttrain import FusedAdamW

# 0-d, 1, odd 1-D around block sizes, 2-D and 3-D
SMALL_SHAPES = [(), (1,), (1023,), (4097,), (33, 65), (3, 5, 7)]
LARGE_SHAPES = [*SMALL_SHAPES, (70_000,), (257, 515), (3, 129, 200)]


def make_params(shapes, dtype=torch.float32, seed=0, device="cpu") -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device=device, dtype=dtype)) for s in shapes]


def clone_params(params) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def two_groups(params, lr=1e-2):
    """Two groups with different lr, betas and weight decay."""
    half = len(params) // 2
    return [
        {"params": params[:half], "weight_decay": 0.1},
        {"params": params[half:], "lr": lr * 0.3, "betas": (0.8, 0.99), "weight_decay": 0.0},
    ]


def set_grads(params_lists, step, scale=1.0, dtype=None):
    """The same seeded gradient on the matching parameters of every list."""
    g = torch.Generator().manual_seed(1000 + step)
    for ps in zip(*params_lists, strict=True):
        grad = torch.randn(ps[0].shape, generator=g) * scale
        for p in ps:
            p.grad = grad.to(device=p.device, dtype=dtype or p.dtype).clone()


def truth_params(params) -> list[torch.nn.Parameter]:
    """Float64 copies: the parameters of the truth run."""
    return [torch.nn.Parameter(p.detach().double().clone()) for p in params]


def truth_adamw(params, groups=None, **kwargs):
    """(optimizer, float64 parameters): torch's single-tensor AdamW in float64, the truth of every mode.

    ``groups`` maps the parameter list to param groups (``two_groups``); it is given the float64 copies."""
    ps = truth_params(params)
    return torch.optim.AdamW(groups(ps) if groups else ps, foreach=False, **kwargs), ps


def copy_grads_to_truth(params, params_truth, divide=1.0):
    """The truth steps on exactly the gradients ours was given (already rounded to the parameter's dtype)."""
    for p, q in zip(params, params_truth, strict=True):
        q.grad = None if p.grad is None else p.grad.detach().double() / divide


def run_pair(
    ours, ref, params_ours, params_ref, steps=20, clip=None, lr_change_at=10, grad_scale=1.0, truth=None
):
    """Step both optimizers on identical gradients, and ``truth`` = (optimizer, float64 parameters) on the same
    values; return the norms each clip returned: (ours, reference[, truth]) per step."""
    norms = []
    for step in range(steps):
        set_grads([params_ours, params_ref], step, scale=grad_scale)
        if truth is not None:
            copy_grads_to_truth(params_ours, truth[1])
        if clip is not None:
            n_ours = ours.defer_clip_grad_norm_(clip)
            n_ref = torch.nn.utils.clip_grad_norm_(params_ref, clip)
            if truth is not None:
                norms.append((n_ours, n_ref, torch.nn.utils.clip_grad_norm_(truth[1], clip)))
            else:
                norms.append((n_ours, n_ref))
        for opt in (ours, ref) if truth is None else (ours, ref, truth[0]):
            opt.step()
        if step == lr_change_at:
            for opt in (ours, ref) if truth is None else (ours, ref, truth[0]):
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * 0.5
    return norms


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def assert_tracks_truth(ours, ref, truth, k, ulps, what="parameters"):
    """Per tensor, ``||ours - f64|| <= k * ||ref - f64|| + ulps * eps(dtype) * ||f64||`` (tests/_truth_ops.py).

    The truth is torch's AdamW in float64 on the same start and gradients. Adam normalises each step, so a
    rounding of a near-zero gradient moves an element by an update: the reference does that too, and its own
    distance to the truth is the yardstick. Every tensor off is listed."""
    off = [
        m
        for i, (a, b, t) in enumerate(zip(ours, ref, truth, strict=True))
        if (
            m := check_truth(
                a, b, t, k=k, ulps=ulps, dtype=a.dtype, what=f"{what} #{i} {tuple(a.shape)} {a.dtype}"
            )
        )
    ]
    assert not off, f"{what} off (k={k}, floor {ulps} ulp):\n  " + "\n  ".join(off)


def state_bytes(opt) -> int:
    """Bytes of every tensor in the optimizer's state but ``step`` (shared tensors counted once)."""
    seen = {}
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                seen[value.data_ptr()] = value.numel() * value.element_size()
    return sum(seen.values())


def quadratic_run(dtype, steps, backend, n=4096, **kwargs):
    """(final, start): a ``n``-parameter quadratic (gradient p - target) minimised by FusedAdamW with a small lr.

    Parameters start in [1, 2), where bf16's spacing is 2**-7; each step moves them by ~1e-3, under half of it:
    rounded to nearest, a bf16 parameter never moves; rounded stochastically, it follows the fp32 run on average.
    """
    g = torch.Generator().manual_seed(0)
    start = torch.rand(n, generator=g) + 1.0
    target = (start + 0.2 * torch.randn(n, generator=g)).to(torch.promote_types(dtype, torch.float32))
    p = torch.nn.Parameter(start.to(dtype, copy=True))
    opt = FusedAdamW([p], lr=1e-3, weight_decay=0.0, backend=backend, **kwargs)
    for _ in range(steps):
        p.grad = (p.detach().to(target.dtype) - target).to(dtype)
        opt.step()
    return p.detach().to(torch.promote_types(dtype, torch.float32)), start
