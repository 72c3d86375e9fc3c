"""``optim_args="step_in_backward=true"``: the Trainer's FusedAdamW steps inside backward, bit for bit the run without.

Two fasttrain Trainers on the same tiny model and data, ``max_grad_norm=0`` both, one with the switch: every logged
loss, every parameter and every optimizer state equal (torch.equal) after a few steps, with gradient accumulation 2
(the hooks step only on the micro-batch where the Trainer syncs), two weight-decay groups and a linear lr schedule
with warm-up (the hooks of step k read the lr ``optimizer.step()`` of step k would), in fp32, 8-bit states, bf16
autocast and a bf16 model with stochastic rounding. The logged ``grad_norm`` is the norm of the gradients the run
without the switch steps on; resuming from a checkpoint ends where the uninterrupted run ends; each run the switch
cannot serve is refused at construction with its reason.
"""

from __future__ import annotations

import types

import accelerate
import pytest
import torch
import transformers
from accelerate.utils import DistributedType

import _tiny as tiny
import fasttrain
from fasttrain import FusedAdamW
from fasttrain.integration import in_backward, seam_of

pytestmark = pytest.mark.dropin

SWITCH = "step_in_backward=true"
STEPS = 3
STATUS = "on (stepping in backward)"
# transformers < 5 logs no grad_norm without clipping (no Trainer._get_grad_norm); nor does fasttrain then
GRAD_NORM_LOGGED = hasattr(transformers.Trainer, "_get_grad_norm")


