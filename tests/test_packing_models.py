"""The packing allow-list (``fasttrain.families``, the families whose ``packing`` test is this file) verified family by family.

1. No attention across packed examples, in float64: every example's logits in the packed row (the batch exactly as
   the packer makes it, ``use_cache=False`` included) equal that example's logits run alone, and changing one
   example's tokens changes no other example's loss or gradient. A model that ignored the packed mask (as every
   one of these does when its config's ``use_cache=True`` makes a cache in a training forward) fails both.
2. Per step through the Trainer: fasttrain packed (the batching paths alone: the Rust collator and packing; the
   optimizer and loss paths have their own parity tests) against the padded reference Trainer, loss and grad_norm at each
   of three steps and the final weights anchored on a float64 run of the reference (``_truth``).

Llama and Qwen3 are also covered by every test_trainer_parity.py run (packing is on by default there).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import _packing
import _tiny as tiny
import _truth
import fasttrain
from fasttrain.families import FAMILIES, packing_model_types
from fasttrain.integration import packing_policy

pytestmark = [pytest.mark.gpu_versions, pytest.mark.numeric]

ATTENTION = {"gemma2": ("eager",)}  # transformers has no sdpa for Gemma 2


def test_the_allow_list_is_what_is_tested_here():
    tested = set(_packing.SETTINGS)
    assert tested == packing_model_types()
    assert {f.packing for f in FAMILIES if f.model_type in tested} == {"tests/test_packing_models.py"}


def _model(kind: str, attention: str, dtype=torch.float32, seed: int = 0, wide_window: bool = False):
    config = _packing.config(kind)
    if wide_window and getattr(config, "sliding_window", None):
        # a padded float64 run with a window shorter than a row's padding has pad queries that see no key: eager
        # gives them NaN (its float64 mask value is -inf in its float32 softmax) and the NaN reaches the loss
        # through the next layer's zero-weighted values. The truth run needs padding, so its window covers a row.
        config.sliding_window = 64
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
    assert model.config.use_cache  # the configs' default: the packed batch must switch the cache off itself
    assert packing_policy.model_problem(model) is None
    return model.train()


def _per_example(model, examples):
    """Each example's logits and the gradient of its own summed loss, from one forward of the packed row."""
    batch = _packing.packed(examples)
    logits = model(**batch).logits[0]
    loss = torch.nn.functional.cross_entropy(
        logits[:-1], batch["labels"][0, 1:], ignore_index=-100, reduction="none"
    )
    out, start = [], 0
    for example in examples:
        end = start + len(example["input_ids"])
        grads = torch.autograd.grad(
            loss[start : end - 1].sum(), list(model.parameters()), retain_graph=True, allow_unused=True
        )
        out.append((logits[start:end].detach(), grads))
        start = end
    return out


@pytest.mark.parametrize(
    ("kind", "attention"),
    [(k, a) for k in _packing.SETTINGS for a in ATTENTION.get(k, ("sdpa", "eager"))],
)
def test_no_attention_across_packed_examples(kind, attention):
    model = _model(kind, attention, dtype=torch.float64)
    data = tiny.dataset(n=3, min_len=5, max_len=14)
    examples = [{"input_ids": r["input_ids"], "labels": r["input_ids"]} for r in data]
    packed = _per_example(model, examples)
    for example, (logits, _) in zip(examples, packed, strict=True):
        alone = model(input_ids=torch.tensor([example["input_ids"]]), use_cache=False).logits[0]
        # eager's softmax runs in float32 even in a float64 model: its packed/alone difference is float32 rounding
        # (~3e-8 here); a leak across examples moves these logits by ~1e-1
        torch.testing.assert_close(
            logits, alone.detach(), rtol=0, atol=1e-10 if attention == "sdpa" else 1e-6
        )
    changed = [
        dict(examples[0], input_ids=[(t * 7) % (tiny.VOCAB - 3) + 3 for t in examples[0]["input_ids"]])
    ]
    changed += examples[1:]
    again = _per_example(model, changed)
    assert not torch.equal(packed[0][0], again[0][0])  # the change is seen where it was made
    for (logits, grads), (logits2, grads2) in zip(packed[1:], again[1:], strict=True):
        assert torch.equal(logits, logits2)
        for g, g2 in zip(grads, grads2, strict=True):
            assert (g is None and g2 is None) or torch.allclose(g, g2, rtol=0, atol=1e-12)


def _train(kind, tmp_path, trainer_cls, truth=False):
    model = _model(kind, ATTENTION.get(kind, ("sdpa",))[0], wide_window=True)
    if truth:
        model = _truth.float64_twin(model)
    tok = tiny.tokenizer()
    trainer = trainer_cls(
        model=model,
        args=tiny.training_args(
            str(tmp_path / f"{trainer_cls.__name__}-{truth}"),
            max_steps=3,
            gradient_accumulation_steps=1,
            # SGD: the final weights are then linear in the gradients packing must keep. Adam divides each
            # gradient by its own scale, so an element whose gradient is near zero takes a rounding-sized
            # difference up to update size in any run (seen: one of Qwen2's embedding entries 4e-6 from float64
            # on an AVX512-FP16 CPU, the reference by luck 7e-8), and the weights would test Adam, not packing.
            optim="sgd",
        ),
        train_dataset=tiny.dataset(n=8, max_len=24),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    trainer.train()
    return trainer


class _PackingOnly(fasttrain.Trainer):
    def __init__(self, *args, **kwargs):
        paths = fasttrain.HotPaths(optimizer=False, clip=False, loss=False, sampler=False)
        super().__init__(*args, hot_paths=paths, **kwargs)


@pytest.mark.parametrize("kind", sorted(set(_packing.SETTINGS) - {"llama", "qwen3"}))
def test_trainer_packed_matches_padded_every_step(kind, tmp_path):
    ref = _train(kind, tmp_path, transformers.Trainer)
    ours = _train(kind, tmp_path, _PackingOnly)
    truth = _train(kind, tmp_path, transformers.Trainer, truth=True)
    assert ours.fasttrain_status["packing"] == "on", ours.fasttrain_status
    _truth.assert_logs_near_truth(ours, ref, truth, _truth.FP32_STEP, keys=("loss", "grad_norm"))
    _truth.assert_params_near_truth(ours.model, ref.model, truth.model)
