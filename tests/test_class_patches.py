"""A method patched or mocked on the Trainer's class after the trainer was built is still called.

TRL's own GRPO and RLOO tests do ``patch.object(GRPOTrainer, "training_step", wraps=trainer.training_step)`` and
count the calls. fasttrain's instance overrides must neither hide such a mock (the override resolves the class's
method at call time), nor recurse through it (the mock wraps the very override), nor run their own work twice;
an override whose path cannot run is not installed at all.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import transformers

import _tiny as tiny
import fasttrain

pytestmark = [pytest.mark.dropin, pytest.mark.gpu_versions]


def _trainer(tmp_path, cls=fasttrain.Trainer, hot_paths=None, **overrides):
    tok = tiny.tokenizer()
    extra = {} if hot_paths is None else {"hot_paths": hot_paths}
    return cls(
        **extra,
        model=tiny.model("llama"),
        args=tiny.training_args(str(tmp_path), **{"max_steps": 3, "max_grad_norm": 1.0, **overrides}),
        train_dataset=tiny.dataset(n=24),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )


@pytest.mark.skipif(not tiny.PACKING, reason="packing is off on this transformers: no override to test")
@pytest.mark.parametrize("entry", ["class", "patch"])
def test_a_mock_wrapping_training_step_sees_every_step_the_way_trls_tests_do(tmp_path, entry):
    if entry == "patch":
        fasttrain.patch()
        try:
            trainer = _trainer(tmp_path, transformers.Trainer)
        finally:
            fasttrain.unpatch()
    else:
        trainer = _trainer(tmp_path)
    assert "training_step" in vars(trainer)  # packing's evidence hook: the case where an override exists
    with mock.patch.object(transformers.Trainer, "training_step", wraps=trainer.training_step) as spy:
        trainer.train()
    micro_steps = 3 * trainer.args.gradient_accumulation_steps
    assert spy.call_count == micro_steps
    # fasttrain's own work ran once per step, not twice and not never: packing saw the packed batches
    assert trainer.fasttrain_status["packing"] == "on"
    from fasttrain.integration import seam_of

    seam = seam_of(trainer)  # every packed batch made (6 batches: one epoch, all used) counted once
    assert 0 < seam.packed_steps == seam.packer.packed_batches


def test_no_override_where_its_path_cannot_run(tmp_path):
    # packing and the loss path both hook training_step (its evidence; whether the fused loss pays)
    trainer = _trainer(tmp_path, hot_paths=fasttrain.HotPaths(packing=False, loss=False))
    assert "training_step" not in vars(trainer) and "get_train_dataloader" not in vars(trainer)
    trainer = _trainer(tmp_path, max_grad_norm=0.0)
    assert "_clip_grad_norm" not in vars(trainer)  # no clipping: only the norm's one pass is hooked
    assert "_get_train_sampler" not in vars(trainer)  # no length grouping asked


@pytest.mark.skipif(not tiny.FUSED_CLIP, reason="this transformers has no Trainer._clip_grad_norm")
def test_a_private_method_replaced_on_the_class_after_construction_is_called(tmp_path):
    trainer = _trainer(tmp_path)
    original = transformers.Trainer._clip_grad_norm
    calls = []

    def _clip_grad_norm(self, model):
        calls.append(1)
        return original(self, model)

    with mock.patch.object(transformers.Trainer, "_clip_grad_norm", _clip_grad_norm):
        trainer.train()
    # the user's method ran at every step; it ends in the Trainer's clip, which the fused clip serves
    assert len(calls) == 3
    assert trainer.fasttrain_status["clip"] == "on"
    assert trainer.fasttrain_status["optimizer"] == "on"


@pytest.mark.skipif(not tiny.FUSED_CLIP, reason="this transformers has no Trainer._clip_grad_norm")
def test_a_private_method_replaced_by_one_that_clips_its_own_way_keeps_it(tmp_path):
    trainer = _trainer(tmp_path)
    calls = []

    def _clip_grad_norm(self, model):
        calls.append(1)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    with mock.patch.object(transformers.Trainer, "_clip_grad_norm", _clip_grad_norm):
        trainer.train()
    assert len(calls) == 3
    assert trainer.fasttrain_status["clip"] == (
        "off: Trainer._clip_grad_norm clipped without the Trainer's accelerator.clip_grad_norm_"
    )
    assert trainer.fasttrain_status["optimizer"] == "on"


def test_a_mock_of_create_optimizer_on_the_class_is_called(tmp_path):
    trainer = _trainer(tmp_path)
    with mock.patch.object(
        transformers.Trainer,
        "create_optimizer",
        autospec=True,
        side_effect=transformers.Trainer.create_optimizer,
    ) as spy:
        trainer.train()
    assert spy.call_count >= 1
    assert isinstance(
        trainer.optimizer.optimizer, fasttrain.FusedAdamW
    )  # fasttrain's hook still ran around it
    assert trainer.fasttrain_status["optimizer"] == "on"


def test_the_same_trainer_runs_after_the_mock_is_gone(tmp_path):
    trainer = _trainer(tmp_path)
    with mock.patch.object(transformers.Trainer, "training_step", wraps=trainer.training_step):
        pass
    trainer.train()
    assert trainer.fasttrain_status["packing"] == tiny.all_on_status()["packing"]
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))
