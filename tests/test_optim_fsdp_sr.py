"""bf16 stochastic rounding on FSDP2 shards: the random bits of an element come from its index in the whole
parameter, so a sharded run rounds as the unsharded optimizer does and a resharded checkpoint resumes as the
uninterrupted run, bit for bit (tests/_fsdp_sr_worker.py, gloo on CPU; the Triton kernels under the interpreter).

One launch of 4 processes (one launch, not one per world size: each costs seconds of imports), in order:

1. Updates against the unsharded optimizer on a full 4-way mesh (torch and Triton backends; moments in the
   parameter's dtype, fp32 and, Triton only, 8-bit) and a hybrid 2 x 2 one; the rounding's statistics on shards.
2. Checkpoints saved on ranks 0 and 1 alone (a 2-way mesh, torch backend) and on the 4-way mesh (Triton).
3. The 2-way checkpoint loaded on the 4-way and the hybrid mesh (2 -> 4, full -> hybrid), the 4-way one on the
   2-way mesh (4 -> 2); the next steps equal to the uninterrupted unsharded run.

Single-process tests below: both backends draw the bits of ``fasttrain.optim.rounding`` at a given global offset
(one past 2**32 included), and a shard whose indices would cross 2**32 inside a kernel chunk is stepped by torch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _gloo_ranks import launch_jobs

WORKER = Path(__file__).with_name("_fsdp_sr_worker.py")


def launch(tmp_path: Path, name: str, world: int, jobs: list[dict]) -> None:
    launch_jobs(WORKER, tmp_path, name, world, jobs)


@pytest.mark.distributed
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
def test_fsdp2_stochastic_rounding_is_the_unsharded_one_and_survives_resharding(tmp_path):
    two, four = str(tmp_path / "two"), str(tmp_path / "four")
    launch(
        tmp_path,
        "four",
        4,
        [
            {"do": "update", "mesh": "full", "backends": ["torch"], "state_dtypes": ["none", "float32"]},
            {"do": "update", "mesh": "full", "backends": ["triton"], "state_dtypes": ["float32", "8bit"]},
            {"do": "update", "mesh": "hybrid", "backends": ["torch", "triton"], "state_dtypes": ["float32"]},
            {"do": "stochastic", "mesh": "full", "backends": ["torch", "triton"]},
            {"do": "save", "mesh": "pair", "backend": "torch", "dir": two},
            {"do": "save", "mesh": "full", "backend": "triton", "dir": four},
            {"do": "load", "mesh": "full", "backend": "torch", "dir": two},
            {"do": "load", "mesh": "hybrid", "backend": "torch", "dir": two},
            {"do": "load", "mesh": "pair", "backend": "triton", "dir": four},
        ],
    )


# -- single process: the bits at a global offset, both backends ------------------------------------------------

LR, WEIGHT_DECAY, SEED = 1e-2, 0.1, 77


def _decayed_step(
    backend: str, shapes, offsets: dict[int, int], monkeypatch, seed: int = SEED
) -> list[torch.Tensor]:
    """One step with zero gradients (the update is p * (1 - lr * wd), one fp32 product in both backends) of bf16
    parameters whose first elements are given the global ``offsets`` (by index)."""
    from fasttrain import FusedAdamW
    from fasttrain.optim import adamw

    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in shapes]
    where = {id(p): offsets.get(i, 0) for i, p in enumerate(params)}
    monkeypatch.setattr(adamw, "global_offset", lambda p: where[id(p)])
    opt = FusedAdamW(
        params,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        backend=backend,
        state_dtype=torch.float32,
        bf16_stochastic_rounding=True,
        sr_seed=seed,
    )
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    return [p.detach() for p in params]


def _expected(shapes, offsets: dict[int, int], seed: int = SEED) -> list[torch.Tensor]:
    from fasttrain.optim import rounding

    g = torch.Generator().manual_seed(5)
    decay = torch.tensor(1.0 - LR * WEIGHT_DECAY, dtype=torch.float64).float()
    out = []
    for i, s in enumerate(shapes):
        x = torch.randn(s, generator=g).to(torch.bfloat16).float() * decay
        r = torch.empty(s, dtype=torch.bfloat16)
        rounding.stochastic_round_to_bf16_(
            r, x, rounding.sr_key(seed, i, torch.tensor(1.0)), offsets.get(i, 0)
        )
        out.append(r)
    return out


# a plain offset; one whose chunks cross 2**32 at a chunk boundary (the Triton kernel's two keys); one whose
# indices would cross 2**32 inside a chunk (the Triton backend hands that parameter to torch)
SHAPES = [(7, 300), (40, 1000), (3, 1000)]
OFFSETS = {0: 12345, 1: 2**32 - 2 * 16384, 2: 2**32 - 1000}


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_both_backends_draw_the_bits_at_the_global_index(backend, monkeypatch):
    from fasttrain.kernels import adamw as kernels

    assert not kernels.chunks_straddle(40_000, OFFSETS[1]) and kernels.chunks_straddle(3000, OFFSETS[2])
    got = _decayed_step(backend, SHAPES, OFFSETS, monkeypatch)
    for i, (x, y) in enumerate(zip(got, _expected(SHAPES, OFFSETS), strict=True)):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)), (backend, i)
    # and the offset matters: the bits at local indices are other bits
    local = _expected(SHAPES, {})
    for i, (x, y) in enumerate(zip(got, local, strict=True)):
        assert not torch.equal(x, y), (backend, i)


@pytest.mark.parametrize("seed", [2**31 + 5, -7, 2**40 + 3])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_both_backends_draw_the_same_bits_for_any_seed(backend, seed, monkeypatch):
    # the kernel takes the seed as a 32-bit argument: its low 32 bits, as the torch path's key reads it
    got = _decayed_step(backend, SHAPES[:1], {}, monkeypatch, seed=seed)
    (expected,) = _expected(SHAPES[:1], {}, seed=seed)
    assert torch.equal(got[0].view(torch.int16), expected.view(torch.int16))


def test_a_table_whose_chunk_would_straddle_2_32_is_refused():
    from fasttrain.kernels import adamw as kernels

    assert not kernels.chunks_straddle(2**33, 0)  # chunks divide 2**32
    assert not kernels.chunks_straddle(100, 2**32 - 100)  # ends just below
    assert kernels.chunks_straddle(101, 2**32 - 100)
    assert not kernels.chunks_straddle(10**6, 2**32 - 16384)  # a chunk starts at 2**32
    t = torch.zeros(3000)
    with pytest.raises(ValueError, match="straddle a multiple of 2"):
        kernels.TensorTable([[t]], t.device, offsets=[2**32 - 1000])


def test_global_offset_of_plain_tensors_is_zero():
    from fasttrain.optim._tensors import global_offset

    assert global_offset(torch.zeros(3, 4)) == 0
