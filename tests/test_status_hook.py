"""The status settles at the first optimizer step through a step post-hook that never mutates torch's hook dict.

torch iterates the optimizer's post-hooks while it calls them: a hook that removed itself there raised
"OrderedDict mutated during iteration" whenever another post-hook followed it. Under DeepSpeed the Trainer calls
``create_optimizer`` twice (in ``deepspeed_init`` and again in its loop) and gets the same optimizer back, which
registered a second settling hook: ZeRO-2/3 training crashed at its first step.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import _tiny as tiny
import fasttrain


@pytest.fixture
def trainer(tmp_path):
    tok = tiny.tokenizer()
    return fasttrain.Trainer(
        model=tiny.model("llama"),
        args=tiny.training_args(str(tmp_path), max_steps=1),
        train_dataset=tiny.dataset(n=8),
        processing_class=tok,
    )


def _give_gradients(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)


def test_a_later_post_hook_survives_the_first_step(trainer):
    optimizer = trainer.create_optimizer()
    later = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: later.append(opt))
    _give_gradients(trainer.model)
    optimizer.step()
    optimizer.step()
    assert later == [optimizer, optimizer], (
        "the post-hook registered after fasttrain's did not run every step"
    )
    assert trainer.fasttrain_status["optimizer"] == "on"


def test_create_optimizer_twice_settles_once(trainer, monkeypatch):
    # DeepSpeed's path: deepspeed_init calls create_optimizer, then the training loop calls it again
    first = trainer.create_optimizer()
    assert trainer.create_optimizer() is first
    from fasttrain.integration import settle

    settled = []
    real_settle = settle.settle
    monkeypatch.setattr(settle, "settle", lambda seam, opt: (settled.append(opt), real_settle(seam, opt)))
    _give_gradients(trainer.model)
    first.step()
    first.step()
    assert settled == [first], "the status must be read exactly once, at the first step"
    assert trainer.fasttrain_status["optimizer"] == "on"


def test_the_step_that_creates_a_loaded_checkpoints_state_settles_nothing(trainer, monkeypatch):
    """FSDP2 resume: torch's set_optimizer_state_dict, inside the Trainer's _load_optimizer_and_scheduler, first
    steps the optimizer with zero gradients and lr 0 to create the state it then loads. No training step: the
    status waits for the first real one."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    optimizer = trainer.create_optimizer()
    monkeypatch.setattr(
        transformers.Trainer,
        "_load_optimizer_and_scheduler",
        lambda self, checkpoint: _init_optim_state(optimizer),
    )
    trainer._load_optimizer_and_scheduler("a checkpoint")
    assert optimizer.state, "the loader stepped the optimizer to create its state"
    assert trainer.fasttrain_status["optimizer"] == "off: has not run yet"
    _give_gradients(trainer.model)
    optimizer.step()
    assert trainer.fasttrain_status["optimizer"] == "on"
