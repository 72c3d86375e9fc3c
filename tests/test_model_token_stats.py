"""``model(..., fasttrain_token_stats=labels)``: per-token log-probs of the next label and per-position mean logits
from the fused forward, against the same computed from the unpatched model's full logits (what LLaMA-Factory's
``get_batch_logps`` does: logits cast to fp32, ``log_softmax``, gather, mask) -- values and gradients, each about
as close to the float64 model's as the reference is."""

from __future__ import annotations

import pytest
import torch

import _truth
from _fused_models import batch, trio
from fasttrain.loss.model_patch import disable_fused_loss, fused_loss_usage
from fasttrain.loss.model_token_stats import TOKEN_STATS_KWARG

pytestmark = pytest.mark.numeric


def reference_stats(model, inputs):
    """Per-position log-prob of the next label (0 where ignored and at the last position), its mask, and the
    mean of each position's logits, from the full fp32 logits."""
    labels = inputs["labels"]
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits.float()
    nxt = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    mask = nxt != -100
    logps = torch.gather(logits.log_softmax(-1), 2, nxt.clamp(min=0).unsqueeze(2)).squeeze(2) * mask
    return logps, mask, logits.mean(-1)


def _run(model, inputs, ours: bool):
    if ours:
        labels = inputs["labels"]
        out = model(**{k: v for k, v in inputs.items() if k != "labels"}, **{TOKEN_STATS_KWARG: labels})
        stats = out.log_probs, out.label_mask, out.mean_logits
    else:
        stats = reference_stats(model, inputs)
    weights = torch.linspace(0.5, 1.5, stats[0].shape[-1], dtype=stats[0].dtype)
    (stats[0] * weights).sum().backward()  # a per-token upstream, as DPO's per-sequence one
    return stats


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", ["llama", "qwen3_tied", "gemma2_softcap"])
def test_token_stats_match_the_full_logits(name, autocast):
    ref, ours, truth = trio(name)
    inputs = batch()
    results = {}
    for key, model in (("ref", ref), ("ours", ours), ("truth", truth)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast and key != "truth"):
            results[key] = _run(model, inputs, ours=key == "ours")
    (a_lp, a_mask, a_mean), (b_lp, b_mask, b_mean), (t_lp, t_mask, t_mean) = (
        results["ref"],
        results["ours"],
        results["truth"],
    )
    assert torch.equal(a_mask, b_mask) and torch.equal(b_mask, t_mask)
    assert b_lp.dtype == torch.float32 and b_mean.dtype == torch.float32
    assert bool((b_lp[~b_mask] == 0).all())
    bound = _truth.BF16_STEP if autocast else _truth.FP32_TENSOR
    _truth.assert_tensors_near_truth(
        {"log_probs": b_lp, "mean_logits": b_mean},
        {"log_probs": a_lp, "mean_logits": a_mean},
        {"log_probs": t_lp, "mean_logits": t_mean},
        bound,
    )
    _truth.assert_grads_near_truth(ours, ref, truth, bound)
    assert fused_loss_usage(ours).token_stats == 1 and fused_loss_usage(ours).calls == 0


def test_no_grad_reference_scoring():
    ref, ours, _ = trio("llama")
    inputs = batch()
    with torch.no_grad():
        out = ours(input_ids=inputs["input_ids"], **{TOKEN_STATS_KWARG: inputs["labels"]})
        expected, _, _ = reference_stats(ref, {"input_ids": inputs["input_ids"], "labels": inputs["labels"]})
    assert not out.log_probs.requires_grad
    torch.testing.assert_close(out.log_probs, expected, rtol=1e-5, atol=1e-5)


def test_bad_requests_are_named():
    _, ours, _ = trio("llama")
    inputs = batch()
    with pytest.raises(
        ValueError, match=r"labels of shape \(3, 12\) do not match the input of shape \(3, 13\)"
    ):
        ours(input_ids=inputs["input_ids"], **{TOKEN_STATS_KWARG: inputs["labels"][:, 1:]})
    # the fused forward switched off while a wrapper of its own (Accelerate's autocast) still calls it
    inner = ours.forward
    ours.forward = lambda *a, **k: inner(*a, **k)
    disable_fused_loss(ours)
    with pytest.raises(RuntimeError, match="token log-probs were asked of LlamaForCausalLM while its fused"):
        ours(input_ids=inputs["input_ids"], **{TOKEN_STATS_KWARG: inputs["labels"]})
