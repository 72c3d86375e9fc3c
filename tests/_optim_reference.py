"""Shared helpers of the optimizer tests: parameter sets, seeded gradients, runs against torch's AdamW."""

from __future__ import annotations

import torch

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


def run_pair(ours, ref, params_ours, params_ref, steps=20, clip=None, lr_change_at=10, grad_scale=1.0):
    """Step both optimizers on identical gradients; return the norms each clip returned."""
    norms = []
    for step in range(steps):
        set_grads([params_ours, params_ref], step, scale=grad_scale)
        if clip is not None:
            n_ours = ours.defer_clip_grad_norm_(clip)
            n_ref = torch.nn.utils.clip_grad_norm_(params_ref, clip)
            norms.append((n_ours, n_ref))
        ours.step()
        ref.step()
        if step == lr_change_at:
            for opt in (ours, ref):
                for group in opt.param_groups:
                    group["lr"] = group["lr"] * 0.5
    return norms


def assert_params_close(ours, ref, rtol=1e-6, atol=1e-6):
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=atol)


def assert_bf16_close(ours, ref_fp32, ulps=1):
    """bf16 parameters against an fp32 emulation rounded to bf16 every step: within ``ulps`` bf16 ulps.

    With clipping the reference rounds the clipped gradient to bf16 (torch's clip multiplies in the
    gradient's dtype) and the kernel does not, so a parameter may land one rounding step away, twice.
    A step taken apart while a value was near 1 keeps its absolute size when the value later shrinks:
    hence the absolute floor of one ulp at 0.5 (2**-8) when ``ulps`` > 1.
    """
    for a, b in zip(ours, ref_fp32, strict=True):
        a32 = a.detach().float()
        b32 = b.detach().float()
        ulp = torch.maximum(a32.abs(), b32.abs()) * 2.0**-7  # bf16 keeps 8 significant bits
        floor = 2.0**-8 if ulps > 1 else 0.0
        bad = (a32 - b32).abs() > torch.clamp(ulps * ulp, min=floor)
        assert not bool(bad.any()), (
            f"{int(bad.sum())} elements beyond {ulps} ulp: max {(a32 - b32).abs().max()}"
        )


def bf16_reference_run(ours, ours_p, ref_p, steps, clip):
    """Reference for bf16 parameters: torch AdamW on fp32 copies, rounded to bf16 after every step,
    fed the same bf16 gradients (clipped by torch's clip_grad_norm_ on the bf16 gradients)."""
    ref = torch.optim.AdamW(two_groups(ref_p), lr=1e-2)
    shadow = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]  # bf16, only for torch's clip
    for step in range(steps):
        set_grads([ours_p, shadow], step)
        if clip is not None:
            n_ours = ours.defer_clip_grad_norm_(clip)
            n_ref = torch.nn.utils.clip_grad_norm_(shadow, clip)
            assert n_ours.dtype == n_ref.dtype == torch.bfloat16
            torch.testing.assert_close(n_ours.float(), n_ref.float(), rtol=2**-7, atol=0)
        for q, s in zip(ref_p, shadow, strict=True):
            q.grad = s.grad.float()
        ours.step()
        ref.step()
        with torch.no_grad():
            for q in ref_p:
                q.copy_(q.bfloat16().float())
