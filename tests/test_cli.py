"""`fasttrain bench` option handling: every bad option is one clear line on stderr and exit code 2."""

from __future__ import annotations

import json

import pytest

from fasttrain import cli
from fasttrain.bench.config import FASTTRAIN, REFERENCE
from fasttrain.hot_paths import HotPaths


def _error(capsys, argv: list[str]) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--device", "cpu", "--steps", "0"], "--steps must be at least 1 (got 0)"),
        (["bench", "--device", "cpu", "--batch-size", "-3"], "--batch-size must be at least 1"),
        (["bench", "--device", "cpu", "--grad-accum", "0"], "--grad-accum must be at least 1"),
        (["bench", "--device", "cpu", "--seq-len", "4"], "--seq-len must be at least 16"),
        (["bench", "--device", "cpu", "--repeats", "0"], "--repeats must be at least 1"),
        (["bench", "--device", "cpu", "--steps", "3", "--warmup-steps", "3"], "must be smaller than --steps"),
        (["bench", "--device", "cpu", "--lr", "0"], "--lr must be positive"),
        (["bench", "--device", "cpu", "--model", "qwen9-huge"], "neither a built-in shape"),
        (["bench", "--device", "cpu", "--model", "./no/such/dir"], "no such directory"),
        (["bench", "--device", "cpu", "--dataset", "/no/such/file.jsonl"], "no such file"),
        (["bench", "--device", "cpu", "--json", "/no/such/dir/out.json"], "does not exist"),
        (["bench", "--device", "cpu", "--liger"], "liger"),
    ],
)
def test_bad_option_is_one_clear_line(capsys, argv, message):
    err = _error(capsys, argv)
    assert message in err
    assert err.startswith("fasttrain bench: error:")
    assert err.count("\n") == 1


def test_unsupported_dataset_file_type(capsys, tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("text\nhello\n")
    assert "unsupported file type '.csv'" in _error(
        capsys, ["bench", "--device", "cpu", "--dataset", str(path)]
    )


def test_dataset_without_text_column_fails_before_any_run(capsys, tmp_path, monkeypatch):
    """The columns are checked in the parent, before a model is built (it used to fail ~30 s into the
    reference run)."""
    from fasttrain.bench import runner

    def no_run(*args, **kwargs):
        raise AssertionError("a contender was started")

    monkeypatch.setattr(runner, "run_all", no_run)
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "hi", "answer": "there"}\n')
    err = _error(capsys, ["bench", "--device", "cpu", "--dataset", str(path)])
    assert "no 'text' or 'input_ids' column (columns: prompt, answer)" in err
    assert err.startswith("fasttrain bench: error:") and err.count("\n") == 1


def test_model_directory_without_config(capsys, tmp_path):
    assert "no config.json" in _error(capsys, ["bench", "--device", "cpu", "--model", str(tmp_path)])


def test_hub_id_offline_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE" in _error(capsys, ["bench", "--device", "cpu", "--model", "Qwen/Qwen3-0.6B"])
    assert "HF_HUB_OFFLINE" in _error(capsys, ["bench", "--device", "cpu", "--dataset", "someone/some-data"])


def test_cuda_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_cuda_available", lambda: False)
    assert "no CUDA device" in _error(capsys, ["bench", "--device", "cuda"])


def test_unknown_option_and_bad_choice_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--no-such-option"])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--device", "tpu"])
    assert info.value.code == 2
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


def test_no_command_prints_help():
    assert cli.main([]) == 2


def _resolve(argv: list[str]):
    return cli.resolve(cli.build_parser().parse_args(argv))


def test_cpu_defaults():
    config, contenders, repeats = _resolve(["bench", "--device", "cpu"])
    # a released model's shape (Qwen3-0.6B), not the small qwen3-cpu whose LM head is nearly all its FLOPs
    assert (config.model, config.seq_len, config.batch_size, config.bf16) == ("qwen3-0.6b", 512, 2, False)
    # what most fine-tuning scripts run: instruction-like lengths, no length grouping on either side
    assert (config.lengths, config.group_by_length) == ("lognormal", False)
    assert [c.name for c in contenders] == [REFERENCE, FASTTRAIN]
    assert repeats == 2
    assert config.threads >= 1


def test_lengths_option_and_its_sequence_length_default():
    natural, _, _ = _resolve(["bench", "--device", "cpu", "--lengths", "natural"])
    assert (natural.lengths, natural.seq_len) == ("natural", 256)
    given, _, _ = _resolve(["bench", "--device", "cpu", "--lengths", "lognormal", "--seq-len", "512"])
    assert (given.lengths, given.seq_len) == ("lognormal", 512)
    grouped, _, _ = _resolve(["bench", "--device", "cpu", "--group-by-length"])
    assert grouped.group_by_length


