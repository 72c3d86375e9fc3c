"""Where a hot path cannot apply, it falls back to transformers' own code, says why in the status, and logs it once.

DeepSpeed and FSDP do not run on this CPU machine: the clip decisions for them are pinned on a real Trainer
whose Accelerator flags are set by hand. Everything else runs end to end against transformers itself.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
import transformers
from accelerate.utils import DistributedType

import _tiny as tiny
import _truth
import fasttrain
from fasttrain import FusedAdamW, HotPaths, integration
from fasttrain.integration import clip as clip_path
from fasttrain.integration import optimizer as optimizer_path
from fasttrain.optim import options as optim_options

pytestmark = [pytest.mark.dropin, pytest.mark.gpu_versions]


def _trainer(tmp_path, cls=fasttrain.Trainer, model=None, data_collator=None, **arg_overrides):
    tok = tiny.tokenizer()
    return cls(
        model=model or tiny.model("llama"),
        args=tiny.training_args(str(tmp_path), **{"max_steps": 2, **arg_overrides}),
        train_dataset=tiny.dataset(with_length=True),
        data_collator=data_collator or transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )


@pytest.fixture
def clip_decision(tmp_path):
    """A Trainer holding a FusedAdamW, with Accelerator flags the test sets: (trainer, decide())."""
    trainer = _trainer(tmp_path)
    trainer.optimizer = types.SimpleNamespace(
        optimizer=FusedAdamW(trainer.model.parameters())
    )  # Accelerate's wrap
    trainer.accelerator = types.SimpleNamespace(
        distributed_type=DistributedType.NO, scaler=None, is_fsdp2=False
    )
    return trainer, lambda: clip_path._fused_clip_target(
        trainer, list(trainer.model.parameters()), clipping=True
    )


def test_the_fused_clip_applies_on_a_plain_run(clip_decision):
    trainer, decide = clip_decision
    assert decide() is trainer.optimizer.optimizer


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        # DeepSpeed is decided once, at construction (its clip hook is never installed): tests/test_deepspeed.py
        (dict(distributed_type=DistributedType.FSDP), "FSDP1 clips through its own wrapper"),
        (dict(scaler=object()), "fp16 GradScaler: Accelerate unscales the gradients before clipping"),
        (
            dict(distributed_type=DistributedType.XLA),
            "distributed type XLA is not supported by the fused clip",
        ),
    ],
)
def test_the_clip_falls_back_where_accelerate_clips_its_own_way(clip_decision, flags, reason):
    trainer, decide = clip_decision
    vars(trainer.accelerator).update(flags)
    assert decide() is None
    assert trainer.fasttrain_status["clip"] == f"off: {reason}"


def test_fsdp2_fuses_the_clip(clip_decision):
    trainer, decide = clip_decision
    vars(trainer.accelerator).update(distributed_type=DistributedType.FSDP, is_fsdp2=True)
    assert decide() is trainer.optimizer.optimizer


def test_parameters_outside_the_optimizer_keep_the_reference_clip(clip_decision):
    trainer, decide = clip_decision
    trainer.optimizer.optimizer = FusedAdamW(trainer.model.lm_head.parameters())
    assert decide() is None
    assert (
        trainer.fasttrain_status["clip"]
        == "off: the clipped parameters are not the ones the optimizer updates"
    )


def test_optimizer_parameters_outside_the_clip_keep_the_reference_clip(clip_decision):
    # the fused norm would also count these gradients, which the Trainer's clip leaves out
    trainer, _ = clip_decision
    for p in trainer.model.parameters():
        p.grad = torch.ones_like(p)
    clipped = list(trainer.model.model.parameters())
    assert clip_path._fused_clip_target(trainer, clipped, clipping=True) is None
    assert (
        trainer.fasttrain_status["clip"]
        == "off: the clipped parameters are not the ones the optimizer updates"
    )
    trainer.model.lm_head.weight.grad = None  # the parameter left out has no gradient: its norm term is 0
    assert clip_path._fused_clip_target(trainer, clipped, clipping=True) is trainer.optimizer.optimizer


class _GradNormProbe(transformers.TrainerCallback):
    """Reads the gradients between the clip and the step, as a user's callback may."""

    def __init__(self):
        self.norms = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))


