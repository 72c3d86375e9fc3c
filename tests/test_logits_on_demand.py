"""Logits on demand (issue 31): the fused forward's output computes the logits when someone reads them, exactly as
the unpatched forward does; a Trainer subclass keeps the fused loss and clip when its overrides end in the
Trainer's own; the fused loss is switched off for a trainer whose loss needs the logits every step; after training
(and after ``fasttrain.unpatch()``) the model's own forward answers.

"Exactly": the pending logits are the output layer applied to the very hidden states the backbone returned, under
the autocast the forward ran in, so they are the unpatched forward's bit for bit, and so are the gradients of any
function of them.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import transformers
from accelerate.utils import convert_to_fp32
from torch.utils import _pytree as pytree

import _tiny as tiny
import _truth
import fasttrain
from _fused_models import CONFIGS  # every family the fused loss claims
from fasttrain.integration.loss import DECIDING_STEPS, fused_forwards
from fasttrain.loss.lazy_logits import LazyLogitsOutput, PendingLogits
from fasttrain.loss.model_patch import disable_fused_loss, enable_fused_loss, fused_loss_usage

pytestmark = pytest.mark.dropin


def _batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, 11), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _pair(name: str):
    ref = CONFIGS[name]()
    ours = copy.deepcopy(ref)
    assert enable_fused_loss(ours) is None
    return ref.train(), ours.train()


def _pending(out) -> bool:
    return isinstance(dict.get(out, "logits"), PendingLogits)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_read_after_the_forward_are_the_unpatched_ones(name, autocast):
    ref, ours = _pair(name)
    inputs = _batch(ref.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected = ref(**inputs)
        out = ours(**inputs)
    assert isinstance(out, LazyLogitsOutput) and _pending(out)  # the forward made none
    # read outside the autocast region: still computed under the forward's
    logits = out.logits
    assert logits.dtype == expected.logits.dtype and torch.equal(logits, expected.logits)
    # a loss of the caller's own from the logits: the same gradients, bit for bit
    for value in (expected.logits, logits):
        (value.float().log_softmax(-1)[..., 5].sum() + value.float().square().mean()).backward()
    for (param, a), b in zip(ref.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), param


def test_every_way_of_reading_gives_the_same_tensor_once():
    ref, ours = _pair("llama")
    inputs = _batch(ref.config.vocab_size)
    expected = ref(**inputs).logits
    for read in (
        lambda o: o.logits,
        lambda o: o["logits"],
        lambda o: o.get("logits"),
        lambda o: o[1],
        lambda o: o.to_tuple()[1],
    ):
        out = ours(**inputs)
        first = read(out)
        assert torch.equal(first, expected)
        assert out.logits is first and out["logits"] is first and not _pending(out)
    assert fused_loss_usage(ours).logits_reads == 5  # each output's logits computed once


def test_logits_keep_the_grad_mode_of_their_forward_not_of_their_read():
    """Read under no_grad (an eval callback, a metric) the logits of a training forward still carry its graph, as
    the unpatched forward's do; those of a no_grad forward read later carry none."""
    ref, ours = _pair("qwen3")
    inputs = _batch(ref.config.vocab_size)
    trained = ours(**inputs)
    with torch.no_grad():
        evaluated = ours(**inputs)
        logits = trained.logits
    assert logits.requires_grad and torch.equal(logits, ref(**inputs).logits)
    assert not evaluated.logits.requires_grad


def test_the_loss_read_alone_computes_no_logits():
    ref, ours = _pair("qwen3")
    inputs = _batch(ref.config.vocab_size)
    out = ours(**inputs)
    out.loss.backward()
    assert out["loss"] is out.loss and out[0] is out.loss and list(out.keys())[:2] == ["loss", "logits"]
    usage = fused_loss_usage(ours)
    assert (usage.calls, usage.logits_reads, usage.loss_backwards) == (1, 0, 1) and _pending(out)


