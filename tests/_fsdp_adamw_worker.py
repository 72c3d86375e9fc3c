"""Worker of tests/test_optim_fsdp.py: FSDP2 (fully_shard, gloo, CPU) with FusedAdamW vs torch AdamW.

Each rank trains three copies of one small model (same init, same per-rank data): torch's
``clip_grad_norm_`` + ``torch.optim.AdamW`` (the reference), and FusedAdamW with both backends, whose
``defer_clip_grad_norm_`` reduces the norm over the shards itself. Parameters are sharded unevenly (odd
row counts) so the ranks' local shards differ in size. Bounds come from the truth (tests/_truth_ops.py): the
reference's training run in float64; norms and parameters (per tensor) may be at most k times as far from it as
the reference's, plus a floor of fp32 rounding steps. 8-bit states on DTensor shards: tests/_fsdp_8bit_worker.py.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from _truth_ops import assert_truth


def _build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 33),
        torch.nn.Tanh(),
        torch.nn.Linear(33, 7),
        torch.nn.Tanh(),
        torch.nn.Linear(7, 5),
    )


def _train(kind: str, rank: int, steps: int, max_norm: float, **kwargs):
    """(norms, parameters) of one run; kind "truth" is the reference's run in float64."""
    from torch.distributed.fsdp import fully_shard

    from fasttrain import FusedAdamW

    dtype = torch.float64 if kind == "truth" else torch.float32
    model = _build(0).to(dtype)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    groups = [
        {"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
        {
            "params": [p for n, p in model.named_parameters() if n.endswith("bias")],
            "weight_decay": 0.0,
            "lr": 3e-3,
        },
    ]
    if kind == "reference":
        opt = torch.optim.AdamW(groups, lr=1e-2)
    elif kind == "truth":
        opt = torch.optim.AdamW(groups, lr=1e-2, foreach=False)
    else:
        opt = FusedAdamW(groups, lr=1e-2, backend=kind, **kwargs)
    norms = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 12, generator=g) * 3
        model(x.to(dtype)).pow(2).mean().backward()
        if kind in ("reference", "truth"):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        else:
            norm = opt.defer_clip_grad_norm_(max_norm)
        norms.append(float(norm))
        opt.step()
        opt.zero_grad()
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    return norms, params


def main(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        steps, max_norm = 12, 0.05
        ref_norms, ref_params = _train("reference", rank, steps, max_norm)
        truth_norms, truth_params = _train("truth", rank, steps, max_norm)
        assert max(ref_norms) > max_norm, "the test must actually clip"
        for kind in ("torch", "triton"):
            norms, params = _train(kind, rank, steps, max_norm)
            # norms: fp32 sums over shards in another order, twice the reference's error plus 4 fp32 ulps
            for step, triple in enumerate(zip(norms, ref_norms, truth_norms, strict=True)):
                a, b, t = (torch.tensor(x, dtype=torch.float64) for x in triple)  # the norms as returned
                assert_truth(a, b, t, k=2.0, ulps=4.0, dtype=torch.float32, what=f"{kind} norm {step}")
            # parameters: the same fp32 step as torch's, twice its distance to the truth plus one fp32 rounding
            for i, (a, b, t) in enumerate(zip(params, ref_params, truth_params, strict=True)):
                assert_truth(a, b, t, k=2.0, ulps=1.0, what=f"{kind}: parameter {i}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    os._exit(0)
