"""The fused-loss forward wrapper against the unpatched transformers model: loss and every gradient.

Numbers are compared through the truth: the unpatched model in float64 (``_truth``); the fused loss must be
about as close to it as the unpatched float32 model is."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers

import _truth
from _fused_models import CONFIGS, VOCAB, batch, pair, trio
from fasttrain.families import FAMILIES, fused_loss_classes
from fasttrain.loss.lazy_logits import PendingLogits
from fasttrain.loss.model_patch import (
    disable_fused_loss,
    enable_fused_loss,
    fused_loss_calls,
    fused_loss_enabled,
    set_eval_fused,
)

pytestmark = [pytest.mark.gpu_versions, pytest.mark.numeric]


def took_fused_path(out) -> bool:
    """The forward took the fused loss: its logits are pending, made only if read (test_logits_on_demand.py)."""
    return isinstance(dict.get(out, "logits"), PendingLogits)


def assert_loss_near_truth(ours, ref, truth):
    _truth.assert_scalar_near_truth("loss", float(ours), float(ref), float(truth), _truth.FP32_STEP)


def forward_backward_near_truth(models, inputs, **kwargs):
    """One forward and backward of each of (reference, ours, truth): ours' loss and gradients near the truth."""
    losses = []
    for model in models:
        out = model(**inputs, **kwargs)
        out.loss.backward()
        losses.append(out.loss.detach())
    ref, ours, truth = models
    assert_loss_near_truth(losses[1], losses[0], losses[2])
    _truth.assert_grads_near_truth(ours, ref, truth)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("num_items", [None, 17])
def test_loss_and_grads_equal_unpatched(name, num_items):
    ref, ours, truth = trio(name)
    inputs = batch()
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    with torch.no_grad():  # the fused forward makes no logits (tests/test_logits_on_demand.py reads them)
        assert took_fused_path(ours(**inputs, **extra))
    forward_backward_near_truth((ref, ours, truth), inputs, **extra)


def test_every_claimed_architecture_is_tested():
    tested = {type(make()).__name__ for make in CONFIGS.values()}
    assert tested == fused_loss_classes()
    assert {f.fused_loss for f in FAMILIES if f.causal_lm in tested} == {"tests/test_model_patch.py"}


@pytest.mark.parametrize("num_items", [None, 0])
def test_all_labels_ignored_same_nan_and_grads(num_items):
    # issue 12: the model's own loss is NaN here (0 / 0) and the Trainer's evaluation loop relies on that
    ref, ours = pair("llama")
    inputs = batch()
    inputs["labels"][:] = -100
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    out_ref, out = ref(**inputs, **extra), ours(**inputs, **extra)
    assert torch.isnan(out_ref.loss) and torch.isnan(out.loss)
    assert fused_loss_calls(ours) == 1
    out_ref.loss.backward()
    out.loss.backward()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name  # all zero in both


@pytest.mark.parametrize("name", ["llama", "gemma2_softcap", "gemma3_softcap"])
def test_shift_labels(name):
    models = trio(name)
    inputs = batch(seed=1)
    labels = inputs.pop("labels")
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    shift[2, :3] = -100
    forward_backward_near_truth(models, inputs, labels=labels, shift_labels=shift)


def test_gradient_checkpointing():
    models = trio("qwen3")
    for m in models:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.config.use_cache = False
    forward_backward_near_truth(models, batch(seed=2))


def test_paths_that_keep_logits():
    ref, ours, truth = trio("llama")
    inputs = batch()
    # no labels: logits, no loss
    no_labels = {k: v for k, v in inputs.items() if k != "labels"}
    out = ours(**no_labels)
    assert out.loss is None and torch.equal(out.logits, ref(**no_labels).logits)  # the model's own path
    # evaluation keeps logits unless told the loss is all that is needed
    ref.eval()
    ours.eval()
    truth.eval()
    with torch.no_grad():
        expected, exact = ref(**inputs).loss, truth(**inputs).loss
        kept = ours(**inputs)
        assert not took_fused_path(kept) and kept.logits is not None
        assert_loss_near_truth(kept.loss, expected, exact)
        set_eval_fused(ours, True)
        fused = ours(**inputs)
        assert took_fused_path(fused)
        assert_loss_near_truth(fused.loss, expected, exact)
        set_eval_fused(ours, False)
        assert not took_fused_path(ours(**inputs))
        # return_dict=False and logits_to_keep go to the model's own path
        assert ours.train()(**inputs, return_dict=False)[1] is not None
        assert ours(**no_labels, logits_to_keep=1).logits.shape[1] == 1
    # generation
    ours.eval()
    gen = ours.generate(inputs["input_ids"][:1, :4], max_new_tokens=3, do_sample=False)
    ref_gen = ref.generate(inputs["input_ids"][:1, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(gen, ref_gen)


def test_disable_restores_exactly_and_enable_is_idempotent():
    torch.manual_seed(0)
    model = CONFIGS["llama"]()
    assert "forward" not in model.__dict__
    assert enable_fused_loss(model) is None
    first = model.forward
    assert enable_fused_loss(model) is None and model.forward is first
    disable_fused_loss(model)
    assert "forward" not in model.__dict__ and not fused_loss_enabled(model)
    assert type(model).forward is transformers.LlamaForCausalLM.forward  # the class is never touched
    out = model(**batch())
    assert out.logits is not None


def test_unsupported_models_keep_their_path(caplog):
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2)
    )
    with caplog.at_level(logging.DEBUG, logger="fasttrain"):
        reason = enable_fused_loss(gpt2)
    assert reason is not None and "GPT2LMHeadModel" in reason
    assert not fused_loss_enabled(gpt2) and "forward" not in gpt2.__dict__
    assert not [r for r in caplog.records if r.name.startswith("fasttrain")]  # the caller reports it, once

    llama = CONFIGS["llama"]()
    llama.lm_head = torch.nn.Sequential(llama.lm_head)
    assert "nn.Linear" in enable_fused_loss(llama)


