"""``use_liger_kernel=True`` with fasttrain: Liger's layer kernels stay, fasttrain serves the LM head and the loss.

Covered on CPU: what Liger 0.8.5's kernels run under the Triton interpreter — its RoPE and the model forward it
installs for its fused-linear cross-entropy. Its RMSNorm and SwiGLU kernels fail there (``'float' object has no
attribute 'to'`` inside the kernels), so ``liger_kernel_config`` switches them off here; on a GPU they are the same
module-level patches of the backbone and stay the same way.
"""

from __future__ import annotations

import logging

import pytest
import transformers
from transformers.models.qwen3 import modeling_qwen3

import _tiny
import fasttrain
from fasttrain.integration.loss import fused_forwards

pytest.importorskip(
    "liger_kernel", reason="liger-kernel is a test dependency on Linux (pyproject's dev extra)"
)

CPU_CONFIG = {"rms_norm": False, "swiglu": False}  # the two kernels the interpreter cannot run (see above)


@pytest.fixture(autouse=True)
def _undo_liger_patches(monkeypatch):
    """Liger patches transformers' Qwen3 module itself: put it back for the tests that follow."""
    for name in ("apply_rotary_pos_emb", "Qwen3RMSNorm", "Qwen3MLP"):
        monkeypatch.setattr(modeling_qwen3, name, getattr(modeling_qwen3, name))


def _train(trainer_cls, tmp_path, monkeypatch, **args):
    import liger_kernel.transformers.rope as liger_rope

    rope_calls = []
    real_rope = liger_rope.liger_rotary_pos_emb

    def counting_rope(*a, **k):
        rope_calls.append(1)
        return real_rope(*a, **k)

    # Liger's apply function installs the name it imported: count the calls through that name
    monkeypatch.setattr("liger_kernel.transformers.monkey_patch.liger_rotary_pos_emb", counting_rope)
    trainer = trainer_cls(
        model=_tiny.model("qwen3"),
        args=_tiny.training_args(str(tmp_path / trainer_cls.__module__), max_steps=2, **args),
        train_dataset=_tiny.dataset(),
        data_collator=transformers.DataCollatorForSeq2Seq(_tiny.tokenizer(), padding=True),
    )
    trainer.train()
    return trainer, len(rope_calls)


@pytest.fixture(scope="module")
def plain_logs(tmp_path_factory):
    """transformers without Liger and without fasttrain: the truth both Liger runs are held to."""
    out = tmp_path_factory.mktemp("plain")
    trainer = transformers.Trainer(
        model=_tiny.model("qwen3"),
        args=_tiny.training_args(str(out), max_steps=2),
        train_dataset=_tiny.dataset(),
        data_collator=transformers.DataCollatorForSeq2Seq(_tiny.tokenizer(), padding=True),
    )
    trainer.train()
    return trainer


def test_liger_keeps_its_layer_kernels_and_fasttrain_serves_the_head(
    tmp_path, monkeypatch, caplog, plain_logs
):
    liger_args = dict(use_liger_kernel=True, liger_kernel_config=CPU_CONFIG)
    reference, reference_rope = _train(transformers.Trainer, tmp_path, monkeypatch, **liger_args)
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        ours, our_rope = _train(fasttrain.Trainer, tmp_path, monkeypatch, **liger_args)
    # Liger's RoPE ran in both (the backbone is Liger's); fasttrain's fused head took every training forward
    assert reference_rope > 0 and our_rope > 0
    assert fused_forwards(ours) == 2 * 2  # 2 steps of 2 accumulated micro-batches
    assert ours.fasttrain_status["loss"] == "on"
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("fasttrain hot paths"))
    assert (
        "use_liger_kernel=True: Liger serves rope; fasttrain serves the LM head and loss in place of Liger's "
        "fused_linear_cross_entropy" in line
    )
    # the same training as transformers with Liger, and as transformers alone
    _tiny.assert_same_logs(reference, ours, rtol=1e-5)
    _tiny.assert_same_logs(plain_logs, ours, rtol=1e-5)


def test_with_fasttrain_s_loss_off_the_status_says_liger_serves_the_head(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FASTTRAIN_DISABLE", "loss")
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        ours, rope_calls = _train(
            fasttrain.Trainer, tmp_path, monkeypatch, use_liger_kernel=True, liger_kernel_config=CPU_CONFIG
        )
    assert rope_calls > 0 and ours.fasttrain_status["loss"] == "off: switched off"
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("fasttrain hot paths"))
    assert "Liger serves rope; Liger's fused_linear_cross_entropy serves the LM head and loss" in line
