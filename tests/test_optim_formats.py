"""The torch implementations of FusedAdamW's stored formats: blockwise 8-bit moments and stochastic rounding to bf16."""

from __future__ import annotations

import pytest
import torch

from fasttrain.optim import blockwise8, rounding

pytestmark = [pytest.mark.cuda, pytest.mark.numeric]


def _mix32_python(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_mix32_is_lowbias32():
    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
    got = rounding.mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [_mix32_python(x) for x in xs]


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    hi = torch.tensor(1.0 + 2**-7, dtype=torch.bfloat16)  # bf16's neighbour above 1
    for frac in (0.1, 0.5, 0.9):
        x = torch.full((20000,), 1.0 + frac * 2**-7)
        out = torch.empty(20000, dtype=torch.bfloat16)
        rounding.stochastic_round_to_bf16_(out, x, rounding.sr_key(7, 3, torch.tensor(5.0)))
        assert set(out.float().unique().tolist()) <= {float(lo), float(hi)}
        up = float((out == hi).float().mean())
        assert abs(up - frac) < 0.02, (frac, up)  # 20000 draws: std 0.0035
    # negative values round symmetrically
    rounding.stochastic_round_to_bf16_(out, -x, rounding.sr_key(7, 3, torch.tensor(5.0)))
    assert abs(float(out.float().mean()) + float(x[0])) < 2**-7 * 0.02


def test_stochastic_rounding_is_a_function_of_seed_salt_step():
    x = torch.rand(5000) + 1.0
    outs = {}
    for args in [(0, 0, 1.0), (0, 0, 1.0), (1, 0, 1.0), (0, 1, 1.0), (0, 0, 2.0)]:
        out = torch.empty(5000, dtype=torch.bfloat16)
        rounding.stochastic_round_to_bf16_(out, x, rounding.sr_key(args[0], args[1], torch.tensor(args[2])))
        outs.setdefault(args, []).append(out)
    assert torch.equal(*outs[(0, 0, 1.0)])
    variants = [outs[k][0] for k in [(1, 0, 1.0), (0, 1, 1.0), (0, 0, 2.0)]]
    for v in variants:
        assert not torch.equal(v, outs[(0, 0, 1.0)][0])


def test_stochastic_rounding_keeps_specials_and_exact_values():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, -3.0, 2.0**-130])
    out = torch.empty(8, dtype=torch.bfloat16)
    rounding.stochastic_round_to_bf16_(out, x, rounding.sr_key(0, 0, torch.tensor(1.0)))
    assert torch.isnan(out[0])
    assert out[1:].float().tolist() == x[1:].tolist()  # representable values (a subnormal too) never move


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 5000])
def test_blockwise8_round_trip(signed, numel):
    g = torch.Generator().manual_seed(numel)
    # values over seven decades, as second moments are
    x = torch.randn(numel, generator=g) * torch.logspace(-6, 0, numel)[torch.randperm(numel, generator=g)]
    if not signed:
        x = x.abs()
    codes, absmax = blockwise8.empty_state(x, signed)
    assert torch.equal(
        blockwise8.dequantize(codes, absmax, signed), torch.zeros(numel)
    )  # fresh state is zero
    blockwise8.quantize_(x, codes, absmax, signed)
    assert absmax.shape == ((numel + 255) // 256,)
    y = blockwise8.dequantize(codes, absmax, signed)
    blocks = torch.nn.functional.pad(x, (0, (-numel) % 256)).view(-1, 256)
    assert torch.equal(absmax, blocks.abs().amax(1))
    scale = absmax.double().repeat_interleave(256)[:numel]
    entries = blockwise8.tables(torch.device("cpu"))[
        blockwise8.SIGNED if signed else blockwise8.UNSIGNED
    ].double()
    # in float64 (the truth), up to 4 fp32 roundings of the block's scale (x / absmax and code * absmax in fp32)
    fp32 = 4 * torch.finfo(torch.float32).eps * scale
    steps = (x.double() / scale)[:, None] - entries[None, :]
    if signed:
        # the first moment: no entry of the map is nearer than the stored code's
        best = steps.abs().amin(1) * scale
        assert ((y.double() - x.double()).abs() <= best + fp32).all()
    else:
        # the second moment: rounded up, to the smallest entry at or above it (never down, beyond the threshold's
        # slack), and so never to 0 from a positive value
        up = torch.where(steps <= 0, -steps, float("inf")).amin(1) * scale
        slack = blockwise8.ROUND_UP_SLACK * x.double()
        assert (y.double() >= x.double() - slack - fp32).all()
        assert (y.double() - x.double() <= up + fp32).all()
        assert bool((y[x > 0] > 0).all())
    if signed:
        return  # the signed map ends at -0.993: a negative extreme is not exact, and requantizing moves its block
    # unsigned: each block's largest element is exact, and the map's entries keep their own codes
    assert float(y.max()) == float(x.max())
    codes2, absmax2 = blockwise8.empty_state(x, signed)
    blockwise8.quantize_(y, codes2, absmax2, signed)
    assert torch.equal(codes2, codes)


def test_blockwise8_zero_blocks_and_zero_code():
    x = torch.zeros(600)
    x[300] = 2.0
    codes, absmax = blockwise8.empty_state(x, True)
    blockwise8.quantize_(x, codes, absmax, True)
    assert absmax.tolist() == [0.0, 2.0, 0.0]
    assert codes[:300].eq(blockwise8.zero_code(True)).all() and int(codes[300]) == 255
    assert torch.equal(blockwise8.dequantize(codes, absmax, True), x)