def test_unknown_lengths_kind_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--lengths", "uniform"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'uniform'" in capsys.readouterr().err


def test_ablate_adds_one_fasttrain_run_per_hot_path_and_all():
    _, contenders, _ = _resolve(["bench", "--device", "cpu", "--ablate", "--model", "tiny", "--steps", "3"])
    ablations = contenders[2:]
    assert [c.disable for c in ablations] == [*HotPaths.names(), "all"]
    assert all(c.trainer == FASTTRAIN for c in ablations)
    assert ablations[0].name == f"fasttrain-no-{HotPaths.names()[0]}"


def test_ablate_can_name_the_paths_to_switch_off(capsys):
    _, contenders, _ = _resolve(["bench", "--device", "cpu", "--ablate", "loss, packing,loss"])
    assert [(c.name, c.disable) for c in contenders[2:]] == [
        ("fasttrain-no-loss", "loss"),
        ("fasttrain-no-packing", "packing"),
    ]
    assert "--ablate names unknown hot path(s) packign" in _error(capsys, ["bench", "--ablate", "packign"])


def test_explicit_options_override_device_defaults(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "x = 1\n" * 40}) + "\n")
    config, _, _ = _resolve(
        [
            "bench",
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--steps",
            "5",
            "--seq-len",
            "32",
            "--batch-size",
            "3",
            "--grad-accum",
            "2",
            "--bf16",
            "--dataset",
            str(data),
            "--no-group-by-length",
        ]
    )
    assert (config.model, config.steps, config.seq_len, config.batch_size, config.grad_accum) == (
        "tiny",
        5,
        32,
        3,
        2,
    )
    assert config.bf16 and not config.group_by_length and config.dataset == str(data)
    assert config.examples_needed == 5 * 3 * 2


def test_version_flag_prints_the_package_version(capsys):
    import fasttrain

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fasttrain {fasttrain.__version__}"


@pytest.mark.parametrize(("steps", "warmup"), [(1, 0), (2, 1), (3, 2), (12, 2)])
def test_warmup_default_follows_steps(steps, warmup):
    config, _, _ = _resolve(["bench", "--device", "cpu", "--steps", str(steps)])
    assert config.warmup_steps == warmup


def test_explicit_warmup_is_kept_and_checked(capsys):
    config, _, _ = _resolve(["bench", "--device", "cpu", "--steps", "5", "--warmup-steps", "0"])
    assert config.warmup_steps == 0
    assert "--warmup-steps (1) must be smaller than --steps (1)" in _error(
        capsys, ["bench", "--device", "cpu", "--steps", "1", "--warmup-steps", "1"]
    )


def test_misspelled_bench_option_prints_the_bench_usage(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--stpes", "3"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fasttrain bench")
    assert "fasttrain bench: error: unrecognized arguments: --stpes 3" in err
    assert "did you mean --steps?" in err
    assert "Traceback" not in err


def test_misspelled_top_level_option_prints_the_top_level_usage(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--verison"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fasttrain [-h] [--version]")
    assert "did you mean --version?" in err


def test_trainer_types_and_their_defaults():
    config, contenders, _ = _resolve(["bench", "--device", "cpu"])
    assert config.trainer_type == "transformers" and not config.group_by_length
    config, contenders, _ = _resolve(["bench", "--device", "cpu", "--trainer", "sft"])
    assert config.trainer_type == "sft" and not config.group_by_length
    assert [c.trainer for c in contenders] == [REFERENCE, FASTTRAIN]
    config, _, _ = _resolve(["bench", "--device", "cpu", "--trainer", "dpo"])
    assert config.trainer_type == "dpo" and not config.group_by_length