def test_custom_loss_function_keeps_own_path():
    _, ours = pair("llama")

    def my_loss(logits, labels, vocab_size, **kwargs):
        return logits.float().pow(2).mean()

    ours.loss_function = my_loss
    out = ours(**batch())
    assert out.logits is not None and torch.allclose(out.loss, my_loss(out.logits, None, VOCAB))


def test_bf16_model_within_bf16_precision():
    ref, ours, _ = trio("gemma2_softcap")
    # the truth: the same bf16 weights, exactly, in float64
    ref.to(torch.bfloat16)
    ours.to(torch.bfloat16)
    truth = _truth.float64_twin(ref)
    # the reference rounds logits (and the softcap) to bf16 before its fp32 loss; we softcap in fp32
    bound = _truth.BF16_STORED
    losses = []
    for model in (ref, ours, truth):
        out = model(**batch(seed=4))
        out.loss.backward()
        losses.append(float(out.loss.detach()))
    _truth.assert_scalar_near_truth("loss", losses[1], losses[0], losses[2], bound)
    _truth.assert_grads_near_truth(ours, ref, truth, bound)


def test_peft_lora():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = CONFIGS["llama"]()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    ref = peft.get_peft_model(copy.deepcopy(base), cfg)
    ours = peft.get_peft_model(copy.deepcopy(base), cfg)
    ours.load_state_dict(ref.state_dict())
    truth = _truth.float64_twin(ref)
    assert enable_fused_loss(ours) is None and fused_loss_enabled(ours)
    for model in (ref, ours, truth):
        model.train()
    with torch.no_grad():
        assert took_fused_path(ours(**batch()))
    forward_backward_near_truth((ref, ours, truth), batch())
    # LoRA on the output layer itself: not a plain Linear any more
    with_head = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    assert "nn.Linear" in enable_fused_loss(with_head)


class _LossLog(transformers.TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def _train(model, tmp_path, enable):
    from datasets import Dataset

    g = torch.Generator().manual_seed(7)
    rows = []
    for i in range(16):
        n = 5 + (i * 3) % 9
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        labels = [-100] * (i % 3) + ids[i % 3 :]
        rows.append({"input_ids": ids, "labels": labels})
    ds = Dataset.from_list(rows)
    if enable:
        assert enable_fused_loss(model) is None
    log = _LossLog()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        max_steps=2,
        logging_steps=1,
        learning_rate=0.5,
        optim="sgd",
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    class _Pad:  # right padding by hand (the transformers collators need a tokenizer)
        def __call__(self, features):
            width = max(len(f["input_ids"]) for f in features)
            ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features])
            lab = torch.tensor([f["labels"] + [-100] * (width - len(f["labels"])) for f in features])
            mask = torch.tensor(
                [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
            )
            return {"input_ids": ids, "labels": lab, "attention_mask": mask}

    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=ds, data_collator=_Pad(), callbacks=[log]
    )
    trainer.train()
    return log.losses, model


def test_trainer_gradient_accumulation_same_logged_loss(tmp_path):
    torch.manual_seed(0)
    base = CONFIGS["qwen3"]()
    ref_losses, ref_model = _train(copy.deepcopy(base), tmp_path / "ref", enable=False)
    our_losses, our_model = _train(copy.deepcopy(base), tmp_path / "ours", enable=True)
    truth_losses, truth_model = _train(_truth.float64_twin(base), tmp_path / "f64", enable=False)
    assert len(ref_losses) == len(our_losses) == len(truth_losses) == 2
    for step, (b, a, t) in enumerate(zip(our_losses, ref_losses, truth_losses, strict=True), start=1):
        _truth.assert_scalar_near_truth(f"step {step} loss", b, a, t, _truth.FP32_STEP)
    # the weights after two SGD steps over accumulated gradients (at lr 0.5 the second step's gradients
    # depend on the first step's rounding, so the change is not linear in them: compare with the truth)
    _truth.assert_params_near_truth(our_model, ref_model, truth_model)
