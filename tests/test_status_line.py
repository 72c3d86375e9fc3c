"""Where the status line shows: where the Trainer's own messages show, at the Trainer's log level.

In a fresh process with no logging configured (a user's script), ``log_level="info"`` shows the INFO status line
on stderr. The level logic itself is checked in process, with the root logger's handlers set aside as in such a
script: the default level (warning) hides the INFO line and shows a fallback's WARNING, and an application that
configured logging keeps its own handlers and levels. A process launched as one of several that trains alone says
so, in a WARNING and in the status line.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

import _tiny as tiny
import fasttrain
from fasttrain import _logging

TESTS = Path(__file__).resolve().parent

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import transformers, _tiny as tiny, fasttrain
tok = tiny.tokenizer()
trainer = fasttrain.Trainer(
    model=tiny.model("llama"),
    args=tiny.training_args({out!r}, max_steps=1, log_level="info"),
    train_dataset=tiny.dataset(n=8),
    data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
    processing_class=tok,
)
trainer.train()
"""


def test_a_users_script_shows_the_status_line_at_log_level_info(tmp_path):
    code = SCRIPT.format(tests=str(TESTS), out=str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "FASTTRAIN_DISABLE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fasttrain hot paths: optimizer=on" in done.stderr


@pytest.fixture
def unconfigured(monkeypatch):
    """Makes logging look unconfigured, as in a script (call it in the test: pytest adds its capture handlers to
    the root logger when the test's call starts); fasttrain's logger is put back after the test."""
    logger = logging.getLogger("fasttrain")
    saved = (logger.handlers[:], logger.propagate, logger.level)
    monkeypatch.setattr(_logging, "_own_handler", None)

    def blank():
        monkeypatch.setattr(logging.getLogger(), "handlers", [])
        logger.handlers, logger.propagate = [], True
        logger.setLevel(logging.NOTSET)
        return logger

    verbosity = transformers.logging.get_verbosity()  # a Trainer with log_level sets transformers' verbosity
    yield blank
    logger.handlers, logger.propagate = saved[0], saved[1]
    logger.setLevel(saved[2])
    transformers.logging.set_verbosity(verbosity)


def _shown(logger, level: int) -> bool:
    return logger.isEnabledFor(level) and bool(logger.handlers) and not logger.propagate


def test_the_trainers_level_decides_what_shows(unconfigured):
    logger = unconfigured()
    # the Trainer's default log level (passive: transformers' warning), then log_level="info"
    _logging.follow_trainer_log_level(logging.WARNING)
    assert _shown(logger, logging.WARNING) and not logger.isEnabledFor(logging.INFO)
    _logging.follow_trainer_log_level(logging.INFO)
    assert _shown(logger, logging.INFO)


def test_an_application_that_configured_logging_keeps_it(unconfigured, monkeypatch):
    logger = unconfigured()
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.StreamHandler()])
    _logging.follow_trainer_log_level(logging.INFO)
    assert logger.handlers == [] and logger.propagate and logger.level == logging.NOTSET


def test_the_trainer_hands_its_process_log_level(tmp_path, unconfigured):
    logger = unconfigured()
    for log_level, expected in (("info", logging.INFO), ("error", logging.ERROR)):
        args = tiny.training_args(str(tmp_path), log_level=log_level)
        fasttrain.Trainer(model=tiny.model("llama"), args=args)
        assert logger.level == expected


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