def test_a_callback_reading_gradients_sees_them_clipped_as_under_transformers(tmp_path, caplog):
    probes = []
    # the reference, the float64 truth (the reference on a float64 twin), then fasttrain
    runs = [
        (transformers.Trainer, None),
        (transformers.Trainer, _truth.float64_twin(tiny.model("llama"))),
        (fasttrain.Trainer, None),
    ]
    for index, (cls, model) in enumerate(runs):
        trainer = _trainer(tmp_path / str(index), cls, model=model, max_grad_norm=0.01)
        probes.append(_GradNormProbe())
        trainer.add_callback(probes[-1])
        with caplog.at_level(logging.INFO, logger="fasttrain"):
            trainer.train()
    ref, truth, ours = probes
    assert ref.norms == pytest.approx([0.01] * 2, rel=1e-3)  # the probe does see clipped gradients
    assert len(ours.norms) == len(ref.norms) == len(truth.norms)
    for step, (b, a, t) in enumerate(zip(ours.norms, ref.norms, truth.norms, strict=True), start=1):
        _truth.assert_scalar_near_truth(f"step {step} clipped gradient norm", b, a, t, _truth.FP32_STEP)
    assert trainer.fasttrain_status["clip"] == (
        "off: callback _GradNormProbe.on_pre_optimizer_step reads gradients between the clip and the step"
        if tiny.FUSED_CLIP
        else tiny.all_on_status()["clip"]
    )
    assert trainer.fasttrain_status["optimizer"] == "on"
    status_lines = [r for r in caplog.records if "fasttrain hot paths" in r.getMessage()]
    assert len(status_lines) == 1 and status_lines[0].levelno == logging.WARNING
    # the clip falls back at every step: said once, in the status line (not again on its own at step 2)
    reason = trainer.fasttrain_status["clip"].removeprefix("off: ")
    assert len([r for r in caplog.records if reason in r.getMessage()]) == 1


@pytest.mark.skipif(not tiny.FUSED_CLIP, reason="this transformers has no Trainer._clip_grad_norm at all")
def test_a_transformers_whose_private_clip_hook_changed_keeps_its_clip(tmp_path, monkeypatch):
    # another transformers: the private method the fused clip hooks has another signature
    clip_calls = []

    def _clip_grad_norm(self, model, norm_type=2.0):
        clip_calls.append(1)
        return self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    monkeypatch.setattr(transformers.Trainer, "_clip_grad_norm", _clip_grad_norm)
    trainer = _trainer(tmp_path)
    trainer.train()
    assert trainer.fasttrain_status["clip"] == (
        f"off: Trainer._clip_grad_norm in transformers {transformers.__version__} has another signature"
    )
    assert len(clip_calls) == 2 and trainer.fasttrain_status["optimizer"] == "on"