def test_generating_trainers_have_their_own_defaults():
    """GRPO and RLOO: 8 completions of up to 512 tokens per prompt, one prompt a step on CPU; KTO is like DPO."""
    for trainer in ("grpo", "rloo"):
        config, contenders, _ = _resolve(["bench", "--device", "cpu", "--trainer", trainer])
        assert config.generates and config.completions == "sampled"
        assert (config.num_generations, config.max_completion_length) == (8, 512)
        assert (config.batch_size, config.grad_accum, config.steps, config.warmup_steps) == (8, 1, 4, 1)
        assert (config.lengths, config.seq_len) == ("lognormal", 512)  # prompts
        assert config.examples_needed == 4  # prompts: one per step
        assert [c.trainer for c in contenders] == [REFERENCE, FASTTRAIN]
    config, _, _ = _resolve(["bench", "--device", "cpu", "--trainer", "kto"])
    assert not config.generates and (config.batch_size, config.steps) == (4, 12)
    config, _, _ = _resolve(
        ["bench", "--device", "cpu", "--trainer", "grpo", "--batch-size", "4", "--grad-accum", "3", "--num-generations",
         "6", "--max-completion-length", "64", "--completions", "synthetic", "--steps", "5"]
    )  # fmt: skip
    assert (config.num_generations, config.max_completion_length, config.completions) == (6, 64, "synthetic")
    assert config.examples_needed == 5 * 4 * 3 // 6


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--trainer", "sft", "--num-generations", "4"],
            "--num-generations only apply to --trainer grpo and rloo",
        ),
        (
            ["--trainer", "dpo", "--completions", "synthetic"],
            "--completions only apply to --trainer grpo and rloo",
        ),
        (["--trainer", "grpo", "--batch-size", "6"], "must be a multiple of --num-generations (8)"),
        (["--trainer", "rloo", "--num-generations", "1"], "--num-generations must be at least 2"),
        (["--trainer", "grpo", "--max-completion-length", "0"], "--max-completion-length must be at least 1"),
        (["--trainer", "kto", "--group-by-length"], "--group-by-length does not apply to --trainer kto"),
        (["--trainer", "grpo", "--liger"], "--liger does not apply to --trainer grpo"),
    ],
)
def test_generating_trainer_options_are_checked(capsys, argv, message):
    assert message in _error(capsys, ["bench", "--device", "cpu", *argv])


def test_dpo_refuses_group_by_length(capsys):
    err = _error(capsys, ["bench", "--device", "cpu", "--trainer", "dpo", "--group-by-length"])
    assert "--group-by-length does not apply to --trainer dpo" in err


def test_trl_trainer_without_trl_is_a_usage_error(capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "trl" else find_spec(name, *a)
    )
    assert "--trainer sft needs TRL" in _error(capsys, ["bench", "--device", "cpu", "--trainer", "sft"])


def _bench_argv(tmp_path) -> list[str]:
    return [
        "bench", "--device", "cpu", "--model", "tiny", "--steps", "4", "--warmup-steps", "1", "--repeats", "2",
        "--no-progress", "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md"),
    ]  # fmt: skip


def _finished_run(contender):
    from _bench_helpers import run_result

    return run_result(contender.name, contender.trainer, 100.0, 500.0, [4.0, 3.0, 2.0, 1.0])


def test_bench_writes_each_finished_run_so_a_cut_short_bench_keeps_them(tmp_path, monkeypatch, capsys):
    from fasttrain.bench import runner

    done = []

    def fake_run_one(config, contender, workdir, tag, on_step):
        if len(done) == 2:  # the time cap strikes during the third run: what is on disk is what finished
            data = json.loads((tmp_path / "r.json").read_text())
            assert data["complete"] is False and data["runs_done"] == 2 and data["runs_planned"] == 4
            assert len(data[REFERENCE]["runs"]) == len(data[FASTTRAIN]["runs"]) == 1
            assert "fasttrain_vs_reference" in data["comparison"]
            assert "partial: 2 of 4 runs done" in (tmp_path / "r.md").read_text()
            raise KeyboardInterrupt
        done.append(contender.name)
        return _finished_run(contender)

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    assert cli.main(_bench_argv(tmp_path)) == 130
    assert done == [REFERENCE, FASTTRAIN]
    assert not list(tmp_path.glob("*.partial"))  # every write was whole


def test_a_crashing_contender_is_reported_and_the_others_finish(tmp_path, monkeypatch, capsys):
    from fasttrain.bench import runner

    def fake_run_one(config, contender, workdir, tag, on_step):
        if contender.name == FASTTRAIN:
            raise runner.RunFailed(
                "the fasttrain run exited with code 1; last lines of its log:\nOSError: boom"
            )
        return _finished_run(contender)

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    assert cli.main(_bench_argv(tmp_path)) == 1
    captured = capsys.readouterr()
    assert "fasttrain: the fasttrain run exited with code 1" in captured.err
    assert "OSError: boom" in captured.out  # the table's error row
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["complete"] is True and list(data["failed"]) == [FASTTRAIN]
    assert len(data[REFERENCE]["runs"]) == 2 and FASTTRAIN not in data
    assert "| error | - | the fasttrain run exited with code 1" in (tmp_path / "r.md").read_text()


