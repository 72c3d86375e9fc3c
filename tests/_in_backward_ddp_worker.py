"""Worker of tests/test_optim_in_backward_ddp.py: ``step_in_backward_ddp`` against ordinary DDP, gloo on CPU.

Every rank runs both on its own batches (different on each rank, so that the average matters): ordinary DDP
(``backward``, ``optimizer.step()``, ``zero_grad()``) and DDP with the update in its communication hook (the same
loop: ``step()`` and ``zero_grad()`` must be no-ops). Small buckets (``bucket_cap_mb``) so that the model spans
several. After every optimizer step the parameters must be equal bit for bit to the ordinary run's, and equal on
every rank; an lr schedule changes ``group["lr"]`` between steps. ``accum`` backwards per step, all but the last
under ``no_sync()``. ``find_unused``: a layer no rank uses and one only rank 0 uses.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _gloo_ranks import run_jobs
from fasttrain import FusedAdamW
from fasttrain.optim.in_backward_ddp import step_in_backward_ddp

STEPS = 3
MIN_8BIT = 256
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.hidden = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.rank0_only = nn.Linear(16, 4)  # used by rank 0 alone when find_unused
        self.never = nn.Linear(4, 4)  # used by no rank when find_unused

    def forward(self, x: torch.Tensor, partial: bool) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.hidden(h))
        h = torch.tanh(self.hidden(h))  # used twice
        y = self.out(h) * self.scale
        if not partial or dist.get_rank() == 0:
            y = y + self.rank0_only(x)
        if not partial:
            y = y + self.never(y)
        return y


def groups(model: nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": rest, "lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.0},
    ]


def batch(step: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + micro)
    return torch.randn(8, 16, generator=g).to(dtype), torch.randn(8, 4, generator=g).to(dtype)


def build(job: dict, in_backward: bool):
    dtype = DTYPES[job["dtype"]]
    torch.manual_seed(0)
    model = Tiny().to(dtype)
    ddp = DDP(model, bucket_cap_mb=0.002, find_unused_parameters=job["find_unused"])
    opt = FusedAdamW(
        groups(model),
        lr=1e-2,
        min_8bit_size=MIN_8BIT,
        backend="torch",
        state_dtype=job["state_dtype"],
        bf16_stochastic_rounding=job["sr"],
    )
    handle = step_in_backward_ddp(ddp, opt) if in_backward else None
    return model, ddp, opt, handle


def one_step(job: dict, step: int, model, ddp, opt, handle) -> torch.Tensor | None:
    """One optimizer step of ``accum`` backwards; the gradient norm (the ordinary run's from p.grad)."""
    dtype = DTYPES[job["dtype"]]
    accum = job["accum"]
    for micro in range(accum):
        x, t = batch(step, micro, dtype)
        last = micro == accum - 1
        with contextlib.nullcontext() if last else ddp.no_sync():  # no all-reduce, no comm hook: accumulate
            ((ddp(x, job["find_unused"]) - t).float().square().mean() / accum).backward()
        if handle is not None and not last:
            assert handle.stepped == 0, "stepped under no_sync"
    if handle is not None:
        assert all(p.grad is None for p in model.parameters()), "a stepped gradient was not freed"
        norm = handle.grad_norm()
        handle.reset_grad_norm()
    else:
        grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
    opt.step()
    opt.zero_grad()
    for i, group in enumerate(opt.param_groups):  # an lr schedule
        group["lr"] = group["lr"] * (0.5 if i == 0 else 0.7)
    return norm


def compare(job: dict, world: int) -> None:
    ref = build(job, in_backward=False)
    ours = build(job, in_backward=True)
    for step in range(STEPS):
        ref_norm = one_step(job, step, *ref)
        our_norm = one_step(job, step, *ours)
        for (name, p), q in zip(ours[0].named_parameters(), ref[0].parameters(), strict=True):
            assert torch.equal(p, q), f"{job}: step {step}, parameter {name} differs from ordinary DDP"
            gathered = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(gathered, p.detach().contiguous())
            assert all(torch.equal(gathered[0], o) for o in gathered), (
                f"{job}: step {step}, {name} across ranks"
            )
        torch.testing.assert_close(our_norm, ref_norm, rtol=2e-6, atol=0.0)  # the averaged gradients' norm
    model, opt = ours[0], ours[2]
    for name, p in model.named_parameters():
        state = opt.state[p]
        if job["find_unused"] and name.startswith("never"):
            assert not state, f"{name}: no rank used it, yet it was stepped"
            continue
        assert float(state["step"]) == STEPS, name  # once per step, never again by step()
        for key, value in state.items():
            assert torch.equal(value, ref[2].state[dict(ref[0].named_parameters())[name]][key]), (name, key)
    if job["state_dtype"] == "8bit":
        assert "exp_avg_codes" in opt.state[model.hidden.weight]
    ours[3].remove()


if __name__ == "__main__":
    run_jobs({"compare": compare})
