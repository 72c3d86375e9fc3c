"""The ``fasttrain`` command line: ``fasttrain bench`` (also ``python -m fasttrain bench``), ``fasttrain --version``.
Its options and exit codes: docs/usage.md, "`fasttrain bench`"; every default comes from bench/presets.py."""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import shlex
import sys
import time

from .bench.config import GENERATING_TRAINERS, GENERATION_FIELDS
from .hot_paths import HotPaths

TRAINER_TYPES = ("transformers", "sft", "dpo", "kto", *GENERATING_TRAINERS)


class UsageError(ValueError):
    pass


def _bench_parser(sub) -> argparse.ArgumentParser:
    from .bench import data, models, presets  # light: no torch, no transformers

    p = sub.add_parser(
        "bench",
        help="run the transformers Trainer and fasttrain side by side",
        description="Train the same model, data and seed with transformers.Trainer and fasttrain.Trainer (or TRL's "
        "trainer plain and patched), each in its own process; print a side-by-side table. Unset options come from "
        "--preset, else the built-in preset of the device and trainer. docs/usage.md, docs/method.md.",
    )
    p.set_defaults(command_parser=p)  # main() reports a misspelled option with this parser's usage
    add = p.add_argument
    lognormal = data.describe_lognormal("--seq-len").replace("%", "%%")
    shapes = "; ".join(
        f"{n}: {models.describe_summary(models.builtin_summary(n))}" for n in models.BUILTIN_SHAPES
    )
    preset_help = "; ".join(f"{name}: {preset.summary}" for name, preset in presets.PRESETS.items())
    # fmt: off
    # argparse %-formats help strings: percentages need doubling
    add("--preset", choices=list(presets.PRESETS), help=preset_help.replace("%", "%%"))
    add("--smoke", action="store_true", help="run the preset's tiny-CPU twin: the same code in seconds, without a GPU")
    add("--trainer", choices=TRAINER_TYPES, help="transformers: transformers.Trainer against fasttrain.Trainer; "
        "else TRL's trainer of that name, plain against under fasttrain.patch() (default: transformers)")
    add("--model", help=f"a built-in Qwen3 shape, random init ({shapes.replace('%', '%%')}), a local dir or a hub id")
    add("--dataset", help="'default' (the Python standard library's sources), a local .json/.jsonl/.parquet/.txt "
        "file with a 'text' column or lines, or a hub dataset id")
    add("--device", choices=["auto", "cpu", "cuda"], help="default: cuda when available, else cpu")
    add("--lengths", choices=list(data.LENGTH_KINDS), help="'natural' (each document, cut to --seq-len), "
        f"'lognormal' ({lognormal}) or 'full' (every example --seq-len tokens of the data read as one stream)")
    add("--steps", type=int, help="optimizer steps per run")
    add("--seq-len", type=int, help="maximum tokens per example; grpo/rloo: per prompt")
    add("--batch-size", type=int, help="per-device batch size; grpo/rloo: completions per micro-batch")
    add("--grad-accum", type=int, help="gradient accumulation steps")
    add("--num-generations", type=int, help="grpo/rloo: completions per prompt (divides batch x grad-accum)")
    add("--max-completion-length", type=int, help="grpo/rloo: longest completion in tokens")
    add("--completions", choices=["sampled", "synthetic"], help="grpo/rloo: 'sampled' by TRL's model.generate "
        "(seeded) or 'synthetic': random tokens of log-normal lengths, no model call (the training phase alone)")
    add("--bf16", action=argparse.BooleanOptionalAction, help="bf16 weights and bf16=True")
    add("--repeats", type=int, help="repetitions per contender")
    add("--warmup-steps", type=int, help="first steps left out of the timing (at most --steps minus 1)")
    add("--seed", type=int)
    add("--lr", type=float, help="learning rate")
    add("--threads", type=int, help="torch threads in every run (default: all usable cores)")
    add("--group-by-length", action=argparse.BooleanOptionalAction, help="train_sampling_strategy="
        "'group_by_length' on both sides (--trainer transformers and sft only)")
    add("--liger", action=argparse.BooleanOptionalAction, help="add transformers.Trainer with "
        "use_liger_kernel=True as a third contender (default: on for cuda when liger_kernel imports)")
    add("--ablate", nargs="?", const="", metavar="PATHS", help="also fasttrain with each hot path off in turn, "
        f"and all off: each one's share; or only the comma-separated PATHS (of {', '.join(HotPaths.names())}, all)")
    add("--gradient-checkpointing", action=argparse.BooleanOptionalAction, help="gradient_checkpointing, both sides")
    add("--frontier", action="store_true", default=None, help="the longest sequence each contender trains under "
        "--memory-budget, from --seq-len (docs/usage.md; built-in presets: cpu-frontier, cuda-frontier)")
    add("--memory-budget", metavar="SIZE", help="--frontier: the memory a run may reach, e.g. 20GiB (default: "
        "the available memory less 10%%, at least 1 GiB)")
    add("--max-length", type=int, help="--frontier: the longest length probed")
    add("--json", metavar="PATH", help="write the results as JSON")
    add("--markdown", metavar="PATH", help="write the table as Markdown, with its provenance")
    add("--plot", metavar="PATH", help="write a PNG: loss curves, throughput and memory bars")
    add("--profile", metavar="PATH", help="then profile one step per contender: where its time goes, to PATH")
    add("--no-progress", action="store_true", help="no progress bar")
    # fmt: on
    return p


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="fasttrain", description="fasttrain: a faster transformers Trainer")
    parser.add_argument("--version", action="version", version=f"fasttrain {__version__}")
    _bench_parser(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return parser


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """'unrecognized arguments: ...', with the closest known option for each misspelled one."""
    known = [option for action in parser._actions for option in action.option_strings]
    hints = []
    for name in (extra.split("=", 1)[0] for extra in extras):
        if name.startswith("--") and (close := difflib.get_close_matches(name, known, n=1)):
            hints.append(f"{name}: did you mean {close[0]}?")
    return "unrecognized arguments: " + " ".join(extras) + (f" ({'; '.join(hints)})" if hints else "")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _liger_importable() -> bool:
    try:
        import liger_kernel  # noqa: F401
    except Exception:  # absent, or broken (no Triton build for this GPU, ...): the GPU kit went on without it
        return False
    return True


def settings(args: argparse.Namespace) -> dict:
    """Every setting of the run: the built-in preset, then --preset (or its twin), then the options given."""
    from .bench import presets

    frontier = getattr(args, "frontier", False)
    named = presets.chosen(args.preset, args.smoke, args.trainer, frontier)
    given = {k: v for k, v in vars(args).items() if v is not None and k not in ("preset", "smoke")}
    trainer = given.get("trainer") or named.get("trainer") or "transformers"
    device = given.get("device") or named.get("device") or "auto"
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    elif device == "cuda" and not _cuda_available():
        raise UsageError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    merged = {**presets.PRESETS[presets.default_for(device, trainer, frontier)].options, **named, **given}
    merged.update(trainer=trainer, device=device)
    if isinstance(merged["seq_len"], dict):
        merged["seq_len"] = merged["seq_len"][merged["lengths"]]
    if "warmup_steps" not in given:  # derived from --steps: `--steps 1` alone must not trip over it
        merged["warmup_steps"] = min(merged["warmup_steps"], max(merged["steps"] - 1, 0))
    wrong = [_flag(k) for k in GENERATION_FIELDS if k in given]
    if wrong and trainer not in GENERATING_TRAINERS:
        raise UsageError(f"{', '.join(wrong)} only apply to --trainer grpo and rloo")
    merged.setdefault("threads", len(os.sched_getaffinity(0)))
    return merged


def _check(s: dict) -> None:
    """Usage errors, each one line, before any child starts."""
    from .bench import data, models

    generates = s["trainer"] in GENERATING_TRAINERS
    minimums = {"steps": 1, "seq_len": data.MIN_TOKENS, "batch_size": 1, "grad_accum": 1, "repeats": 1,
                "warmup_steps": 0, "threads": 1, **({"num_generations": 2, "max_completion_length": 1} if generates
                                                    else {})}  # fmt: skip
    for key, minimum in minimums.items():
        if s[key] < minimum:
            raise UsageError(f"{_flag(key)} must be at least {minimum} (got {s[key]})")
    if s["warmup_steps"] >= s["steps"]:
        raise UsageError(f"--warmup-steps ({s['warmup_steps']}) must be smaller than --steps ({s['steps']})")
    if generates and (s["batch_size"] * s["grad_accum"]) % s["num_generations"]:
        raise UsageError(
            f"--batch-size x --grad-accum ({s['batch_size']} x {s['grad_accum']}) must be a multiple of "
            f"--num-generations ({s['num_generations']}): each step trains on whole groups of one prompt's "
            "completions"
        )
    trainer = s["trainer"]
    if trainer != "transformers" and importlib.util.find_spec("trl") is None:
        raise UsageError(f"--trainer {trainer} needs TRL, which is not installed (pip install trl)")
    if s["group_by_length"] and trainer not in ("transformers", "sft"):
        raise UsageError(
            f"--group-by-length does not apply to --trainer {trainer}: its rows have no input_ids column"
        )
    if not s["lr"] > 0:
        raise UsageError(f"--lr must be positive (got {s['lr']})")
    try:
        models.check_model_spec(s["model"])
        data.check_dataset_spec(s["dataset"])
    except (models.ModelError, data.DatasetError) as exc:
        raise UsageError(str(exc)) from None
    if s["bf16"] and s["device"] == "cpu":
        import torch

        if not torch.backends.mkldnn.is_available():
            raise UsageError("--bf16 on cpu needs a torch build with oneDNN (mkldnn)")
    frontier_only = [_flag(k) for k in ("memory_budget", "max_length") if k in s]
    if frontier_only and not s.get("frontier"):
        raise UsageError(f"{', '.join(frontier_only)} only apply to --frontier")
    if s.get("frontier") and trainer != "transformers":
        raise UsageError(
            f"--frontier runs transformers.Trainer against fasttrain.Trainer, not --trainer {trainer}"
        )
    if "memory_budget" in s:  # --frontier's (checked above)
        from .bench.frontier import parse_size

        try:
            parse_size(s["memory_budget"])
        except ValueError as exc:
            raise UsageError(f"--memory-budget: {exc}") from None
    if s.get("max_length", s["seq_len"]) < s["seq_len"]:
        raise UsageError(f"--max-length ({s['max_length']}) must be at least --seq-len ({s['seq_len']})")
    if s["liger"] and generates:
        raise UsageError(
            f"--liger does not apply to --trainer {trainer}: TRL keeps its own fused LM head there"
        )
    if s["liger"] and not _liger_importable():
        raise UsageError("--liger: liger_kernel is not installed (pip install liger-kernel)")
    if s["liger"] and s["device"] != "cuda":
        raise UsageError("--liger needs --device cuda (Liger's Triton kernels do not run on cpu)")
    for key in ("json", "markdown", "plot", "profile"):
        parent = os.path.dirname(os.path.abspath(s[key])) if s.get(key) else None
        if parent and not os.path.isdir(parent):
            raise UsageError(f"--{key} {s[key]!r}: the directory {parent!r} does not exist")
    if s.get("plot"):
        from .bench.report import check_plot_available

        check_plot_available()  # PlotUnavailable: a usage error too (main)


def resolve(args: argparse.Namespace):
    """Validated settings: (BenchConfig, contenders, repeats)."""
    from .bench.config import FASTTRAIN, LIGER, REFERENCE, BenchConfig, Contender
    from .bench.summary import ABLATION_PREFIX

    s = settings(args)
    _check(s)
    generates = s["trainer"] in GENERATING_TRAINERS
    if s["liger"] is None:
        s["liger"] = s["device"] == "cuda" and not generates and _liger_importable()
    config = BenchConfig(
        **{key: s[key] for key in ("model", "dataset", "device", "steps", "seq_len", "batch_size", "grad_accum",
                                   "bf16", "seed", "threads", "warmup_steps", "group_by_length", "lengths")},
        learning_rate=s["lr"],
        trainer_type=s["trainer"],
        gradient_checkpointing=bool(s.get("gradient_checkpointing")),
        **({key: s[key] for key in GENERATION_FIELDS} if generates else {}),
    )  # fmt: skip
    contenders = [Contender(REFERENCE, REFERENCE), Contender(FASTTRAIN, FASTTRAIN)]
    if s["liger"]:
        contenders.insert(1, Contender(LIGER, LIGER))
    if s.get("ablate") is not None:
        contenders += [Contender(ABLATION_PREFIX + name, FASTTRAIN, name) for name in _ablated(s["ablate"])]
    return config, contenders, s["repeats"]


def _ablated(spec: str) -> list[str]:
    """The hot paths --ablate switches off one at a time: every one and "all", or those named."""
    known = (*HotPaths.names(), "all")
    if not spec.strip():
        return list(known)
    names = list(dict.fromkeys(n.strip().lower() for n in spec.split(",") if n.strip()))
    if unknown := [n for n in names if n not in known]:
        raise UsageError(
            f"--ablate names unknown hot path(s) {', '.join(unknown)}; known: {', '.join(known)}"
        )
    return names


def announce(config, contenders, repeats: int) -> list[str]:
    """What is about to run, said before the first run (minutes before the table): the runs, their steps and
    the warm-up left out of the timing, the model's size; a warning when no warm-up step is left out."""
    from .bench.report import NO_WARMUP_NOTE, model_note, plural, rl_note, warmup_note

    runs = len(contenders) * repeats
    lines = [
        f"fasttrain bench: {plural(runs, 'run')} ({', '.join(c.name for c in contenders)}; "
        f"{plural(repeats, 'repetition')} each) of {plural(config.steps, 'optimizer step')}, "
        f"{warmup_note(config.warmup_steps)}; model {model_note(config.model)}"
    ]
    if config.generates:
        lines.append(f"fasttrain bench: {rl_note(config)}; generation and training phases timed apart")
    if config.warmup_steps == 0:
        lines.append(f"fasttrain bench: warning: {NO_WARMUP_NOTE}")
    return lines


def bench(args: argparse.Namespace, argv: list[str]) -> int:
    from .bench import profile, provenance, report, roofline, runner, summary

    config, contenders, repeats = resolve(args)
    s = settings(args)
    if s.get("frontier"):
        from .bench.frontier_report import frontier_bench

        return frontier_bench(config, contenders, s, args, shlex.join(["fasttrain", *argv]))
    print(*announce(config, contenders, repeats), sep="\n", file=sys.stderr)
    # the model FLOPs a token costs are known for plain causal LMs: --trainer transformers
    plain = config.trainer_type == "transformers"
    limit = roofline.measure_matmul_rate(config.device, config.threads) if plain else None
    started = time.perf_counter()
    # argv as given to main(), which may not be sys.argv
    origin = provenance.record("liger-kernel", command_line=shlex.join(["fasttrain", *argv]))

    def assemble(results, failures, complete: bool = False) -> dict:
        data = summary.build(results, failures)
        data.update(provenance=origin, config=config.to_json(), wall_s=time.perf_counter() - started)
        # a failed run counts as done; the skipped repetitions of a failed contender never will be
        finished = [r for runs in results.values() for r in runs]
        done = len(finished) + len(failures)
        data.update(complete=complete, runs_done=done, runs_planned=len(contenders) * repeats)
        data["load_average"] = {"end": provenance.load_average()}
        if during := [r["load_average_during"] for r in finished if "load_average_during" in r]:
            mean = sum(d["mean"] for d in during) / len(during)
            data["load_average"]["during_runs"] = {"mean": mean, "max": max(d["max"] for d in during)}
        if limit is not None:
            data["matmul_limit"] = limit
            rate = limit["matmul_flops_per_s"]
            for side in [*data.values(), *data.get("ablations", {}).values()]:
                if isinstance(side, dict) and "tokens_per_s" in side:
                    side["percent_of_matmul_limit"] = roofline.percent_of_limit(side, rate)
        return data

    def write_files(data: dict) -> None:
        if args.json:
            report.write_json(args.json, data)
        if args.markdown:
            report.write_text(args.markdown, report.markdown(config, data))

    results, failures = runner.run_all(
        config, contenders, repeats, not args.no_progress, lambda *run: write_files(assemble(*run))
    )
    data = assemble(results, failures, complete=True)
    print(report.text_table(config, data))
    if args.profile:
        data["profile"] = profile.profile_contenders(
            config, contenders, failures, limit, origin, args.profile
        )
    write_files(data)
    if args.plot and report.finished_columns(data):
        report.plot(args.plot, config, data)
    for option in ("json", "markdown", "plot", "profile"):
        if getattr(args, option):
            print(f"{option}: {getattr(args, option)}", file=sys.stderr)
    for name, error in failures.items():
        print(f"fasttrain bench: {name}: {error}", file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # argparse exits 2 with a usage line on a bad value; unknown options are collected here so that the
    # message carries the usage of the command they were given to, not the top-level one.
    args, extras = parser.parse_known_args(argv)
    if extras:
        command_parser = getattr(args, "command_parser", parser)
        command_parser.error(_unrecognized(command_parser, extras))
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    from .bench.report import PlotUnavailable
    from .bench.runner import BenchError, RunFailed

    try:
        return bench(args, argv)
    except (UsageError, BenchError, PlotUnavailable) as exc:
        print(f"fasttrain bench: error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"fasttrain bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fasttrain bench: interrupted", file=sys.stderr)
        return 130
