"""The launch configs under examples/ cannot rot: each goes through what ``accelerate launch --config_file`` does
with it (Accelerate's own config loader and launch-environment builders), and the plugins the Trainer's
Accelerator would build are built from that environment; each DeepSpeed JSON is filled by transformers from
TrainingArguments with nothing left "auto". examples/train.py runs two steps with every hot path on."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

import _tiny as tiny

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CONFIGS = sorted((EXAMPLES / "accelerate").glob("*.yaml"))
DS_CONFIGS = sorted((EXAMPLES / "deepspeed").glob("*.json"))


def test_every_engine_has_a_config():
    names = {c.stem for c in CONFIGS}
    assert names == {
        "fsdp2_full_shard",
        "fsdp2_hybrid_shard",
        "deepspeed_zero1",
        "deepspeed_zero2",
        "deepspeed_zero3",
    }
    assert {c.stem for c in DS_CONFIGS} == {"zero1", "zero2", "zero3"}


def _launch_env(config: Path) -> tuple[object, dict[str, str]]:
    """The parsed launch arguments and the environment ``accelerate launch`` would give the processes."""
    args = launch_command_parser().parse_args(["--config_file", str(config), "examples/train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(
            defaults.deepspeed_config
        )  # as launch_command
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return args, env


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.stem.startswith("fsdp2")], ids=lambda c: c.stem)
def test_fsdp2_config_builds_accelerates_plugin(config, monkeypatch):
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    args, env = _launch_env(config)
    assert args.use_fsdp and not args.use_deepspeed
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()  # reads FSDP_* as the launched processes' Accelerator does
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True
    assert "SHARDED_STATE_DICT" in str(plugin.state_dict_type)
    if config.stem.endswith("hybrid_shard"):
        mesh = ParallelismConfig()
        assert (mesh.dp_replicate_size, mesh.dp_shard_size) == (2, 4)
        assert mesh.dp_replicate_size * mesh.dp_shard_size == args.num_processes
    else:
        assert env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false") == "false"


@pytest.mark.parametrize(
    "config", [c for c in CONFIGS if c.stem.startswith("deepspeed")], ids=lambda c: c.stem
)
def test_deepspeed_config_builds_accelerates_plugin(config, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    args, env = _launch_env(config)
    assert args.use_deepspeed and not args.use_fsdp
    monkeypatch.chdir(ROOT)  # the configs name their JSON relative to the repository root, where one launches
    for key, value in env.items():
        if key.startswith("ACCELERATE_"):
            monkeypatch.setenv(key, value)
    plugin = DeepSpeedPlugin()
    stage = int(config.stem[-1])
    assert plugin.zero_stage == stage
    assert (
        Path(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]).resolve()
        == EXAMPLES / "deepspeed" / f"zero{stage}.json"
    )
    # no `optimizer` section: DeepSpeed steps the Trainer's optimizer (fasttrain's FusedAdamW)
    assert "optimizer" not in plugin.deepspeed_config


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.stem)
def test_deepspeed_json_is_filled_by_transformers(path, tmp_path):
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    model = tiny.model(
        "qwen3"
    )  # before the config: a live ZeRO-3 config makes from_config build under zero.Init
    config = HfTrainerDeepSpeedConfig(json.loads(path.read_text()))
    try:
        args = tiny.training_args(str(tmp_path), use_cpu=False)
        config.trainer_config_process(args)
        config.trainer_config_finalize(args, model, num_training_steps=10)
    finally:
        unset_hf_deepspeed_config()
    assert "auto" not in json.dumps(config.config)
    assert config.config["zero_optimization"]["stage"] == int(path.stem[-1])


def test_train_script_runs_with_every_hot_path_and_repeats_itself(tmp_path):
    """Two runs with the same --seed log the same per-step values: the model's initialisation is seeded too."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = []
    for run in ("a", "b"):  # at once: most of each run is imports
        cmd = [sys.executable, str(EXAMPLES / "train.py"), "--output_dir", str(tmp_path / run), "--max_steps", "2",
               "--per_device_train_batch_size", "2", "--rows", "8", "--max_length", "16", "--use_cpu",
               "--report_to", "none", "--save_strategy", "no", "--train_sampling_strategy", "group_by_length",
               "--disable_tqdm", "true", "--logging_steps", "1"]  # fmt: skip
        runs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = []
    for process in runs:
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stdout[-2000:] + stderr[-4000:]
        outputs.append(stdout.splitlines())
    status_line = next(line for line in outputs[0] if line.startswith("fasttrain status:"))
    status = ast.literal_eval(status_line.split(":", 1)[1].strip())  # the dict as printed
    for path in ("optimizer", "clip", "loss", "collator", "sampler"):
        assert status[path] == "on", status
    # the Trainer's per-step log lines (loss, grad_norm) as printed, 4 significant digits
    steps = [[line for line in lines if line.startswith("{'loss'")] for lines in outputs]
    assert len(steps[0]) == 2 and steps[0] == steps[1], steps