def test_pending_logits_travel_through_accelerate_fp32_conversion_and_pytree():
    """Accelerate's mixed-precision wrapper rebuilds the output with its bf16 tensors made fp32; DDP and FSDP2
    flatten and unflatten it as a pytree. The pending logits go through both unevaluated, and the fp32 copy
    Accelerate asked for is what reading them gives."""
    ref, ours = _pair("qwen3")
    inputs = _batch(ref.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = convert_to_fp32(ref(**inputs))
        out = convert_to_fp32(ours(**inputs))
    assert type(out) is LazyLogitsOutput and _pending(out)
    leaves, spec = pytree.tree_flatten(out)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert type(rebuilt) is LazyLogitsOutput and _pending(rebuilt)
    assert rebuilt.logits.dtype == torch.float32 and torch.equal(rebuilt.logits, expected.logits)


def test_deepspeed_zero3_output_walk_passes_the_pending_logits_through():
    """ZeRO-3's forward hooks put every tensor of a module's output through an autograd function, walking it by
    keys() and output[key] = f(output[key]). The pending logits are no tensor yet: they pass through unread, the
    loss gets wrapped, and reading the logits afterwards still gives the unpatched forward's."""
    zero_utils = pytest.importorskip("deepspeed.runtime.zero.utils", reason="DeepSpeed is Linux-only")
    ref, ours = _pair("qwen3")
    inputs = _batch(ref.config.vocab_size)
    out = ours(**inputs)
    wrapped = []
    walked = zero_utils.apply_to_tensors_only(lambda t: wrapped.append(t) or t * 1, out)
    assert walked is out and _pending(out) and fused_loss_usage(ours).logits_reads == 0
    assert [t.shape for t in wrapped] == [out.loss.shape]  # the loss went through, the pending logits did not
    assert torch.equal(out.logits, ref(**inputs).logits) and fused_loss_usage(ours).logits_reads == 1


def test_walking_the_output_s_dataclass_fields_computes_no_logits():
    """FSDP2 collects the tensors that need gradients by walking dataclass fields with getattr (DDP its dict
    values): neither may compute the logits. A copy or a pickle is the plain output, logits computed."""
    ref, ours = _pair("llama")
    inputs = _batch(ref.config.vocab_size)
    out = ours(**inputs)
    walked = [getattr(out, f.name) for f in dataclasses.fields(out)] + list(out.values())
    assert _pending(out) and any(t is out.loss for t in walked)
    with torch.no_grad():  # a tensor in an autograd graph cannot be deep-copied, from any output
        out = ours(**inputs)
        copied = copy.deepcopy(out)
        assert type(copied) is transformers.modeling_outputs.CausalLMOutputWithPast
        assert torch.equal(copied.logits, ref(**inputs).logits) and torch.equal(copied.loss, out.loss)


def test_no_logits_are_made_for_calls_the_fused_path_does_not_take():
    ref, ours = _pair("llama")
    inputs = _batch(ref.config.vocab_size)
    inputs.pop("labels")
    out = ours(**inputs)
    assert type(out) is not LazyLogitsOutput and torch.equal(out.logits, ref(**inputs).logits)


# ---- through the Trainer ---------------------------------------------------------------------------------------


def _trainer(cls, tmp_path, model=None, **overrides):
    tok = tiny.tokenizer()
    return cls(
        model=model if model is not None else tiny.model("llama"),
        args=tiny.training_args(str(tmp_path), max_steps=3, **overrides),
        train_dataset=tiny.dataset(with_length=True),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )


class PassesThrough(transformers.Trainer):
    """A subclass whose overrides end in the Trainer's own, as Axolotl's and LLaMA-Factory's do by default."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.calls = getattr(self, "calls", 0) + 1
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        return super()._clip_grad_norm(model)


class ReadsLogits(transformers.Trainer):
    """A subclass whose loss needs the logits: its own cross-entropy, smoothed, from ``outputs.logits``."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        logits = outputs.logits.float()[:, :-1]
        labels = inputs["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), label_smoothing=0.1
        )
        return (loss, outputs) if return_outputs else loss


class ReadsLogitsOnce(transformers.Trainer):
    """A subclass that looks at the logits on its first call only (say, to log them): the fused loss stays."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        if not getattr(self, "looked", False):
            self.looked = float(outputs.logits.detach().float().mean())
        return (loss, outputs) if return_outputs else loss


def _three_runs(cls, tmp_path, **overrides):
    """(reference, fasttrain under patch(), float64 truth) of ``cls``."""
    ref = _trainer(cls, tmp_path / "ref", **overrides)
    ref.train()
    truth = _trainer(cls, tmp_path / "f64", model=_truth.float64_twin(tiny.model("llama")), **overrides)
    truth.train()
    fasttrain.patch()
    try:
        ours = _trainer(cls, tmp_path / "ours", **overrides)
        ours.train()
    finally:
        fasttrain.unpatch()
    return ref, ours, truth


@pytest.mark.skipif(not tiny.FUSED_CLIP, reason="this transformers has no Trainer._clip_grad_norm")
def test_overrides_that_end_in_the_trainer_keep_the_fused_loss_and_clip(tmp_path):
    ref, ours, truth = _three_runs(PassesThrough, tmp_path)
    _truth.assert_logs_near_truth(ours, ref, truth, _truth.FP32_STEP, keys=("loss", "grad_norm"))
    status = ours.fasttrain_status
    assert status["loss"] == "on" and status["clip"] == "on" and status["optimizer"] == "on", status
    assert ours.calls == 3 * 2 and fused_forwards(ours) == 3 * 2  # every micro-batch took the fused loss


def test_a_loss_that_reads_the_logits_every_step_switches_the_fused_loss_off(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="fasttrain"):
        ref, ours, truth = _three_runs(ReadsLogits, tmp_path)
    # the logits of the fused forwards were computed on demand, exactly: every step as close to the truth
    _truth.assert_logs_near_truth(ours, ref, truth, _truth.FP32_STEP, keys=("loss", "grad_norm"))
    assert fused_forwards(ours) == DECIDING_STEPS  # the first two micro-batches, then the model's own forward
    reason = (
        f"ReadsLogits.compute_loss read the logits of every fused forward in the first {DECIDING_STEPS} "
        "training steps: the model computes them in its own forward from now on"
    )
    assert ours.fasttrain_status["loss"] == f"off: {reason}"
    assert sum(reason in r.getMessage() for r in caplog.records) == 1  # said once


def test_logits_read_once_keep_the_fused_loss(tmp_path):
    ref, ours, truth = _three_runs(ReadsLogitsOnce, tmp_path)
    _truth.assert_logs_near_truth(ours, ref, truth, _truth.FP32_STEP, keys=("loss", "grad_norm"))
    assert ours.looked == pytest.approx(ref.looked, rel=1e-6, abs=1e-7)
    assert ours.fasttrain_status["loss"] == "on" and fused_forwards(ours) == 3 * 2


def _user_logits_after_training(trainer) -> torch.Tensor | None:
    """The issue's script: the user's model, left in train mode by the Trainer, called with labels."""
    batch = transformers.DataCollatorForSeq2Seq(tiny.tokenizer(), padding=True)(
        [tiny.dataset()[i] for i in range(2)]
    )
    assert trainer.model.training
    return trainer.model(**batch).logits


def test_after_train_the_model_returns_its_logits(tmp_path):
    model = tiny.model("llama")
    had_forward = "forward" in vars(model)
    trainer = _trainer(fasttrain.Trainer, tmp_path, model=model)
    assert "forward" not in vars(model) or had_forward  # nothing on the model before training
    trainer.train()
    assert trainer.fasttrain_status["loss"] == "on"
    logits = _user_logits_after_training(trainer)
    assert isinstance(logits, torch.Tensor) and logits.shape[-1] == tiny.VOCAB
    assert ("forward" in vars(model)) == had_forward  # the model's own forward, exactly
    trainer.train()  # a second run takes the fused path again
    assert fused_forwards(trainer) == 2 * 3 * 2


def test_after_unpatch_the_model_returns_its_logits(tmp_path):
    fasttrain.patch()
    try:
        trainer = _trainer(transformers.Trainer, tmp_path)
        trainer.train()
    finally:
        fasttrain.unpatch()
    assert isinstance(_user_logits_after_training(trainer), torch.Tensor)


def test_unpatch_during_training_restores_the_model_s_forward(tmp_path):
    class UnpatchAtStep2(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                fasttrain.unpatch()
                self.forward_on_model = "forward" in vars(model)

    callback = UnpatchAtStep2()
    fasttrain.patch()
    try:
        trainer = _trainer(transformers.Trainer, tmp_path)
        trainer.add_callback(callback)
        trainer.train()
    finally:
        fasttrain.unpatch()
    assert callback.forward_on_model is False
    assert fused_forwards(trainer) == 2 * 2  # steps 1 and 2 fused, step 3 the model's own forward
    assert isinstance(_user_logits_after_training(trainer), torch.Tensor)


def test_a_fused_loss_switched_on_by_hand_is_reported_on(tmp_path):
    """The status says what ran: the fused loss switched on some other way than fasttrain's loss path."""
    model = tiny.model("llama")
    assert enable_fused_loss(model) is None
    try:
        trainer = fasttrain.Trainer(
            model=model,
            args=tiny.training_args(str(tmp_path / "hand"), max_steps=2),
            train_dataset=tiny.dataset(),
            data_collator=transformers.DataCollatorForSeq2Seq(tiny.tokenizer(), padding=True),
            hot_paths=fasttrain.HotPaths(loss=False),
        )
        trainer.train()
    finally:
        disable_fused_loss(model)
    assert trainer.fasttrain_status["loss"] == "on"