def test_a_subclass_with_its_own_sampler_keeps_it(tmp_path):
    class MySampling(transformers.Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    fasttrain.patch()
    try:
        trainer = _trainer(tmp_path, MySampling, train_sampling_strategy="group_by_length")
    finally:
        fasttrain.unpatch()
    trainer.train()
    assert trainer.fasttrain_status["sampler"] == "off: MySampling overrides _get_train_sampler"


def test_optimizer_blockers(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path / "sgd", optim="sgd")
    trainer.train()
    assert trainer.fasttrain_status["optimizer"] == "off: optim=sgd is not an AdamW fasttrain replaces"
    assert trainer.fasttrain_status["clip"] in (
        "off: the optimizer is not fasttrain's FusedAdamW",
        tiny.all_on_status()["clip"],
    )
    assert type(trainer.optimizer.optimizer) is torch.optim.SGD

    tok = tiny.tokenizer()
    trainer = fasttrain.Trainer(
        model=tiny.model("llama"),
        args=tiny.training_args(str(tmp_path / "given"), max_steps=1),
        train_dataset=tiny.dataset(),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": 1e-3}),
    )
    trainer.train()
    assert trainer.fasttrain_status["optimizer"] == "off: the Trainer was given optimizer_cls_and_kwargs"
    assert type(trainer.optimizer.optimizer) is torch.optim.AdamW

    # DeepSpeed itself does not run here (tests/test_deepspeed.py runs it): its flag and config decide. Without
    # an `optimizer` section FusedAdamW is DeepSpeed's client optimizer; with one, DeepSpeed's config chose.
    trainer = _trainer(tmp_path / "ds")
    seam = integration.seam_of(trainer)
    seam.deepspeed = {}  # what apply() reads from a trainer under DeepSpeed
    assert optimizer_path.fused_adamw_kwargs(trainer, seam, trainer.model) is not None
    seam.deepspeed = {"optimizer": {"type": "AdamW", "params": {}}}
    assert optimizer_path.fused_adamw_kwargs(trainer, seam, trainer.model) is None
    assert trainer.fasttrain_status["optimizer"] == (
        "off: DeepSpeed's config chose the optimizer (its `optimizer` section)"
    )


def test_optim_args_reach_fused_adamw(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTTRAIN_OPTIM_ARGS", "amsgrad=true,backend=triton")
    args = tiny.training_args(str(tmp_path), optim_args="backend=torch, maximize=false")
    assert optim_options.fused_adamw_options(args) == {"amsgrad": True, "backend": "torch", "maximize": False}
    with pytest.raises(ValueError, match="'betas2' is not an option of fasttrain's AdamW"):
        optim_options.fused_adamw_options(tiny.training_args(str(tmp_path), optim_args="betas2=0.9"))
    with pytest.raises(ValueError, match="amsgrad='maybe'"):
        optim_options.fused_adamw_options(tiny.training_args(str(tmp_path), optim_args="amsgrad=maybe"))
    trainer = _trainer(tmp_path, optim_args="amsgrad=true")
    trainer.train()
    assert trainer.optimizer.optimizer.param_groups[0]["amsgrad"] is True


@pytest.mark.parametrize(
    ("optim_args", "message"),
    [
        # in the user's words: the value typed, the values that exist, the optim by its name
        ("state_dtype=9bit", r"optim_args: state_dtype='9bit': use param \(.*\), float32 or 8bit$"),
        (
            "betas2=0.9",
            r"optim_args: 'betas2' is not an option of fasttrain's AdamW \(optim='adamw_torch_fused'\)",
        ),
        ("backend=cuda", r"optim_args: backend='cuda': backend: backend must be one of"),
    ],
)
def test_bad_optim_args_fail_at_construction_in_the_users_terms(tmp_path, optim_args, message):
    with pytest.raises(ValueError, match=message):
        _trainer(tmp_path, optim="adamw_torch_fused", optim_args=optim_args)  # not at train(), after set-up


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
def test_status_line_is_info_when_nothing_fell_back(tmp_path, caplog, max_grad_norm):
    # no grouping asked: the sampler is off, but nothing the user wanted fell back
    if max_grad_norm and not tiny.FUSED_CLIP:
        pytest.skip("the clip falls back on this transformers: a WARNING is right")
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        _trainer(tmp_path, max_grad_norm=max_grad_norm).train()
    lines = [r for r in caplog.records if r.name == "fasttrain"]
    # other INFO lines (FusedAdamW's backend choice) are logged once per process: only the first test says them
    assert {r.levelno for r in lines} == {logging.INFO}, [r.getMessage() for r in lines]
    status = [r.getMessage() for r in lines if "optimizer=" in r.getMessage()]
    assert len(status) == 1 and "sampler=off: group_by_length is not set" in status[0]


def test_an_unsupported_model_is_reported_once(tmp_path, caplog):
    config = transformers.GPT2Config(vocab_size=tiny.VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        trainer = _trainer(tmp_path, model=transformers.GPT2LMHeadModel(config))
        trainer.train()
    assert trainer.fasttrain_status["loss"].startswith(
        "off: GPT2LMHeadModel is not a causal LM the fused loss knows"
    )
    mentions = [r for r in caplog.records if "GPT2LMHeadModel" in r.getMessage()]
    assert len(mentions) == 1 and mentions[0].levelno == logging.WARNING


def test_label_smoothing_is_named_as_why_the_loss_is_off(tmp_path):
    """The Trainer smooths the loss from the logits (it takes the labels out of the inputs): the status says so,
    not "no labels"."""
    trainer = _trainer(tmp_path, label_smoothing_factor=0.1)
    trainer.train()
    assert trainer.fasttrain_status["loss"] == (
        "off: label_smoothing_factor=0.1: the Trainer computes the smoothed loss from the logits"
    )


def test_a_compute_loss_func_is_named_as_why_the_loss_is_off(tmp_path):
    """The Trainer hands the logits to the user's compute_loss_func (it takes the labels out of the inputs): the
    status says the function computes the loss, not that the forwards had no labels."""

    def compute_loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1].float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())

    trainer = _trainer(tmp_path)
    trainer.compute_loss_func = compute_loss_func
    trainer.train()
    assert trainer.fasttrain_status["loss"] == (
        "off: the compute_loss_func given to the Trainer computes the loss from the logits, so the fused loss is off"
    )


def test_llamafactorys_collator_padded_in_rust_is_named_as_why_packing_is_off(tmp_path):
    """fasttrain's twin of a LLaMA-Factory collator is named for what it is, not as a collator fasttrain does not
    know. The class stands in for LLaMA-Factory's (its CLI runs in tests/test_client_llamafactory.py)."""
    from fasttrain.data.llamafactory_collators import twin_of

    theirs = type(
        "SFTDataCollatorWith4DAttentionMask",
        (transformers.DataCollatorForSeq2Seq,),
        {"__module__": "llamafactory.data.collator"},
    )
    twin = twin_of(theirs(tiny.tokenizer(), padding=True))
    assert twin is not None and type(twin).__module__.startswith("fasttrain.")
    trainer = _trainer(tmp_path, data_collator=twin)
    assert trainer.data_collator is twin
    assert trainer.fasttrain_status["packing"] == (
        "off: LLaMA-Factory's SFTDataCollatorWith4DAttentionMask (padded in Rust by fasttrain) finishes its "
        "batches itself after the padding (they are kept as they are)"
    )


def test_a_fallback_decided_after_the_status_line_is_logged_once(tmp_path, caplog):
    trainer = _trainer(tmp_path)
    trainer.train()
    seam = integration.seam_of(trainer)
    with caplog.at_level(logging.WARNING, logger="fasttrain"):
        for _ in range(3):
            seam.off("clip", "a reason only this test gives")
    assert len([r for r in caplog.records if "a reason only this test gives" in r.getMessage()]) == 1
    assert trainer.fasttrain_status["clip"] == "off: a reason only this test gives"


def test_switched_off_paths_are_not_fallbacks(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        trainer = fasttrain.Trainer(
            model=tiny.model("llama"),
            args=tiny.training_args(str(tmp_path), max_steps=1),
            train_dataset=tiny.dataset(),
            data_collator=transformers.DataCollatorForSeq2Seq(tiny.tokenizer()),
            hot_paths=HotPaths(optimizer=False),
        )
        trainer.train()
    assert trainer.fasttrain_status["clip"] == "off: the optimizer hot path is switched off"
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "fasttrain")
