"""The Trainer hook: optim="adamw_torch"/"adamw_torch_fused" -> FusedAdamW, installed and removed on demand."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainingArguments
from transformers import trainer_optimizer as tro

from fasttrain import FusedAdamW
from fasttrain.optim import handler


@pytest.fixture
def installed():
    originals = {k: tro._OPTIMIZER_HANDLERS[k] for k in ("adamw_torch", "adamw_torch_fused")}
    assert handler.install_optimizer_handlers() is True
    yield originals
    handler.uninstall_optimizer_handlers()
    for k, v in originals.items():
        assert tro._OPTIMIZER_HANDLERS[k] is v


def _args(tmp_path, **kw):
    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


def test_not_installed_at_import():
    assert not handler.optimizer_handlers_installed()
    assert tro._OPTIMIZER_HANDLERS["adamw_torch_fused"] is tro._get_adamw_torch


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_handler_resolves_to_fused_adamw(installed, tmp_path, optim):
    args = _args(tmp_path, optim=optim, learning_rate=3e-4, adam_beta1=0.85, adam_beta2=0.98, adam_epsilon=1e-7)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert cls is FusedAdamW
    assert kwargs == {"lr": 3e-4, "betas": (0.85, 0.98), "eps": 1e-7}
    # the original handler gives torch's AdamW with the same values
    ref_cls, ref_kwargs = installed[optim](
        tro.OptimizerContext(args=args, model=None, optimizer_kwargs={"lr": 3e-4},
                             adam_kwargs={"betas": (0.85, 0.98), "eps": 1e-7}, optim_args={})
    )  # fmt: skip
    assert ref_cls is torch.optim.AdamW
    assert {k: v for k, v in ref_kwargs.items() if k != "fused"} == kwargs


def test_install_is_idempotent_and_reversible():
    original = tro._OPTIMIZER_HANDLERS["adamw_torch_fused"]
    assert handler.install_optimizer_handlers() and handler.install_optimizer_handlers()
    assert handler.optimizer_handlers_installed()
    assert handler.uninstall_optimizer_handlers() is True
    assert handler.uninstall_optimizer_handlers() is False
    assert tro._OPTIMIZER_HANDLERS["adamw_torch_fused"] is original


def test_optim_args(installed, tmp_path):
    args = _args(tmp_path, optim="adamw_torch_fused", optim_args="amsgrad=true,backend=torch,eps=1e-6")
    _cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    assert kwargs["amsgrad"] is True and kwargs["backend"] == "torch" and kwargs["eps"] == 1e-6
    args = _args(tmp_path, optim="adamw_torch_fused", optim_args="momentum=0.9")
    with pytest.raises(ValueError, match="'momentum'"):
        Trainer.get_optimizer_cls_and_kwargs(args)
    args = _args(tmp_path, optim="adamw_torch_fused", optim_args="amsgrad=maybe")
    with pytest.raises(ValueError, match="amsgrad"):
        Trainer.get_optimizer_cls_and_kwargs(args)


def test_trainer_creates_fused_adamw_with_its_groups(installed, tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    trainer = Trainer(model=model, args=_args(tmp_path, weight_decay=0.05, learning_rate=1e-3))
    opt = trainer.create_optimizer()
    assert isinstance(opt, FusedAdamW)
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.05]
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)


def test_missing_table_reports_false(monkeypatch, caplog):
    monkeypatch.setattr(tro, "_OPTIMIZER_HANDLERS", None)
    from fasttrain import _logging

    _logging._said.discard("handler.no_table")
    with caplog.at_level(logging.WARNING, logger="fasttrain"):
        assert handler.install_optimizer_handlers() is False
    assert "keeps torch's AdamW" in caplog.text


def test_deepspeed_optimizer_section_detected(tmp_path, caplog):
    assert handler.is_deepspeed_optimizer_configured(SimpleNamespace(deepspeed=None)) is False
    assert handler.is_deepspeed_optimizer_configured(SimpleNamespace(deepspeed={"optimizer": {"type": "AdamW"}}))
    assert not handler.is_deepspeed_optimizer_configured(SimpleNamespace(deepspeed={"zero_optimization": {}}))
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "AdamW"}}))
    assert handler.is_deepspeed_optimizer_configured(SimpleNamespace(deepspeed=str(path)))
    from fasttrain import _logging

    _logging._said.discard("handler.deepspeed_optimizer")
    ctx = SimpleNamespace(
        args=SimpleNamespace(deepspeed={"optimizer": {}}, optim="adamw_torch"),
        optimizer_kwargs={"lr": 1e-3}, adam_kwargs={}, optim_args={},
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="fasttrain"):
        handler.fused_adamw_handler(ctx)
    assert "DeepSpeed builds its own optimizer" in caplog.text


class _TinyRegressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x, labels=None):
        pred = self.out(self.norm(torch.tanh(self.lin(x))))
        return {"loss": torch.nn.functional.mse_loss(pred, labels), "logits": pred}


def _train(tmp_path, fused: bool):
    torch.manual_seed(0)
    model = _TinyRegressor()
    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(3, generator=g) * 5} for _ in range(24)]
    args = _args(
        tmp_path, optim="adamw_torch_fused", learning_rate=1e-2, max_grad_norm=0.5, max_steps=6,
        per_device_train_batch_size=4, logging_steps=1, save_strategy="no", seed=0, weight_decay=0.01,
    )  # fmt: skip
    if fused:
        handler.install_optimizer_handlers()
    try:
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    finally:
        handler.uninstall_optimizer_handlers()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return trainer, norms, [p.detach().clone() for p in model.parameters()]


def test_trainer_run_matches_torch_adamw(tmp_path):
    """A short Trainer run with the hook gives the parameters and logged grad norms of torch's AdamW."""
    ref_trainer, ref_norms, ref_params = _train(tmp_path / "ref", fused=False)
    trainer, norms, params = _train(tmp_path / "ours", fused=True)
    assert isinstance(trainer.optimizer.optimizer, FusedAdamW)
    assert isinstance(ref_trainer.optimizer.optimizer, torch.optim.AdamW)
    assert len(norms) == 6 and max(norms) > 0.5  # clipping was active
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    for a, b in zip(params, ref_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
