"""Packed rows on the GPU: no attention across examples with CUDA's attention kernels (issue 18).

test_packing_models.py proves the allow-list on CPU in float64. On a GPU, sdpa runs other kernels (the
memory-efficient and flash backends; the packed-sequence mask keeps sdpa off the flash backend), in fp32 and bf16,
so the same property is checked again there: each example's logits in the packed row match the example run alone,
and changing one example's tokens leaves every other example's logits and loss gradient as they were. A leak across
examples moves logits by about 1e-1 at these sizes; the bounds below are rounding-sized. Flash attention 2/3 is
checked too where flash_attn imports (packing stays off under it until this test has run on a GPU).

Runs in benchmarks/gpu/run.sh's kernels step (marker ``cuda``); skipped without CUDA.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import _packing
import _tiny as tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = [pytestmark, pytest.mark.cuda]

# packed vs alone: the same math with other shapes (other tiling and reduction order); a leak is ~1e-1
ALONE_ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
ATTENTION = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])


def _model(kind: str, attention: str, dtype: torch.dtype):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _packing.config(kind), attn_implementation=attention, dtype=dtype
    )
    return model.to("cuda").train()


def _per_example(model, examples, flash: bool):
    batch = {
        k: v.to("cuda") if torch.is_tensor(v) else v
        for k, v in _packing.packed(examples, flash=flash).items()
    }
    logits = model(**batch).logits[0].float()
    loss = torch.nn.functional.cross_entropy(logits[:-1], batch["labels"][0, 1:], reduction="none")
    out, start = [], 0
    for example in examples:
        end = start + len(example["input_ids"])
        grads = torch.autograd.grad(loss[start : end - 1].sum(), list(model.parameters()), retain_graph=True)
        out.append((logits[start:end].detach(), [g.float() for g in grads]))
        start = end
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_no_attention_across_packed_examples_on_the_gpu(kind, attention, dtype):
    model = _model(kind, attention, dtype)
    flash = attention.startswith("flash")
    data = tiny.dataset(n=3, min_len=20, max_len=60)
    examples = [{"input_ids": r["input_ids"], "labels": r["input_ids"]} for r in data]
    packed = _per_example(model, examples, flash)
    for example, (logits, _) in zip(examples, packed, strict=True):
        ids = torch.tensor([example["input_ids"]], device="cuda")
        alone = model(input_ids=ids, use_cache=False).logits[0].float().detach()
        torch.testing.assert_close(logits, alone, rtol=0, atol=ALONE_ATOL[dtype])
    changed = [
        dict(examples[0], input_ids=[(t * 7) % (tiny.VOCAB - 3) + 3 for t in examples[0]["input_ids"]])
    ]
    again = _per_example(model, changed + examples[1:], flash)
    assert not torch.equal(packed[0][0], again[0][0])  # the change is seen where it was made
    # The other examples' inputs are the same numbers in the same places: with no leak, only the kernels'
    # reduction order over the changed example's (masked) keys could differ, and masked keys add exact zeros.
    for (logits, grads), (logits2, grads2) in zip(packed[1:], again[1:], strict=True):
        torch.testing.assert_close(logits, logits2, rtol=0, atol=ALONE_ATOL[dtype] / 10)
        for g, g2 in zip(grads, grads2, strict=True):
            scale = max(g.abs().max().item(), 1e-30)
            assert (g - g2).abs().max().item() <= 1e-3 * scale
