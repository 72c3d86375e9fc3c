"""Axolotl's own CLI (`axolotl train cfg.yml`) on CPU on a tiny local model: the YAML, the run and what it logged.

The CLI runs in CI's Axolotl environment (`bash .ci/env-axolotl`), never in this process: Axolotl pins its own
torch, transformers and TRL, and re-executes itself through `accelerate launch`, so that environment's `bin` goes
on PATH. Everything is local (HF_HUB_OFFLINE=1): the model, tokenizer and datasets come from _axolotl_fixtures.py.

A run is `plain` (Axolotl alone) or under fasttrain, in one of two ways:

- `plugin`: `fasttrain: true` in the YAML; fasttrain's Axolotl plugin (the `axolotl.plugins` entry point of its
  wheel) reads it;
- `sitecustomize`: a `sitecustomize.py` on PYTHONPATH calls `fasttrain.patch()` in the process that trains (the
  way that needs no plugin: a wrapper script calling `patch()` would not reach accelerate's child process).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "_axolotl_fixtures.py"
DEFAULT_PYTHON = REPO / ".ci-envs" / "axolotl" / "bin" / "python"
VIAS = ("plain", "plugin", "sitecustomize")
STEPS = 4
TIMEOUT_S = 900  # one CLI run takes 1.5-2 minutes here, most of it imports in its three Python processes
STATUS = re.compile(r"fasttrain hot paths: (.*)$", re.MULTILINE)
HOT_PATHS = ("optimizer", "clip", "loss", "collator", "sampler", "packing")

# Patch only in the process that trains (accelerate's child runs `python -m axolotl.cli.train`): the CLI and
# `accelerate launch` run first in two other processes, where importing fasttrain (torch and transformers, about
# 30 s each in this environment) would only cost time.
SITECUSTOMIZE = """\
import sys

if "axolotl.cli.train" in sys.orig_argv:
    import fasttrain

    fasttrain.patch()
"""
# transformers refuses bf16 without a GPU unless TrainingArguments(use_cpu=True), which Axolotl's YAML cannot set
# (0.21.0 has no such key); a plugin can: Axolotl merges each plugin's get_training_args into its arguments.
CPU_PLUGIN_MODULE = "_axolotl_use_cpu"
CPU_PLUGIN = """\
from axolotl.integrations.base import BasePlugin


class UseCPU(BasePlugin):
    def get_training_args(self, cfg):
        return {"use_cpu": True}
"""


def python() -> Path:
    """The Axolotl environment's Python: FASTTRAIN_AXOLOTL_PYTHON, else what .ci/env-axolotl builds."""
    return Path(os.environ.get("FASTTRAIN_AXOLOTL_PYTHON") or DEFAULT_PYTHON)


def write_fixtures(interpreter: Path, root: Path) -> None:
    """The model, tokenizer and datasets, written by the Axolotl environment's own transformers."""
    done = subprocess.run(
        [str(interpreter), str(FIXTURES), str(root)], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if done.returncode != 0:
        raise RuntimeError(f"writing the fixtures failed:\n{done.stderr[-4000:]}")


def config(kind: str, root: Path, *, bf16: bool = False) -> dict:
    """An Axolotl config: `sft` (full fine-tune on alpaca rows) or `dpo` (`rl: dpo` on chat-template rows).

    Few steps of everything that decides the numbers: 4 optimizer steps of 2 micro-batches of 2, clipping at 1.0,
    no warmup (so that every step updates the weights), a fixed seed, no packing and no evaluation. The checkpoint
    at the last step is what keeps the logged values at full precision (trainer_state.json): the console prints
    them rounded to 4 digits."""
    settings = {
        "base_model": str(root / "model"),
        "sequence_len": 512,
        "sample_packing": False,
        "val_set_size": 0,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": STEPS,
        "num_epochs": 1,
        "optimizer": "adamw_torch",
        "learning_rate": 1e-3,
        "lr_scheduler": "cosine",
        "warmup_steps": 0,
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "seed": 0,
        "bf16": bf16,
        "fp16": False,
        "tf32": False,
        "save_strategy": "steps",
        "save_steps": STEPS,
    }
    if bf16:
        settings["plugins"] = [f"{CPU_PLUGIN_MODULE}.UseCPU"]
    if kind == "sft":
        settings["datasets"] = [{"path": str(root / "sft.jsonl"), "ds_type": "json", "type": "alpaca"}]
    elif kind == "dpo":
        settings["rl"] = "dpo"
        # the tokenizer's own ChatML template renders the rows (chat_template.default)
        settings["chat_template"] = "tokenizer_default"
        settings["datasets"] = [
            {
                "path": str(root / "dpo.jsonl"),
                "ds_type": "json",
                "split": "train",
                "type": "chat_template.default",
            }
        ]
    else:
        raise ValueError(kind)
    return settings


@dataclass
class Run:
    steps: list[dict]  # the values logged at each optimizer step, at full precision
    statuses: list[str]  # every fasttrain status line the run logged (after "fasttrain hot paths: ")
    wall_s: float


def train(interpreter: Path, settings: dict, run_dir: Path, via: str) -> Run:
    """`axolotl train cfg.yml` in ``run_dir``, as ``via`` says (plain, plugin or sitecustomize)."""
    if via not in VIAS:
        raise ValueError(via)
    run_dir.mkdir(parents=True)
    settings = dict(
        settings, output_dir=str(run_dir / "out"), dataset_prepared_path=str(run_dir / "prepared")
    )
    if via == "plugin":
        settings["fasttrain"] = True
    (run_dir / "cfg.yml").write_text(yaml.safe_dump(settings, sort_keys=False))
    bin_dir = interpreter.parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "FASTTRAIN_DISABLE")}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",  # `accelerate launch` is looked up on PATH
        HF_HUB_OFFLINE="1",
        HF_HOME=str(run_dir / "hf"),  # the datasets cache too: nothing of a run outlives its folder
        AXOLOTL_DO_NOT_TRACK="1",  # no telemetry
        WANDB_MODE="disabled",
    )
    site = run_dir / "site"  # what the run imports from outside the environment
    site.mkdir()
    (site / f"{CPU_PLUGIN_MODULE}.py").write_text(CPU_PLUGIN)
    if via == "sitecustomize":
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env["PYTHONPATH"] = str(site)
    start = time.perf_counter()
    done = subprocess.run(
        [str(bin_dir / "axolotl"), "train", "cfg.yml"],
        cwd=run_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
    )
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"axolotl train ({via}) exited {done.returncode}:\n{done.stdout[-6000:]}")
    return Run(_step_logs(run_dir / "out"), STATUS.findall(done.stdout), wall_s)


def _step_logs(out: Path) -> list[dict]:
    state = out / f"checkpoint-{STEPS}" / "trainer_state.json"
    if not state.is_file():
        raise RuntimeError(f"no {state}: the run saved no checkpoint at its last step")
    return [entry for entry in json.loads(state.read_text())["log_history"] if "loss" in entry]


def parse_status(line: str) -> dict[str, str]:
    """``optimizer=on, clip=off: <why>, ...`` (what follows "fasttrain hot paths: ") as {path: value}; notes
    after "; " are left out. A reason may hold commas: fields start only at a known path's name."""
    parts = re.split(rf"(?:^|, )({'|'.join(HOT_PATHS)})=", line.split("; ")[0])
    return dict(zip(parts[1::2], parts[2::2], strict=True))
