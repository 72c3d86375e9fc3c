"""Bounds from the truth for op-level tests (issue 15).

A bound fitted to what one CPU printed fails on another CPU whose vector kernels round differently. So every
comparison here measures two distances to the op computed in float64 (the truth): ours, and the torch op we
replace run in the same dtype as ours (the reference). The check is

    ||ours - truth|| <= k * ||reference - truth|| + floor,    floor = ulps * eps(dtype) * ||truth||

k says how much less exact than the reference ours may be (for instance a chunked sum rounds at other points),
the floor is a few rounding steps of the dtype at the value's magnitude (it matters only where the reference
happens to land on the truth). Both are chosen from the dtype in each test, never from a measurement.

Set FASTTRAIN_TRUTH_LOG=<file> to append every measured pair of distances to that file (for reports).
"""

from __future__ import annotations

import os

import torch


def distance(x: torch.Tensor, truth: torch.Tensor) -> float:
    """||x - truth|| in float64 (Frobenius); NaN when either holds a NaN, inf when a value is off to inf."""
    return float((x.detach().double() - truth.detach().double()).norm())


def magnitude(truth: torch.Tensor) -> float:
    return float(truth.detach().double().norm())


def check_truth(ours, ref, truth, *, k: float, ulps: float, dtype=None, what: str = "value") -> str | None:
    """The failure message of one comparison, or None when ours is within ``k * |ref - truth| + floor``.

    The floor is ``ulps`` rounding steps of ``dtype`` (by default ours' dtype) at the truth's magnitude."""
    dtype = dtype or ours.dtype
    d_ours, d_ref = distance(ours, truth), distance(ref, truth)
    floor = ulps * torch.finfo(dtype).eps * magnitude(truth)
    allowed = k * d_ref + floor
    _log(what, d_ours, d_ref, floor)
    if d_ours <= allowed:  # also False for NaN
        return None
    return (
        f"{what}: |ours-f64| {d_ours:.3e} > {k} * |ref-f64| {d_ref:.3e} + floor {floor:.3e} "
        f"({ulps} ulp of {dtype} at |f64| {magnitude(truth):.3e})"
    )


def assert_truth(ours, ref, truth, *, k: float, ulps: float, dtype=None, what: str = "value") -> None:
    message = check_truth(ours, ref, truth, k=k, ulps=ulps, dtype=dtype, what=what)
    assert message is None, message


def assert_all_truth(triples, *, k: float, ulps: float, dtype=None, what: str = "tensor") -> None:
    """``triples`` of (name, ours, ref, truth): every one is checked, and every one off is listed."""
    off = [
        m
        for name, ours, ref, truth in triples
        if (m := check_truth(ours, ref, truth, k=k, ulps=ulps, dtype=dtype, what=f"{what} {name}"))
        is not None
    ]
    assert not off, f"{len(off)} off (k={k}, floor {ulps} ulp):\n  " + "\n  ".join(off)


def _log(what: str, d_ours: float, d_ref: float, floor: float) -> None:
    path = os.environ.get("FASTTRAIN_TRUTH_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    with open(path, "a") as f:
        f.write(f"{cap}\t{test}\t{what}\t{d_ours:.3e}\t{d_ref:.3e}\t{floor:.3e}\n")


def signed_rel_error(x: torch.Tensor, truth: torch.Tensor) -> float:
    """The error of ``x`` projected on the truth, relative to it: ``<x - truth, truth> / |truth|^2``.

    A scale bias (every element off by the same factor, e.g. bf16 rounding ``1 - p`` to 1 on every token at
    initialisation) shows here in full, while rounding noise averages out over many elements."""
    t = truth.detach().double()
    return float(((x.detach().double() - t) * t).sum() / (t * t).sum())


def assert_bias_no_larger(triples, *, slack: float) -> None:
    """``triples`` of (name, ours, ref, truth): ``|signed_rel_error(ours)| <= |signed_rel_error(ref)| + slack``."""
    off = []
    for name, ours, ref, truth in triples:
        e_ours, e_ref = signed_rel_error(ours, truth), signed_rel_error(ref, truth)
        _log(f"bias {name}", e_ours, e_ref, slack)
        if not abs(e_ours) <= abs(e_ref) + slack:
            off.append(
                f"{name}: signed relative error {e_ours:+.3e}, reference {e_ref:+.3e} (slack {slack:.1e})"
            )
    assert not off, "\n  ".join(off)
