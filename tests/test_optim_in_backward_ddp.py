"""``step_in_backward_ddp`` (the update in DDP's communication hook) against ordinary DDP, bit for bit.

Two gloo processes on CPU (tests/_in_backward_ddp_worker.py), one launch: 3 steps with an lr schedule, FusedAdamW
backend="torch", fp32 and bf16 + stochastic rounding + 8-bit moments, each also with accumulation over 2 backwards
(the first under ``no_sync()``), and with ``find_unused_parameters`` (a layer no rank uses, one only rank 0 uses).
After every step the parameters equal those of ordinary DDP (backward, then ``optimizer.step()``) on the same
processes and data, and are equal across the ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _gloo_ranks import launch_jobs

WORKER = Path(__file__).with_name("_in_backward_ddp_worker.py")

FP32 = {"dtype": "float32", "state_dtype": None, "sr": False}
BF16_SR_8BIT = {"dtype": "bfloat16", "state_dtype": "8bit", "sr": True}


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
def test_equals_ordinary_ddp_on_two_gloo_ranks(tmp_path):
    jobs = [
        {"do": "compare", **case, "accum": accum, "find_unused": unused}
        for case in (FP32, BF16_SR_8BIT)
        for accum, unused in ((1, False), (2, False), (1, True))
    ]
    launch_jobs(WORKER, tmp_path, "in-backward-ddp", 2, jobs)


def test_refusals(tmp_path):
    """Single process (gloo world of 1): what the hook cannot do is refused up front."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fasttrain import FusedAdamW
    from fasttrain.optim.in_backward import step_in_backward
    from fasttrain.optim.in_backward_ddp import step_in_backward_ddp

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        opt = FusedAdamW(model.parameters(), backend="torch")
        with pytest.raises(TypeError):
            step_in_backward_ddp(model, opt)
        with pytest.raises(ValueError, match="gradient_as_bucket_view"):
            step_in_backward_ddp(DDP(model, gradient_as_bucket_view=True), opt)
        ddp = DDP(model)
        handle = step_in_backward_ddp(ddp, opt)
        with pytest.raises(ValueError, match="already steps in backward"):
            step_in_backward(opt)
        handle.remove()  # the hook stays, only averaging: backward leaves the gradient for step()
        ddp(torch.ones(2, 4)).sum().backward()
        assert model.weight.grad is not None and handle.updates == 0
        with pytest.raises(ValueError, match="already has a communication hook"):
            step_in_backward_ddp(ddp, FusedAdamW(model.parameters(), backend="torch"))
    finally:
        dist.destroy_process_group()
