"""fasttrain.Trainer against transformers.Trainer on one GPU, the kernels compiled: the loss and grad_norm logged at
every step and (fp32) the trained weights, each within the float64-anchored bound of ``_truth``: fasttrain about as
close to the reference Trainer on the float64 twin of the model as the reference is.

A 2-layer Qwen3 with Qwen3's 151,936-token vocabulary (the fused loss spans many vocabulary blocks), hidden 512,
prompt-masked rows of up to 512 tokens, gradient accumulation 2, clipping at 1.0, 8 steps: grouped by length in fp32
and under bf16 autocast, and ungrouped in fp32, where fasttrain packs batches of mixed lengths into one row under
CUDA's sdpa while the reference pads (no attention across examples, the loss's denominator kept). Every hot path
the case is about must say "on".
"""

from __future__ import annotations

import pytest
import torch
import transformers

import _tiny as tiny
import _truth
import fasttrain

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the Trainer on a GPU: needs a CUDA device"),
]

SHAPE = dict(vocab_size=151_936, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip
RUN = dict(use_cpu=False, max_steps=8, learning_rate=1e-3, max_grad_norm=1.0)


def _train(trainer_cls, tmp_path, grouped: bool, bf16: bool = False, truth: bool = False):
    """``truth``: the reference Trainer on the float64 twin of the same model, without autocast."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny.config("qwen3", **SHAPE))
    if truth:
        trainer_cls, model = transformers.Trainer, _truth.float64_twin(model)
    tok = tiny.tokenizer()
    out = str(tmp_path / f"{trainer_cls.__module__}-{truth}")
    grouping = tiny.grouping_args() if grouped else {}
    trainer = trainer_cls(
        model=model,
        args=tiny.training_args(out, bf16=bf16, **RUN, **grouping),
        train_dataset=tiny.dataset(n=64, max_len=512, with_length=True),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    "bf16, grouped", [(False, True), (True, True), (False, False)], ids=["fp32", "bf16", "fp32-packed"]
)
def test_fasttrain_trains_as_the_reference_on_the_gpu(bf16, grouped, tmp_path):
    ref = _train(transformers.Trainer, tmp_path, grouped, bf16)
    ours = _train(fasttrain.Trainer, tmp_path, grouped, bf16)
    truth = _train(None, tmp_path, grouped, truth=True)
    bound = _truth.BF16_STEP if bf16 else _truth.FP32_STEP
    _truth.assert_logs_near_truth(ours, ref, truth, bound, keys=("loss", "grad_norm"))
    if not bf16:  # bf16 autocast rounds every matmul: the weights' distance says nothing the logs do not
        _truth.assert_params_near_truth(ours.model, ref.model, truth.model)
    status = dict(ours.fasttrain_status)
    if grouped:  # batches of near-equal lengths may stay padded where a packed row would cost more
        packing = status.pop("packing")
        assert packing == "on" or packing.startswith("off: every batch stayed padded"), packing
    else:  # no length-grouped sampler to replace; packing must have run
        assert status.pop("sampler") == "off: group_by_length is not set"
    assert set(status.values()) == {"on"}, ours.fasttrain_status
