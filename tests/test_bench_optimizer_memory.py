"""benchmarks/bench_optimizer_memory.py's byte count on one process: FusedAdamW's default state (fp32 moments of
an fp32 parameter: 8 bytes a parameter) against its 8-bit state (codes + an fp32 absmax per 256 elements), torch's
AdamW beside them, and a DTensor counted by its local shard."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
STEP_BYTES = 4  # one fp32 step counter per parameter tensor


@pytest.fixture(scope="module")
def bench():
    # the script imports its own _common, as `python benchmarks/bench_optimizer_memory.py` finds it
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_optimizer_memory", BENCHMARKS / "bench_optimizer_memory.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def _stepped(opt_factory, dtype=torch.float32):
    p = torch.nn.Parameter(torch.randn(512, 512, generator=torch.Generator().manual_seed(0)).to(dtype))
    opt = opt_factory([p])
    p.grad = torch.randn_like(p)
    opt.step()
    return opt


def test_default_vs_8bit_on_one_512x512_parameter(bench):
    from fasttrain import FusedAdamW

    n = 512 * 512
    default = bench.optimizer_state_bytes(_stepped(lambda ps: FusedAdamW(ps, backend="torch")))
    eight = bench.optimizer_state_bytes(
        _stepped(lambda ps: FusedAdamW(ps, backend="torch", state_dtype="8bit"))
    )
    assert default["stepped"] == eight["stepped"] == n
    assert default["bytes"] == 2 * 4 * n + STEP_BYTES
    assert default["dtypes"] == ["float32"] and default["tensors"] == 3
    # two uint8 codes a parameter + two fp32 absmax per 256-element block
    assert eight["bytes"] == 2 * n + 2 * 4 * (n // 256) + STEP_BYTES
    assert eight["dtypes"] == ["float32", "uint8"] and eight["tensors"] == 5
    assert default["bytes_per_param"] == pytest.approx(8.0, abs=1e-4)
    assert eight["bytes_per_param"] == pytest.approx(2.03125, abs=1e-4)


def test_torch_adamw_and_bf16_parameters(bench):
    from fasttrain import FusedAdamW

    torch_bf16 = bench.optimizer_state_bytes(_stepped(lambda ps: torch.optim.AdamW(ps), torch.bfloat16))
    ours_bf16 = bench.optimizer_state_bytes(
        _stepped(lambda ps: FusedAdamW(ps, backend="torch"), torch.bfloat16)
    )
    assert torch_bf16["bytes_per_param"] == pytest.approx(4.0, abs=1e-4)
    assert ours_bf16["bytes"] == torch_bf16["bytes"]
    assert "bfloat16" in ours_bf16["dtypes"]


def test_a_dtensor_counts_its_local_shard(bench):
    """A stand-in for a DTensor (anything with ``to_local()``): the count reads the local shard, for the
    parameter's elements and for each state tensor."""

    class Sharded:
        def __init__(self, shard: torch.Tensor):
            self.shard = shard

        def to_local(self) -> torch.Tensor:
            return self.shard

    param = Sharded(torch.zeros(4, 16))  # this rank's 4 of 8 rows
    state = {
        "exp_avg": Sharded(torch.zeros(4, 16)),
        "exp_avg_sq": Sharded(torch.zeros(4, 16)),
        "step": torch.tensor(1.0),
    }
    counted = bench.optimizer_state_bytes(SimpleNamespace(state={param: state}))
    assert counted["stepped"] == 4 * 16
    assert counted["bytes"] == 2 * 4 * 16 * 4 + STEP_BYTES
