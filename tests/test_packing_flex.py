"""Packed rows under ``attn_implementation="flex_attention"`` keep examples apart, as under sdpa and eager.

Flex builds its block mask from the packed row's ``position_ids`` through the same transformers code as sdpa, but
the kernel is another one (compiled by inductor on CPU: about a minute the first time), so the allow-list's claim
for flex rests on this test. CPU flex takes no float64, so the truth is each example run alone in float64 with sdpa,
and the bound is the one a float32 model must meet anyway: the packed float32 row as close to that truth as the
same example run alone in float32 flex (k = 4 and a few float32 units in the last place of the logits' scale).
A leak across examples moves these logits by about 1e-1.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import _packing
import _tiny as tiny
from fasttrain.integration import packing_policy

torch_flex = pytest.importorskip("torch.nn.attention.flex_attention")


def _model(attention: str, dtype: torch.dtype):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        _packing.config("qwen3"), attn_implementation=attention, dtype=dtype
    ).eval()


def test_flex_is_on_the_allow_list():
    assert packing_policy.model_problem(_model("flex_attention", torch.float32)) is None


def test_no_attention_across_packed_examples_under_flex():
    flex = _model("flex_attention", torch.float32)
    truth = _model("sdpa", torch.float64)
    truth.load_state_dict({k: v.double() for k, v in flex.state_dict().items()})
    data = tiny.dataset(n=3, min_len=5, max_len=14)
    examples = [{"input_ids": r["input_ids"], "labels": r["input_ids"]} for r in data]
    batch = _packing.packed(examples)
    with torch.no_grad():
        packed = flex(**{k: v for k, v in batch.items() if k != "labels"}).logits[0].double()
        start = 0
        for example in examples:
            ids = torch.tensor([example["input_ids"]])
            end = start + ids.shape[1]
            exact = truth(input_ids=ids, use_cache=False).logits[0]
            alone = flex(input_ids=ids, use_cache=False).logits[0].double()
            ours = (packed[start:end] - exact).abs().max().item()
            ref = (alone - exact).abs().max().item()
            floor = 8 * 2.0**-23 * exact.abs().max().item()
            assert ours <= 4 * ref + floor, (start, ours, ref, floor)
            start = end