class Watch(transformers.TrainerCallback):
    """At each optimizer step: the norm of the gradients present (float64), whether every gradient is gone; after
    each accumulating micro-batch: whether every gradient is still there."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.freed: list[bool] = []
        self.kept: list[bool] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0)
        self.freed.append(not grads)

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        self.kept.append(all(p.grad is not None for p in model.parameters() if p.requires_grad))


def _trainer(out, optim_args=None, dtype=torch.float32, callbacks=(), model=None, **overrides):
    tok = tiny.tokenizer()
    args = dict(
        max_steps=STEPS,
        max_grad_norm=0.0,
        gradient_accumulation_steps=2,
        weight_decay=0.1,
        lr_scheduler_type="linear",
        warmup_steps=1,
        optim_args=optim_args,
    )
    args.update(overrides)
    return fasttrain.Trainer(
        model=model or tiny.model("llama", dtype=dtype),
        args=tiny.training_args(str(out), **args),
        train_dataset=tiny.dataset(),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
        callbacks=list(callbacks),
    )


def _join(*options: str | None) -> str | None:
    return ",".join(o for o in options if o) or None


def _assert_equal_runs(ours: transformers.Trainer, ref: transformers.Trainer, steps: int = STEPS) -> None:
    """Equal logs of the last train() (STEPS) and equal weights and states after ``steps`` optimizer steps."""
    our_logs, ref_logs = tiny.step_logs(ours), tiny.step_logs(ref)
    assert len(our_logs) == len(ref_logs) == STEPS
    for step, (a, b) in enumerate(zip(our_logs, ref_logs, strict=True), start=1):
        assert a["loss"] == b["loss"], f"loss differs at step {step}"
        assert a["learning_rate"] == b["learning_rate"], f"lr differs at step {step}"
    our_opt, ref_opt = ours.optimizer.optimizer, ref.optimizer.optimizer
    assert isinstance(our_opt, FusedAdamW) and isinstance(ref_opt, FusedAdamW)
    assert len(our_opt.param_groups) == 2  # weight decay and no weight decay
    for (name, p), q in zip(ours.model.named_parameters(), ref.model.parameters(), strict=True):
        assert torch.equal(p, q), f"{name}: max difference {float((p.float() - q.float()).abs().max()):.3e}"
        sa, sb = our_opt.state[p], ref_opt.state[q]
        assert sa.keys() == sb.keys(), name
        for key in sa:
            assert torch.equal(sa[key], sb[key]), f"state {key} of {name} differs"
        assert float(sa["step"]) == steps  # stepped once per optimizer step, not once per micro-batch


CASES = {
    "fp32": (torch.float32, None, {}),
    "8bit": (torch.float32, "state_dtype=8bit,min_8bit_size=256", {}),
    "bf16-autocast": (torch.float32, None, {"bf16": True}),
    "bf16-model-sr": (torch.bfloat16, "bf16_stochastic_rounding=true", {"bf16": True}),
    # 12 micro-batches an epoch in steps of 5, 5 and 2: the last step syncs at the epoch's end, not on a count
    "uneven-accumulation": (torch.float32, None, {"gradient_accumulation_steps": 5}),
    # reentrant checkpointing runs a backward of its own per layer: each parameter must still be stepped once
    "checkpointing": (
        torch.float32,
        None,
        {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_equals_the_run_without_it(tmp_path, case):
    dtype, options, overrides = CASES[case]
    watch = Watch()
    ours = _trainer(tmp_path / "ours", _join(SWITCH, options), dtype, [watch], **overrides)
    ours.train()
    ref = _trainer(tmp_path / "ref", options, dtype, **overrides)
    ref.train()
    _assert_equal_runs(ours, ref)
    assert ours.fasttrain_status["optimizer"] == STATUS
    assert ref.fasttrain_status["optimizer"] == "on"
    # every gradient was stepped and freed in backward; the accumulating micro-batches kept theirs
    assert watch.freed == [True] * STEPS and all(watch.kept) and len(watch.kept) > 0
    if options and "8bit" in options:
        assert any("exp_avg_codes" in s for s in ours.optimizer.optimizer.state.values())


TIED_CASES = {
    "bf16-model-sr-8bit": (
        torch.bfloat16,
        "bf16_stochastic_rounding=true,state_dtype=8bit,min_8bit_size=256",
        {"bf16": True},
    ),
    "checkpointing": (
        torch.float32,
        None,
        {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
    ),
}


@pytest.mark.parametrize("case", list(TIED_CASES))
def test_a_tied_heads_gradient_deferred_to_the_embedding_equals_the_run_without_it(
    tmp_path, monkeypatch, case
):
    # Qwen3's tied embeddings: with the switch, the fused head's weight gradient is made at the embedding's backward
    # (loss.tied_embedding), on the micro-batch that steps; the accumulating one makes it at the head, as without
    from fasttrain.loss import chunked_head

    made = []  # the deferred gradients made: whole (fp32 products) or a block of rows at a time (bf16)
    original, blocks = chunked_head._weight_grad, chunked_head.RowBlocks.__iter__
    monkeypatch.setattr(chunked_head, "_weight_grad", lambda *a: made.append("whole") or original(*a))
    monkeypatch.setattr(
        chunked_head.RowBlocks, "__iter__", lambda self: made.append("blocks") or blocks(self)
    )
    dtype, options, overrides = TIED_CASES[case]

    def tied() -> transformers.PreTrainedModel:
        model = tiny.model("qwen3", dtype=dtype)
        model.config.tie_word_embeddings = True
        model.tie_weights()
        return model

    ours = _trainer(tmp_path / "ours", _join(SWITCH, options), dtype, model=tied(), **overrides)
    ours.train()
    deferred = len(made)
    ref = _trainer(tmp_path / "ref", options, dtype, model=tied(), **overrides)
    ref.train()
    # once per optimizer step; never without the switch
    assert made == [("blocks" if dtype == torch.bfloat16 else "whole")] * STEPS and deferred == STEPS
    _assert_equal_runs(ours, ref)
    assert ours.fasttrain_status["optimizer"] == STATUS


def test_logs_the_norm_of_the_gradients_it_stepped(tmp_path):
    ours = _trainer(tmp_path / "ours", SWITCH)
    ours.train()
    watch = Watch()
    ref = _trainer(tmp_path / "ref", callbacks=[watch])
    ref.train()
    if not GRAD_NORM_LOGGED:
        assert not any("grad_norm" in h for h in tiny.step_logs(ours) + tiny.step_logs(ref))
        return
    logged = [h["grad_norm"] for h in tiny.step_logs(ours)]
    assert len(logged) == len(watch.norms) == STEPS
    for step, (norm, truth) in enumerate(zip(logged, watch.norms, strict=True), start=1):
        # summed in float64, rounded once to float32: within float32's rounding of the float64 norm
        assert norm == pytest.approx(truth, rel=2e-7, abs=0.0), f"grad_norm at step {step}"
    reference_logged = [h["grad_norm"] for h in tiny.step_logs(ref)]
    assert logged == pytest.approx(reference_logged, rel=2e-6)  # the key and value the Trainer itself logs


def test_hooks_come_off_at_the_end_of_training(tmp_path):
    trainer = _trainer(tmp_path, SWITCH)
    trainer.train()
    handle = seam_of(trainer).in_backward.handle
    assert handle.removed and handle.updates > 0
    ids = torch.tensor([[5, 6, 7, 8]])
    trainer.model(
        input_ids=ids, labels=ids
    ).loss.backward()  # after train(): the gradients stay for the caller
    assert all(p.grad is not None for p in trainer.model.parameters())
    assert handle.updates == STEPS * len(list(trainer.model.parameters()))


def test_a_second_train_steps_in_backward_again(tmp_path):
    runs = []
    for name, options in (("ours", SWITCH), ("ref", None)):
        trainer = _trainer(tmp_path / name, options)
        trainer.train()
        trainer.train()  # the same optimizer, its hooks registered again at create_optimizer
        runs.append(trainer)
    ours, ref = runs
    _assert_equal_runs(ours, ref, steps=2 * STEPS)
    handle = seam_of(ours).in_backward.handle
    assert handle.removed and handle.updates == STEPS * len(
        list(ours.model.parameters())
    )  # the second's hooks


def test_resume_equals_the_uninterrupted_run(tmp_path):
    saving = dict(save_strategy="steps", save_steps=2, max_steps=4)
    full = _trainer(tmp_path / "full", SWITCH, **saving)
    full.train()
    resumed = _trainer(tmp_path / "resumed", SWITCH, **saving)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs after resuming"
    assert tiny.step_logs(full)[-1]["loss"] == tiny.step_logs(resumed)[-1]["loss"]
    assert resumed.fasttrain_status["optimizer"] == STATUS


def test_the_trainer_default_clip_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTTRAIN_OPTIM_ARGS", SWITCH)  # the environment's switch, as optim_args's
    with pytest.raises(
        ValueError, match=r"max_grad_norm=1\.0 clips .* every gradient before .* max_grad_norm=0"
    ):
        _trainer(tmp_path, max_grad_norm=1.0)


def test_fp16_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"fp16 trains with a GradScaler.*use bf16"):
        _trainer(tmp_path, SWITCH, fp16=True)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        (DistributedType.MULTI_XPU, r"only DDP \(MULTI_CPU, MULTI_GPU\) steps in backward"),
        (DistributedType.XLA, r"only DDP \(MULTI_CPU, MULTI_GPU\) steps in backward"),
        (DistributedType.FSDP, r"under FSDP \(1 or 2\) .* set after FSDP's reduce-scatter"),
    ],
)
def test_distributed_runs_are_refused(tmp_path, monkeypatch, kind, message):
    monkeypatch.setattr(accelerate.Accelerator, "distributed_type", property(lambda self: kind))
    with pytest.raises(ValueError, match=f"step_in_backward=true: .*{message}"):
        _trainer(tmp_path, SWITCH)


def test_ddp_is_armed_for_a_communication_hook(tmp_path, monkeypatch):
    """DDP is not refused: the step waits for on_train_begin (after Accelerate wraps the model) to go into a
    communication hook; the two-process runs are tests/test_distributed.py's."""
    monkeypatch.setattr(
        accelerate.Accelerator, "distributed_type", property(lambda self: DistributedType.MULTI_CPU)
    )
    trainer = _trainer(tmp_path, SWITCH)
    assert seam_of(trainer).in_backward.ddp
    assert "on_train_begin" in trainer.callback_handler.__dict__


def test_deepspeed_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(fasttrain.integration, "deepspeed_config", lambda trainer: {"zero_optimization": {}})
    with pytest.raises(ValueError, match="DeepSpeed owns the optimizer step"):
        _trainer(tmp_path, SWITCH)


def test_an_optimizer_not_fused_is_refused(tmp_path):
    trainer = _trainer(tmp_path, SWITCH)
    trainer.optimizer_cls_and_kwargs = (torch.optim.AdamW, {"lr": 1e-3})
    with pytest.raises(
        ValueError, match="needs fasttrain's FusedAdamW, but the Trainer's optimizer is AdamW"
    ):
        trainer.train()


def test_the_refusal_reads_the_run_not_the_arguments_alone(tmp_path):
    # a GradScaler as the accelerator reports it, whatever the arguments say
    trainer = _trainer(tmp_path)
    seam = seam_of(trainer)
    trainer.accelerator = types.SimpleNamespace(distributed_type=DistributedType.NO, scaler=object())
    assert "GradScaler" in in_backward.refusal(trainer, seam)
    trainer.accelerator.scaler = None
    assert in_backward.refusal(trainer, seam) is None
