"""Where the status line shows: where the Trainer's own messages show, at the Trainer's log level.

In a fresh process with no logging configured (a user's script), ``log_level="info"`` shows the INFO status line
on stderr and the default level (warning) does not; a fallback's WARNING shows at the default level. A process
launched as one of several that trains alone says so, in a WARNING and in the status line.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import transformers

import _tiny as tiny
import fasttrain

TESTS = Path(__file__).resolve().parent

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import transformers, _tiny as tiny, fasttrain
tok = tiny.tokenizer()
trainer = fasttrain.Trainer(
    model=tiny.model("llama"),
    args=tiny.training_args({out!r}, max_steps=1, {extra}),
    train_dataset=tiny.dataset(n=8),
    data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
    processing_class=tok,
)
trainer.train()
"""


def _stderr(tmp_path, extra: str) -> str:
    code = SCRIPT.format(tests=str(TESTS), out=str(tmp_path), extra=extra)
    env = {k: v for k, v in os.environ.items() if k != "FASTTRAIN_DISABLE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_the_status_line_follows_the_trainers_log_level(tmp_path):
    assert "fasttrain hot paths: optimizer=on" in _stderr(tmp_path / "info", 'log_level="info"')
    quiet = _stderr(tmp_path / "default", "")
    assert "fasttrain hot paths" not in quiet  # INFO, like the Trainer's own "***** Running training *****"
    # a fallback is a WARNING: shown at the default level
    assert "fasttrain hot paths:" in _stderr(
        tmp_path / "fallback", 'optim="adamw_torch", label_smoothing_factor=0.1'
    )


def test_one_of_several_launched_processes_training_alone_is_a_warning(tmp_path, monkeypatch, caplog):
    tok = tiny.tokenizer()
    args = tiny.training_args(str(tmp_path), max_steps=1)
    assert args.world_size == 1  # Accelerate's state is read before the launcher's variable appears
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun / accelerate launch set for two processes
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        trainer = fasttrain.Trainer(
            model=tiny.model("llama"),
            args=args,
            train_dataset=tiny.dataset(n=8),
            data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        )
        trainer.train()
    lines = [
        r for r in caplog.records if r.name == "fasttrain" and "2 processes were launched" in r.getMessage()
    ]
    assert [r.levelno for r in lines] == [
        logging.WARNING,
        logging.WARNING,
    ]  # when built, and in the status line
    assert "fasttrain hot paths:" in lines[-1].getMessage()
    assert trainer.state.global_step == 1
