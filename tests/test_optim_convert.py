"""FusedAdamW.load_state_dict across state layouts: full-precision moments quantized into 8-bit blocks, 8-bit ones
dequantized, instead of a refusal (another state_dtype, another min_8bit_size, a state gathered from FSDP2 shards).

The truth of a conversion is the saved moments themselves: dequantized 8-bit moments must be the saved codes'
values exactly; quantized ones must be the blocks ``blockwise8.quantize_`` makes of the saved values, and read back
within the map's resolution of them. ``step`` survives every conversion, and training goes on from the loaded state.
"""

from __future__ import annotations

import logging

import pytest
import torch

from _optim_reference import make_params, set_grads
from fasttrain import FusedAdamW, _logging
from fasttrain.optim import blockwise8
from fasttrain.optim.layouts import SIGNED

SHAPES = [(5000,), (7,), (40, 300)]  # 8-bit flat blocks, fp32 below min_8bit_size, blocks ending a row too
MOMENTS = ("exp_avg", "exp_avg_sq")

pytestmark = pytest.mark.numeric  # quantizing: rounding that another instruction set could move


def _trained(kind: str, dtype: torch.dtype, **kw):
    params = make_params(SHAPES, dtype=dtype)
    if kind == "torch":
        opt = torch.optim.AdamW(params, lr=1e-2)
    else:
        opt = FusedAdamW(params, lr=1e-2, backend="torch", state_dtype=None if kind == "None" else kind, **kw)
    for step in range(3):
        set_grads([params], step)
        opt.step()
    return params, opt


def _moment(state: dict, name: str) -> torch.Tensor:
    """A state's moment as fp32 values, whichever layout holds it."""
    if f"{name}_codes" in state:
        return blockwise8.dequantize(state[f"{name}_codes"], state[f"{name}_absmax"], SIGNED[name])
    return state[name].float()


def _rounding_gap(name: str) -> float:
    """The most quantizing moves a value of the moment, in units of its block's absmax: half the map's widest gap
    between neighbouring entries for the first moment (rounded to nearest), the widest gap for the second moments
    (rounded up)."""
    row = blockwise8.SIGNED if SIGNED[name] else blockwise8.UNSIGNED
    qmap = blockwise8.tables(torch.device("cpu"))[row].double()
    widest = float((qmap[1:] - qmap[:-1]).max())
    return widest / 2 if SIGNED[name] else widest


def _quantized(x: torch.Tensor, name: str, rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    codes, absmax = blockwise8.empty_state(x, SIGNED[name], rows=rows)
    blockwise8.quantize_(x, codes, absmax, SIGNED[name])
    return codes, absmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("saved_kind", "loading"),
    [("8bit", None), ("8bit", "float32"), ("None", "8bit"), ("float32", "8bit"), ("torch", "8bit")],
)
def test_moments_convert_across_layouts_on_load(saved_kind, loading, dtype, caplog):
    params, first = _trained(saved_kind, dtype)
    saved = first.state_dict()
    second = FusedAdamW(params, lr=1e-2, backend="torch", state_dtype=loading)
    _logging._said.discard("fused_adamw.load_converted")
    with caplog.at_level(logging.WARNING, logger="fasttrain"):
        second.load_state_dict(saved)
    # the 5000- and 12,000-element parameters change layout; the 7-element one keeps fp32 (or its dtype's) moments
    converted = [m for m in caplog.messages if "converted on load" in m]
    assert len(converted) == 1 and "the moments of 2 parameter(s)" in converted[0], caplog.messages
    for i, p in enumerate(params):
        old, new = saved["state"][i], second.state[p]
        assert float(new["step"]) == float(old["step"]) == 3.0
        for name in MOMENTS:
            value = _moment(old, name)
            if loading == "8bit" and p.numel() >= blockwise8.MIN_8BIT_SIZE:
                assert set(new) == {"step", *(f"{n}_{part}" for n in MOMENTS for part in ("codes", "absmax"))}
                codes, absmax = _quantized(value, name)
                assert torch.equal(new[f"{name}_codes"], codes) and torch.equal(new[f"{name}_absmax"], absmax)
                # read back within the map's rounding gap of the saved value (times the block's absmax), plus the fp32
                # rounding of value / absmax and of the dequantized product and the round-up slack: ulps of the absmax
                back = _moment(new, name).reshape(-1)
                err = (back - value.reshape(-1)).abs()
                block_absmax = absmax.repeat_interleave(blockwise8.BLOCK)[: err.numel()]
                bound = block_absmax * (_rounding_gap(name) + 2**-21 + blockwise8.ROUND_UP_SLACK)
                assert (err <= bound).all(), (i, name, float((err - bound).max()))
            else:
                held = new[name]
                # the 8-bit mode keeps fp32 moments below min_8bit_size
                assert held.dtype == (p.dtype if loading is None else torch.float32)
                assert torch.equal(held, value.to(held.dtype)), (i, name)
    set_grads([params], 3)
    before = [p.detach().clone() for p in params]
    second.step()  # training goes on from the converted state
    assert all(torch.isfinite(p).all() and not torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_another_min_8bit_size_converts_the_parameters_it_moves():
    params, first = _trained("8bit", torch.float32)
    saved = first.state_dict()
    second = FusedAdamW(params, lr=1e-2, backend="torch", state_dtype="8bit", min_8bit_size=10_000)
    second.load_state_dict(saved)
    # 5,000 elements: now fp32 moments; 12,000: still 8-bit
    small, large = second.state[params[0]], second.state[params[2]]
    assert torch.equal(small["exp_avg"], _moment(saved["state"][0], "exp_avg"))
    assert torch.equal(large["exp_avg_codes"], saved["state"][2]["exp_avg_codes"])


def test_row_blocks_and_fp32_moments_gathered_from_shards_load_into_one_process():
    # what get_optimizer_state_dict gathers from FSDP2: 8-bit row blocks for the 2-D parameter (rows of 300: a block
    # of 256 and one of 44 per row) and fp32 moments for the 1-D one, which one process keeps in 8 bits
    params, first = _trained("8bit", torch.float32)
    saved = first.state_dict()
    flat_state, rows_state = saved["state"][0], saved["state"][2]
    for name in MOMENTS:
        flat_state[name] = _moment(flat_state, name)
        del flat_state[f"{name}_codes"], flat_state[f"{name}_absmax"]
        rows_state[f"{name}_codes"], rows_state[f"{name}_absmax"] = _quantized(
            _moment(rows_state, name), name, True
        )
    second = FusedAdamW(params, lr=1e-2, backend="torch", state_dtype="8bit")
    second.load_state_dict(saved)
    assert torch.equal(
        second.state[params[0]]["exp_avg_codes"], _quantized(flat_state["exp_avg"], "exp_avg")[0]
    )
    assert second.state[params[2]]["exp_avg_absmax"].shape == (40, 2)  # row blocks kept as they are
    set_grads([params], 3)
    second.step()


def test_a_moment_unlike_its_parameter_is_refused_with_its_name():
    params, first = _trained("float32", torch.float32)
    saved = first.state_dict()
    saved["state"][0]["exp_avg_sq"] = torch.zeros(4999)
    with pytest.raises(
        ValueError, match=r"param group 0, parameter 0: the state dict's exp_avg_sq is a plain tensor "
    ):
        FusedAdamW(params, backend="torch", state_dtype="8bit").load_state_dict(saved)
