"""The ``fasttrain`` command line: ``fasttrain bench`` (also ``python -m fasttrain bench``), ``fasttrain --version``.

Exit codes: 0 done; 2 bad options or unusable model/data (one line on stderr, no traceback; an unknown or
misspelled option prints the usage of the command it was given to); 1 a training run crashed (the tail of its
log on stderr; the other contenders still ran and are in the table, the crashed one with its error); 130
interrupted. ``--json`` and ``--markdown`` are rewritten after every run, so a bench stopped by a time cap keeps
what finished.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import shlex
import sys
import time

from .hot_paths import HotPaths

# Per-device defaults: a released model's shape, Qwen3-0.6B (its LM head ~22% of the matmul FLOPs; the small
# qwen3-cpu shape, whose head is ~98%, stays available as --model qwen3-cpu). CPU: fp32, log-normal lengths like
# instruction data (median 180 tokens, up to 512), ungrouped, batches of 2, 4 steps of which 2 warm-up, two
# repetitions each: about 6 minutes on 2 cores (a step is ~15-20 s there). CUDA: bf16 at sequence length 4,096 on
# the corpus's natural lengths. "seq_len" is the limit for --lengths natural, "lognormal_seq_len" for
# --lengths lognormal.
DEVICE_DEFAULTS = {
    "cpu": {
        "model": "qwen3-0.6b",
        "lengths": "lognormal",
        "seq_len": 256,
        "lognormal_seq_len": 512,
        "batch_size": 2,
        "steps": 4,
        "bf16": False,
    },
    "cuda": {
        "model": "qwen3-0.6b",
        "lengths": "natural",
        "seq_len": 4096,
        "lognormal_seq_len": 4096,
        "batch_size": 2,
        "steps": 12,
        "bf16": True,
    },
}
# TRL's trainers on CPU keep the small shape: DPO and KTO run a reference model beside the policy, GRPO and RLOO
# generate, and at the Qwen3-0.6B shape a run would take an hour on 2 cores; their results (benchmarks/results/
# bench_cpu_{sft,dpo,kto,grpo,rloo}.md) name the shape and its LM head's share
TRL_CPU_DEFAULTS = {"model": "qwen3-cpu", "lognormal_seq_len": 1024, "batch_size": 4, "steps": 12}
# Steps left out of the timing unless --warmup-steps says otherwise: the first ones compile kernels and warm
# caches. Never more than --steps minus one, so that a short run still times at least one step.
DEFAULT_WARMUP_STEPS = 2
# --trainer: which Trainer both sides run. "sft"/"dpo"/"kto"/"grpo"/"rloo": TRL's trainer of that name, plain
# against the same trainer under fasttrain.patch().
TRAINER_TYPES = ("transformers", "sft", "dpo", "kto", "grpo", "rloo")
# GRPO and RLOO generate before they train: their own defaults, per device. --seq-len limits the prompts;
# --batch-size counts completions (TRL's per_device_train_batch_size), so a step trains on batch x grad-accum /
# num_generations prompts. CPU: one prompt a step, 8 completions of up to 512 tokens, 4 steps (1 warm-up): a run
# is a few minutes on 2 cores, most of it sampling. CUDA: 4 prompts a step (2 micro-batches of 16 completions).
RL_DEFAULTS = {
    "cpu": {"seq_len": 512, "batch_size": 8, "grad_accum": 1, "steps": 4, "warmup_steps": 1},
    "cuda": {"seq_len": 512, "batch_size": 16, "grad_accum": 2, "steps": 6, "warmup_steps": 1},
}
RL_NUM_GENERATIONS = 8
RL_MAX_COMPLETION_LENGTH = 512


class UsageError(ValueError):
    pass


def _bench_parser(sub) -> argparse.ArgumentParser:
    from .bench import models  # light: no torch, no transformers

    p = sub.add_parser(
        "bench",
        help="run the transformers Trainer and fasttrain side by side",
        description="Train the same model on the same data with the same seed and arguments, once with "
        "transformers.Trainer and once with fasttrain.Trainer (or, with --trainer sft/dpo/kto/grpo/rloo, TRL's "
        "trainer plain and under fasttrain.patch()), each in its own process, alternating repetitions; then print "
        "a side-by-side table. GRPO and RLOO steps have two phases, reported apart: generation (the time inside "
        "model.generate, which fasttrain does not touch) and training (the rest of the step: rewards, scoring, "
        "the loss forward and backward, the optimizer step); their tokens/s and step time are the training "
        "phase's, peak memory is given for each phase and for the whole run.",
    )
    p.set_defaults(command_parser=p)  # main() reports a misspelled option with this parser's usage
    p.add_argument(
        "--trainer",
        choices=TRAINER_TYPES,
        default="transformers",
        help="transformers: transformers.Trainer against fasttrain.Trainer; sft / dpo / kto / grpo / rloo: TRL's "
        "SFTTrainer / DPOTrainer / KTOTrainer / GRPOTrainer / RLOOTrainer (completion-only SFT; DPO and KTO with a "
        "reference model; GRPO and RLOO generating --num-generations completions per prompt with model.generate, "
        "rewarded by cheap deterministic functions), plain against under fasttrain.patch() (needs trl; default: "
        "transformers)",
    )
    shapes = "; ".join(
        f"{n}: {models.describe_summary(models.builtin_summary(n))}" for n in models.BUILTIN_SHAPES
    )
    p.add_argument(
        "--model",
        # argparse %-formats help strings: the shapes' percentages need doubling
        help=f"a built-in Qwen3 shape at random init ({shapes.replace('%', '%%')}), a local directory or a hub "
        "id (default: qwen3-0.6b; on CPU with --trainer sft/dpo/kto/grpo/rloo: qwen3-cpu, a small shape whose LM "
        "head is ~98%% of its FLOPs)",
    )
    p.add_argument(
        "--dataset",
        default="default",
        help="'default' (the Python standard library's sources), "
        "a local .json/.jsonl/.parquet/.txt file with a 'text' column or lines, or a hub dataset id",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="default: cuda when available, else cpu",
    )
    p.add_argument(
        "--lengths",
        choices=["natural", "lognormal"],
        help="example lengths: 'natural' (each document of the dataset, truncated to --seq-len) or "
        "'lognormal' (drawn like instruction data: median 180 tokens, clipped to 16..--seq-len, filled from "
        "the dataset's token stream) (default: lognormal on cpu, natural on cuda)",
    )
    rl_cpu, rl_cuda = RL_DEFAULTS["cpu"], RL_DEFAULTS["cuda"]
    p.add_argument(
        "--steps",
        type=int,
        help=f"optimizer steps per run (default: 12; grpo/rloo: {rl_cpu['steps']} on cpu, {rl_cuda['steps']} on cuda)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        help="maximum tokens per example (default: 1024 on cpu with --lengths lognormal, 256 with natural; "
        f"4096 on cuda); grpo/rloo: per prompt (default: {rl_cpu['seq_len']})",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help="per-device batch size (default: 4 on cpu, 2 on cuda); grpo/rloo: completions per micro-batch, as "
        f"TRL's per_device_train_batch_size (default: {rl_cpu['batch_size']} on cpu, {rl_cuda['batch_size']} on "
        "cuda)",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        help=f"gradient accumulation steps (default: 1; grpo/rloo: {rl_cpu['grad_accum']} on cpu, "
        f"{rl_cuda['grad_accum']} on cuda)",
    )
    p.add_argument(
        "--num-generations",
        type=int,
        help="grpo/rloo: completions per prompt; --batch-size x --grad-accum must be a multiple of it "
        f"(default: {RL_NUM_GENERATIONS})",
    )
    p.add_argument(
        "--max-completion-length",
        type=int,
        help=f"grpo/rloo: longest completion in tokens (default: {RL_MAX_COMPLETION_LENGTH})",
    )
    p.add_argument(
        "--completions",
        choices=["sampled", "synthetic"],
        help="grpo/rloo: 'sampled' by TRL with model.generate (seeded; a built-in model gets extra stop ids, so that "
        "lengths vary below the limit) or 'synthetic': model.generate replaced by random tokens of log-normal "
        "lengths (median 180, up to --max-completion-length), no model call, so the run measures the training "
        "phase alone (default: sampled)",
    )
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 weights and bf16=True (default: on for cuda, off for cpu)",
    )
    p.add_argument("--repeats", type=int, default=2, help="repetitions per contender (default: 2)")
    p.add_argument(
        "--warmup-steps",
        type=int,
        help=f"first steps left out of the timing (default: {DEFAULT_WARMUP_STEPS}; grpo/rloo: "
        f"{rl_cpu['warmup_steps']}; at most --steps minus 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default: 1e-3)")
    p.add_argument("--threads", type=int, help="torch threads in every run (default: all usable cores)")
    p.add_argument(
        "--group-by-length",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train_sampling_strategy='group_by_length' on both sides (default: off, as in most fine-tuning "
        "scripts; only for --trainer transformers and sft: the other trainers' rows have no input_ids column to "
        "group by)",
    )
    p.add_argument(
        "--liger",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add transformers.Trainer with use_liger_kernel=True as a third contender "
        "(default: on for cuda when liger_kernel is installed)",
    )
    p.add_argument(
        "--ablate",
        nargs="?",
        const="",
        metavar="PATHS",
        help="also run fasttrain with each hot path switched off in turn (FASTTRAIN_DISABLE=<name>), and with "
        "all off; the report shows each path's share (fasttrain's speed and memory with it against without it). "
        f"Optionally only the comma-separated PATHS (of {', '.join(HotPaths.names())}, all)",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument(
        "--markdown", metavar="PATH", help="write the table as Markdown, with date, machine, versions"
    )
    p.add_argument("--plot", metavar="PATH", help="write a PNG: loss curves, throughput and memory bars")
    p.add_argument(
        "--profile",
        metavar="PATH",
        help="after the timed runs, one more run per contender that profiles one step after the warm-up "
        "(torch.profiler, not counted in the figures) and writes to PATH, as Markdown, where that step's time goes: "
        "matmuls, LM head, attention, optimizer, elementwise and other ops, outside operators, and beside them "
        "the matmul limit, system CPU time and page faults",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _version() -> str:
    from . import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fasttrain", description="fasttrain: a faster transformers Trainer")
    parser.add_argument("--version", action="version", version=f"fasttrain {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _bench_parser(sub)
    return parser


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """'unrecognized arguments: ...', with the closest known option for each misspelled one."""
    known = [option for action in parser._actions for option in action.option_strings]
    hints = []
    for extra in extras:
        name = extra.split("=", 1)[0]
        if name.startswith("--"):
            close = difflib.get_close_matches(name, known, n=1)
            if close:
                hints.append(f"{name}: did you mean {close[0]}?")
    message = "unrecognized arguments: " + " ".join(extras)
    return message + ("" if not hints else " (" + "; ".join(hints) + ")")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_output_path(option: str, path: str | None) -> None:
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {path!r}: the directory {parent!r} does not exist")


def resolve(args: argparse.Namespace):
    """Validated settings: (BenchConfig, contenders, repeats)."""
    from .bench import data, models
    from .bench.config import FASTTRAIN, GENERATING_TRAINERS, LIGER, REFERENCE, BenchConfig, Contender

    device = args.device
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    elif device == "cuda" and not _cuda_available():
        raise UsageError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    trainer_type = args.trainer
    generates = trainer_type in GENERATING_TRAINERS
    defaults = {"grad_accum": 1, "warmup_steps": None, **DEVICE_DEFAULTS[device]}
    if device == "cpu" and trainer_type != "transformers":
        defaults.update(TRL_CPU_DEFAULTS)
    if generates:
        defaults.update(RL_DEFAULTS[device], lognormal_seq_len=RL_DEFAULTS[device]["seq_len"])
    pick = lambda value, key: defaults[key] if value is None else value  # noqa: E731

    lengths = pick(args.lengths, "lengths")
    steps, seq_len, batch, grad_accum = (
        pick(args.steps, "steps"),
        pick(args.seq_len, "lognormal_seq_len" if lengths == data.LOGNORMAL else "seq_len"),
        pick(args.batch_size, "batch_size"),
        pick(args.grad_accum, "grad_accum"),
    )
    threads = args.threads if args.threads is not None else len(os.sched_getaffinity(0))
    # Derived from --steps unless given: `--steps 1` alone must not trip over an option the user never set.
    warmup = args.warmup_steps
    if warmup is None:
        warmup = min(defaults["warmup_steps"] or DEFAULT_WARMUP_STEPS, max(steps - 1, 0))
    rl_options = (
        ("--num-generations", args.num_generations),
        ("--max-completion-length", args.max_completion_length),
        ("--completions", args.completions),
    )
    if not generates:
        given = [option for option, value in rl_options if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} only apply to --trainer grpo and rloo")
    num_generations = RL_NUM_GENERATIONS if args.num_generations is None else args.num_generations
    max_completion = (
        RL_MAX_COMPLETION_LENGTH if args.max_completion_length is None else args.max_completion_length
    )
    for option, value, minimum in (
        ("--steps", steps, 1),
        ("--seq-len", seq_len, data.MIN_TOKENS),
        ("--batch-size", batch, 1),
        ("--grad-accum", grad_accum, 1),
        ("--repeats", args.repeats, 1),
        ("--warmup-steps", warmup, 0),
        ("--threads", threads, 1),
        ("--num-generations", num_generations, 2),
        ("--max-completion-length", max_completion, 1),
    ):
        if value < minimum:
            raise UsageError(f"{option} must be at least {minimum} (got {value})")
    if warmup >= steps:
        raise UsageError(f"--warmup-steps ({warmup}) must be smaller than --steps ({steps})")
    if generates and (batch * grad_accum) % num_generations:
        raise UsageError(
            f"--batch-size x --grad-accum ({batch} x {grad_accum}) must be a multiple of --num-generations "
            f"({num_generations}): each step trains on whole groups of one prompt's completions"
        )
    if trainer_type != "transformers" and importlib.util.find_spec("trl") is None:
        raise UsageError(f"--trainer {trainer_type} needs TRL, which is not installed (pip install trl)")
    group_by_length = bool(args.group_by_length)
    if group_by_length and trainer_type not in ("transformers", "sft"):
        raise UsageError(
            f"--group-by-length does not apply to --trainer {trainer_type}: its rows have no input_ids column"
        )
    if not args.lr > 0:
        raise UsageError(f"--lr must be positive (got {args.lr})")
    model = pick(args.model, "model")
    try:
        models.check_model_spec(model)
        data.check_dataset_spec(args.dataset)
    except (models.ModelError, data.DatasetError) as exc:
        raise UsageError(str(exc)) from None
    bf16 = pick(args.bf16, "bf16")
    if bf16 and device == "cpu":
        import torch

        if not torch.backends.mkldnn.is_available():
            raise UsageError("--bf16 on cpu needs a torch build with oneDNN (mkldnn)")

    liger_installed = importlib.util.find_spec("liger_kernel") is not None
    liger = args.liger if args.liger is not None else (device == "cuda" and liger_installed and not generates)
    if liger and generates:
        raise UsageError(
            f"--liger does not apply to --trainer {trainer_type}: TRL keeps its own fused LM head there"
        )
    if liger and not liger_installed:
        raise UsageError("--liger: liger_kernel is not installed (pip install liger-kernel)")
    if liger and device != "cuda":
        raise UsageError("--liger needs --device cuda (Liger's Triton kernels do not run on cpu)")
    for option, path in (
        ("--json", args.json),
        ("--markdown", args.markdown),
        ("--plot", args.plot),
        ("--profile", args.profile),
    ):
        _check_output_path(option, path)
    if args.plot:
        from .bench.report import PlotUnavailable, check_plot_available

        try:
            check_plot_available()
        except PlotUnavailable as exc:
            raise UsageError(str(exc)) from None

    config = BenchConfig(
        model=model,
        dataset=args.dataset,
        device=device,
        steps=steps,
        seq_len=seq_len,
        batch_size=batch,
        grad_accum=grad_accum,
        bf16=bf16,
        seed=args.seed,
        threads=threads,
        learning_rate=args.lr,
        warmup_steps=warmup,
        group_by_length=group_by_length,
        trainer_type=trainer_type,
        lengths=lengths,
        num_generations=num_generations,
        max_completion_length=max_completion,
        completions=args.completions or "sampled",
    )
    contenders = [Contender(REFERENCE, REFERENCE), Contender(FASTTRAIN, FASTTRAIN)]
    if liger:
        contenders.insert(1, Contender(LIGER, LIGER))
    if args.ablate is not None:
        contenders += [Contender(f"fasttrain-no-{name}", FASTTRAIN, name) for name in _ablated(args.ablate)]
    return config, contenders, args.repeats


def _ablated(spec: str) -> list[str]:
    """The hot paths --ablate switches off one at a time: every one and "all", or those named."""
    known = (*HotPaths.names(), "all")
    if not spec.strip():
        return list(known)
    names = list(dict.fromkeys(n.strip().lower() for n in spec.split(",") if n.strip()))
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(
            f"--ablate names unknown hot path(s) {', '.join(unknown)}; known: {', '.join(known)}"
        )
    return names


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def announce(config, contenders, repeats: int) -> list[str]:
    """What is about to run, said before the first run (minutes before the table): the runs, their steps and
    the warm-up left out of the timing, the model's size; a warning when no warm-up step is left out."""
    from .bench.report import NO_WARMUP_NOTE, model_note, plural, warmup_note

    runs = len(contenders) * repeats
    lines = [
        f"fasttrain bench: {plural(runs, 'run')} ({', '.join(c.name for c in contenders)}; "
        f"{plural(repeats, 'repetition')} each) of {plural(config.steps, 'optimizer step')}, "
        f"{warmup_note(config.warmup_steps)}; model {model_note(config.model)}"
    ]
    if config.generates:
        from .bench.report import rl_note

        lines.append(f"fasttrain bench: {rl_note(config)}; generation and training phases timed apart")
    if config.warmup_steps == 0:
        lines.append(f"fasttrain bench: warning: {NO_WARMUP_NOTE}")
    return lines


