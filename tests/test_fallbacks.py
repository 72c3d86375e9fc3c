"""Where a hot path cannot apply, the decision falls back to transformers with a reason (logged once).

DeepSpeed itself does not run on this CPU machine; these tests pin the decisions the hooks take from the
Trainer's and Accelerate's own flags, so a DeepSpeed or FSDP1 run falls back instead of going wrong.
"""

from __future__ import annotations

import json
import logging
import types

import torch
from accelerate.utils import DistributedType

from fasttrain import FusedAdamW, HotPaths, integration


def _trainer(**overrides):
    model = torch.nn.Linear(4, 3)
    optimizer = FusedAdamW(model.parameters(), lr=1e-3)
    accelerator = types.SimpleNamespace(distributed_type=DistributedType.NO, scaler=None, is_fsdp2=False)
    fields = dict(
        args=types.SimpleNamespace(optim="adamw_torch_fused", deepspeed=None, max_grad_norm=1.0),
        optimizer_cls_and_kwargs=None,
        is_deepspeed_enabled=False,
        hot_paths=HotPaths(),
        optimizer=types.SimpleNamespace(optimizer=optimizer),  # as Accelerate wraps it
        accelerator=accelerator,
        model=model,
    )
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def test_fused_clip_applies_on_a_plain_run():
    trainer = _trainer()
    fused, reason = integration._fused_clip_target(trainer, trainer.model)
    assert fused is trainer.optimizer.optimizer and reason == ""


def test_deepspeed_keeps_its_own_clipping():
    trainer = _trainer()
    trainer.accelerator.distributed_type = DistributedType.DEEPSPEED
    fused, reason = integration._fused_clip_target(trainer, trainer.model)
    assert fused is None and "DeepSpeed" in reason


def test_fsdp1_keeps_its_own_clipping_and_fsdp2_fuses():
    trainer = _trainer()
    trainer.accelerator.distributed_type = DistributedType.FSDP
    assert integration._fused_clip_target(trainer, trainer.model)[0] is None
    trainer.accelerator.is_fsdp2 = True
    assert integration._fused_clip_target(trainer, trainer.model)[0] is not None


def test_grad_scaler_keeps_accelerates_clipping():
    trainer = _trainer()
    trainer.accelerator.scaler = object()
    fused, reason = integration._fused_clip_target(trainer, trainer.model)
    assert fused is None and "GradScaler" in reason


def test_parameters_outside_the_optimizer_keep_the_reference_clip():
    trainer = _trainer(model=torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)))
    fused, reason = integration._fused_clip_target(trainer, trainer.model)
    assert fused is None and "does not update" in reason


def test_deepspeed_optimizer_section_is_left_alone(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    trainer = _trainer(is_deepspeed_enabled=True)
    trainer.args.deepspeed = str(config)
    assert "own optimizer section" in integration._optimizer_blocker(trainer)
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert "DeepSpeed" in integration._optimizer_blocker(trainer)


def test_other_optimizers_and_user_optimizers_are_kept():
    trainer = _trainer()
    assert integration._optimizer_blocker(trainer) is None
    trainer.args.optim = "sgd"
    assert "optim=sgd" in integration._optimizer_blocker(trainer)
    trainer = _trainer(optimizer_cls_and_kwargs=(torch.optim.SGD, {}))
    assert "optimizer_cls_and_kwargs" in integration._optimizer_blocker(trainer)


def test_a_fallback_is_logged_once(caplog):
    trainer = _trainer()
    with caplog.at_level(logging.WARNING, logger="fasttrain"):
        for _ in range(3):
            integration._set(trainer, "clip", "off: a reason only this test gives")
    lines = [r for r in caplog.records if "a reason only this test gives" in r.getMessage()]
    assert len(lines) == 1
    assert trainer.fasttrain_status["clip"] == "off: a reason only this test gives"
