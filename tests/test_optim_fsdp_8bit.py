"""FusedAdamW's states on FSDP2 shards (gloo, CPU): 8-bit moments per shard, and checkpoints that reshard.

Three launches of tests/_fsdp_8bit_worker.py, in order (each a list of jobs, see the worker):

1. 2 processes, full shard: 8-bit updates against the unsharded optimizer (torch and Triton backends, and with
   FSDP2's CPU offload policy); checkpoints saved for state_dtype None, float32 and 8bit.
2. 4 processes: 8-bit updates on a hybrid 2 x 2 mesh; launch 1's checkpoints loaded on a full 4-way mesh and on
   the hybrid mesh (2 -> 4, full -> hybrid); checkpoints saved on both meshes.
3. 2 processes: launch 2's checkpoints loaded on a full 2-way mesh (4 -> 2, hybrid -> full), the hybrid one with
   the CPU offload policy; each 4-process checkpoint loaded with every other state_dtype (full precision into
   full precision, cast; 8-bit to or from full precision refused, naming the key the checkpoint lacks); and each
   4-process state, gathered, loaded into one process with every state_dtype (8-bit row blocks kept, fp32 moments
   of the 1-D parameter quantized, 8-bit and full precision converted into one another).

A loaded state must be the saved one value for value, sharded like its parameter on the new mesh, and the steps
after it must track the uninterrupted unsharded run within the bound of the state type.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _gloo_ranks import launch_jobs

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("_fsdp_8bit_worker.py")


def launch(tmp_path: Path, name: str, world: int, jobs: list[dict]) -> None:
    launch_jobs(WORKER, tmp_path, name, world, jobs)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
def test_fsdp2_8bit_updates_and_checkpoints_that_reshard(tmp_path):
    ckpt = {name: str(tmp_path / name) for name in ("full2", "full4", "hybrid4")}
    launch(
        tmp_path,
        "two",
        2,
        [
            {"do": "update", "mesh": "full", "backends": ["torch", "triton"]},
            {"do": "update", "mesh": "offload", "backends": ["torch"]},
            {"do": "save", "mesh": "full", "dir": ckpt["full2"]},
        ],
    )
    launch(
        tmp_path,
        "four",
        4,
        [
            {"do": "update", "mesh": "hybrid", "backends": ["torch"]},
            {"do": "load", "mesh": "full", "dir": ckpt["full2"]},
            {"do": "load", "mesh": "hybrid", "dir": ckpt["full2"]},
            {"do": "save", "mesh": "full", "dir": ckpt["full4"]},
            {"do": "save", "mesh": "hybrid", "dir": ckpt["hybrid4"]},
        ],
    )
    launch(
        tmp_path,
        "two-again",
        2,
        [
            {"do": "load", "mesh": "full", "dir": ckpt["full4"]},
            {"do": "load", "mesh": "offload", "dir": ckpt["hybrid4"]},
            {"do": "cross_modes", "mesh": "full", "dir": ckpt["full4"]},
            {"do": "one_process", "dir": ckpt["full4"]},
        ],
    )


# -- single process: the row-block layout itself ---------------------------------------------------------------


def test_row_blocks_of_rows_of_256_are_the_flat_blocks():
    from fasttrain.optim import blockwise8

    x = torch.randn(6, 512) * torch.logspace(-3, 1, 6)[:, None]
    for signed in (True, False):
        y = x if signed else x.abs()
        flat, rows = blockwise8.empty_state(y, signed), blockwise8.empty_state(y, signed, rows=True)
        assert rows[1].shape == (6, 2)
        blockwise8.quantize_(y, *flat, signed)
        blockwise8.quantize_(y, *rows, signed)
        assert torch.equal(flat[0], rows[0]) and torch.equal(flat[1], rows[1].reshape(-1))
        assert torch.equal(blockwise8.dequantize(*flat, signed), blockwise8.dequantize(*rows, signed))


def test_row_blocks_end_with_each_row():
    from fasttrain.optim import blockwise8

    x = torch.randn(7, 3, 100)  # rows of 300: a block of 256 and one of 44 per row
    codes, absmax = blockwise8.empty_state(x, True, rows=True)
    assert absmax.shape == (7, 2)
    blockwise8.quantize_(x, codes, absmax, True)
    rows = x.reshape(7, 300).abs()
    assert torch.equal(absmax, torch.stack([rows[:, :256].amax(1), rows[:, 256:].amax(1)], dim=1))
    y = blockwise8.dequantize(codes, absmax, True)
    assert y.shape == x.shape and y.is_contiguous()
    # each value within half the widest gap of the signed map (relative to its block's absmax, top decade)
    assert (
        (y - x).abs().reshape(7, 300) <= 0.08 * absmax.repeat_interleave(torch.tensor([256, 44]), dim=1)
    ).all()
    empty = torch.empty(0, 300)  # a rank that owns no rows
    codes, absmax = blockwise8.empty_state(empty, True, rows=True)
    blockwise8.quantize_(empty, codes, absmax, True)
    assert absmax.shape == (0, 2) and blockwise8.dequantize(codes, absmax, True).shape == (0, 300)


def test_saved_8bit_blocks_of_another_shape_refused():
    from fasttrain import FusedAdamW

    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = FusedAdamW([p], backend="torch", state_dtype="8bit")
    p.grad = torch.randn(64, 64)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg_sq_absmax"] = torch.zeros(3)
    with pytest.raises(
        ValueError, match=r"param group 0, parameter 0: .*exp_avg_sq_codes / exp_avg_sq_absmax"
    ):
        FusedAdamW([p], backend="torch", state_dtype="8bit").load_state_dict(sd)