def test_the_plan_is_said_before_the_runs_with_the_model_s_size():
    config, contenders, repeats = _resolve(["bench", "--device", "cpu", "--model", "tiny", "--steps", "4"])
    (line,) = cli.announce(config, contenders, repeats)
    assert line.startswith(
        "fasttrain bench: 4 runs (reference, fasttrain; 2 repetitions each) of 4 optimizer steps"
    )
    assert "optimizer steps, the first 2 steps not timed (warm-up)" in line
    assert "model tiny (hidden 32, 1 layer, vocab 151,936, 4.9M parameters" in line


def test_one_step_is_singular_and_warns_that_the_timing_includes_warm_up(tmp_path, monkeypatch, capsys):
    from fasttrain.bench import runner

    def fake_run_one(config, contender, workdir, tag, on_step):
        run = _finished_run(contender)
        run.update(steps=1, warmup_steps_excluded=0, losses=[4.0])
        return run

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    argv = [*_bench_argv(tmp_path), "--steps", "1", "--warmup-steps", "0", "--repeats", "1"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "of 1 optimizer step, every step timed" in captured.err
    assert "fasttrain bench: warning: no warm-up step is excluded from the timing" in captured.err
    assert "1 step x batch" in captured.out and "1 steps" not in captured.out
    assert "exclude the first 0" not in captured.out and "WARNING: no warm-up step" in captured.out
    # without the warning when warm-up steps are left out
    config, contenders, repeats = _resolve(["bench", "--device", "cpu", "--steps", "3"])
    assert not any("warning" in line for line in cli.announce(config, contenders, repeats))


def test_help_lists_every_built_in_shape_with_its_size(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in ("tiny", "qwen3-cpu", "qwen3-0.6b", "qwen3-1.7b"):
        assert f"{name}: hidden " in out
    assert "1 layer, vocab 151,936, 4.9M parameters" in out


def test_the_built_in_default_is_what_it_was():
    """`fasttrain bench` alone on a CPU: the same model, lengths, batch, steps, warm-up, repeats and contenders."""
    config, contenders, repeats = _resolve(["bench", "--device", "cpu"])
    assert (config.model, config.lengths, config.seq_len, config.batch_size, config.grad_accum) == (
        "qwen3-0.6b", "lognormal", 512, 2, 1
    )  # fmt: skip
    assert (config.steps, config.warmup_steps, config.bf16, repeats) == (4, 2, False, 2)
    assert (config.seed, config.learning_rate, config.dataset) == (0, 1e-3, "default")
    assert [c.name for c in contenders] == [REFERENCE, FASTTRAIN]


# The arguments the GPU kit's former scripts gave `fasttrain bench`, GPU and --smoke
_KIT = {
    "gpu-e2e": (
        "--device cuda --model qwen3-0.6b --bf16 --seq-len 4096 --batch-size 2 --steps 8 --warmup-steps 2 --repeats 2",
        "--device cpu --model tiny --steps 3 --warmup-steps 1 --seq-len 64 --batch-size 2 --repeats 1",
    ),
    "gpu-packing": (
        "--lengths lognormal --no-group-by-length --ablate packing --repeats 1 --device cuda --model qwen3-0.6b "
        "--bf16 --seq-len 4096 --batch-size 16 --steps 8 --warmup-steps 2",
        "--lengths lognormal --no-group-by-length --ablate packing --repeats 1 --device cpu --model tiny --steps 3 "
        "--warmup-steps 1 --seq-len 128 --batch-size 4",
    ),
    **{
        f"gpu-{trainer}": (
            f"--trainer {trainer} --device cuda --model qwen3-0.6b --bf16 --seq-len 2048 --batch-size 2 --steps 6 "
            "--warmup-steps 2 --repeats 1 --no-liger",
            f"--trainer {trainer} --device cpu --model tiny --steps 2 --seq-len 48 --batch-size 2 --repeats 1",
        )
        for trainer in ("sft", "dpo")
    },
    "gpu-grpo": (
        "--trainer grpo --device cuda --model qwen3-0.6b --bf16 --lengths lognormal --seq-len 512 --batch-size 16 "
        "--grad-accum 1 --num-generations 8 --max-completion-length 512 --completions synthetic --steps 5 "
        "--warmup-steps 2 --repeats 1",
        "--trainer grpo --device cpu --model tiny --lengths lognormal --steps 2 --warmup-steps 1 --seq-len 48 "
        "--batch-size 4 --num-generations 4 --max-completion-length 16 --completions synthetic --repeats 1",
    ),
}


@pytest.mark.parametrize("liger", [False, True])
@pytest.mark.parametrize("name", list(_KIT))
def test_each_gpu_kit_preset_runs_what_its_script_ran(monkeypatch, name, liger):
    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.setattr(cli, "_liger_importable", lambda: liger)
    gpu, smoke = _KIT[name]
    assert _resolve(["bench", "--preset", name]) == _resolve(["bench", *gpu.split()])
    assert _resolve(["bench", "--preset", name, "--smoke"]) == _resolve(["bench", *smoke.split()])
    # the e2e step compared against Liger when liger_kernel imported
    _, contenders, _ = _resolve(["bench", "--preset", name])
    assert ("liger" in [c.name for c in contenders]) == (liger and name in ("gpu-e2e", "gpu-packing"))


def test_explicit_options_override_the_preset():
    argv = ["bench", "--preset", "gpu-packing", "--smoke", "--steps", "5", "--repeats", "3", "--seed", "7"]
    config, contenders, repeats = _resolve(argv)
    assert (config.steps, repeats, config.seed, config.seq_len) == (5, 3, 7, 128)
    assert [c.name for c in contenders][-1] == "fasttrain-no-packing"


@pytest.mark.parametrize("trainer", ["transformers", "sft", "grpo"])
def test_smoke_without_a_preset_runs_the_built_in_preset_s_twin(trainer):
    twin, _, _ = _resolve(["bench", "--smoke", "--trainer", trainer])
    assert (twin.model, twin.device, twin.trainer_type, twin.steps) == ("tiny", "cpu", trainer, 3 if trainer ==
                                                                        "transformers" else 2)  # fmt: skip


def test_help_lists_the_presets_and_the_head_s_share_computed_from_the_shape(capsys):
    from fasttrain.bench import models, presets

    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    # argparse wraps lines at hyphens too ("cuda-" / "frontier")
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    for name in presets.PRESETS:
        assert f"{name}: " in out
    share = models.builtin_summary("qwen3-0.6b")["lm_head_matmul_share"]
    assert f"cpu: qwen3-0.6b (LM head {share:.0%} of the matmul FLOPs)" in out


def test_no_share_of_the_head_is_written_by_hand():
    """cli.py said the head was ~22% of Qwen3-0.6B's matmul FLOPs where the shape gives 26%: such figures are
    computed from bench/models.py's shapes, never typed."""
    import pathlib
    import re

    from fasttrain.bench import presets

    for module in (cli, presets):
        source = pathlib.Path(module.__file__).read_text()
        assert not re.findall(r"head[^\n]{0,30}?[~ ]\d+%", source), module.__name__


def test_only_a_generating_run_records_generation_settings():
    from fasttrain.bench.config import BenchConfig

    generation = {"num_generations", "max_completion_length", "completions"}
    config, _, _ = _resolve(["bench", "--device", "cpu", "--model", "tiny"])
    assert not generation & config.to_json().keys()
    assert BenchConfig.from_json(config.to_json()) == config
    grpo, _, _ = _resolve(["bench", "--device", "cpu", "--model", "tiny", "--trainer", "grpo"])
    assert generation <= grpo.to_json().keys() and BenchConfig.from_json(grpo.to_json()) == grpo


@pytest.mark.parametrize(
    "options",
    [
        "", "--ablate", "--ablate packing", "--device cuda", "--trainer sft --bf16", "--trainer dpo", "--trainer kto",
        "--trainer grpo", "--trainer rloo", "--trainer grpo --completions synthetic", "--model qwen3-cpu",
        "--model tiny --steps 6 --seq-len 128 --batch-size 2 --grad-accum 2", "--lengths natural --group-by-length",
        "--lengths lognormal --ablate packing", "--repeats 1 --profile {tmp}/p.md",
        "--json {tmp}/r.json --markdown {tmp}/r.md --plot {tmp}/r.png",
    ],
)  # fmt: skip
def test_every_documented_command_still_resolves(monkeypatch, tmp_path, options):
    """The commands README.md and docs/ show keep their meaning under the presets."""
    monkeypatch.setattr(cli, "_cuda_available", lambda: "--device cuda" in options)
    monkeypatch.setattr(cli, "_liger_importable", lambda: False)
    config, contenders, _ = _resolve(["bench", *options.format(tmp=tmp_path).split()])
    assert config.device == ("cuda" if "--device cuda" in options else "cpu")
    assert config.bf16 == (config.device == "cuda" or "--bf16" in options)
    assert contenders[0].name == REFERENCE and contenders[1].name == FASTTRAIN