def bench(args: argparse.Namespace, argv: list[str]) -> int:
    from .bench import report, runner, summary

    config, contenders, repeats = resolve(args)
    for line in announce(config, contenders, repeats):
        print(line, file=sys.stderr)
    limit = None
    if config.trainer_type == "transformers":  # the model FLOPs a token costs are known for plain causal LMs
        from .bench.roofline import measure_matmul_rate

        limit = measure_matmul_rate(config.device, config.threads)
    started = time.perf_counter()
    load_start = _load_average()
    planned = len(contenders) * repeats

    def assemble(results, failures, complete: bool) -> dict:
        data = summary.build(results, failures)
        data["config"] = config.to_json()
        data["command"] = shlex.join(["fasttrain", *argv])
        data["wall_s"] = time.perf_counter() - started
        data["complete"] = complete
        # a failed run counts as done; the skipped repetitions of a failed contender never will be
        data["runs_done"] = sum(len(runs) for runs in results.values()) + len(failures)
        data["runs_planned"] = planned
        if load_start is not None:
            data["load_average"] = {"start": load_start, "end": _load_average()}
            during = [
                r["load_average_during"]
                for runs in results.values()
                for r in runs
                if "load_average_during" in r
            ]
            if during:
                data["load_average"]["during_runs"] = {
                    "mean": sum(d["mean"] for d in during) / len(during),
                    "max": max(d["max"] for d in during),
                }
        data["environment"] = report.environment(data)
        if limit is not None:
            from .bench.roofline import percent_of_limit

            data["matmul_limit"] = limit
            for side in [*data.values(), *data.get("ablations", {}).values()]:
                if isinstance(side, dict) and "tokens_per_s" in side:
                    side["percent_of_matmul_limit"] = percent_of_limit(side, limit["matmul_flops_per_s"])
        return data

    def write_files(data: dict) -> None:
        if args.json:
            report.write_json(args.json, data)
        if args.markdown:
            report.write_text(args.markdown, report.markdown(config, data))

    results, failures = runner.run_all(
        config,
        contenders,
        repeats,
        progress=not args.no_progress,
        on_run=lambda results, failures: write_files(assemble(results, failures, complete=False)),
    )
    data = assemble(results, failures, complete=True)
    print(report.text_table(config, data))
    if args.profile:
        from .bench.profile_runs import profile_contenders

        data["profile"] = profile_contenders(config, contenders, failures, limit, argv, args.profile)
    write_files(data)
    if args.plot and report.finished_columns(data):
        report.plot(args.plot, config, data)
    for option, path in (
        ("json", args.json),
        ("markdown", args.markdown),
        ("plot", args.plot),
        ("profile", args.profile),
    ):
        if path:
            print(f"{option}: {path}", file=sys.stderr)
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
    from .bench.runner import BenchError, RunFailed

    try:
        return bench(args, argv)
    except (UsageError, BenchError) as exc:
        print(f"fasttrain bench: error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"fasttrain bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fasttrain bench: interrupted", file=sys.stderr)
        return 130
