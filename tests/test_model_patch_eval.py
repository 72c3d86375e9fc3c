"""Issue 12: ``trainer.evaluate()["eval_loss"]`` with the fused loss equals transformers' own when eval
batches have no scored token (transformers' loss is NaN there and its evaluation loop leaves them out).

Both trainers are plain ``transformers.Trainer``; the fused one only has the loss wrapper on its model
(``enable_fused_loss`` + ``set_eval_fused``), so this does not depend on fasttrain's Trainer integration.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers

import _tiny
import _truth
from fasttrain.loss.model_patch import enable_fused_loss, fused_loss_calls, set_eval_fused


def _eval_dataset(mask_every: int | None):
    """16 rows, 4 per eval batch; ``mask_every=2``: every other batch has only -100 labels; ``1``: all."""
    ds = _tiny.dataset(n=16, seed=3)

    def mask(row, idx):
        if mask_every is not None and (idx // 4) % mask_every == 0:
            row["labels"] = [-100] * len(row["labels"])
        return row

    return ds.map(mask, with_indices=True)


def _eval_loss(model, dataset, tmp_path, fused: bool) -> float:
    if fused:
        assert enable_fused_loss(model) is None
        set_eval_fused(model, True)
    args = _tiny.training_args(str(tmp_path), per_device_eval_batch_size=4)
    trainer = transformers.Trainer(
        model=model,
        args=args,
        eval_dataset=dataset,
        data_collator=transformers.DataCollatorForSeq2Seq(_tiny.tokenizer(), padding=True),
    )
    loss = trainer.evaluate()["eval_loss"]
    if fused:
        assert fused_loss_calls(model) == 4  # every eval batch took the fused path
    return loss


@pytest.mark.parametrize(
    ("mask_every", "label"), [(None, "none masked"), (2, "half the batches"), (1, "all")]
)
def test_eval_loss_equals_transformers(mask_every, label, tmp_path):
    base = _tiny.model("llama")
    dataset = _eval_dataset(mask_every)
    ref = _eval_loss(copy.deepcopy(base), dataset, tmp_path / "ref", fused=False)
    ours = _eval_loss(copy.deepcopy(base), dataset, tmp_path / "ours", fused=True)
    if mask_every == 1:
        assert math.isnan(ref) and math.isnan(ours), (label, ref, ours)
    else:
        truth = _eval_loss(_truth.float64_twin(base), dataset, tmp_path / "f64", fused=False)
        assert math.isfinite(ref), label
        _truth.assert_scalar_near_truth(f"eval_loss ({label})", ours, ref, truth, _truth.FP32_STEP)


def test_fully_masked_batch_loss_is_nan_like_transformers():
    model = _tiny.model("llama").eval()
    ours = copy.deepcopy(model)
    enable_fused_loss(ours)
    set_eval_fused(ours, True)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        ref = model(input_ids=ids, labels=torch.full_like(ids, -100)).loss
        got = ours(input_ids=ids, labels=torch.full_like(ids, -100)).loss
    assert torch.isnan(ref) and torch.isnan(got)
