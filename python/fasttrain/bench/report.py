"""What the bench shows and writes: the side-by-side table (terminal and Markdown), the JSON, the plot."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
from typing import Any

from .config import BenchConfig

_PACKAGES = (
    "fasttrain",
    "torch",
    "transformers",
    "accelerate",
    "tokenizers",
    "datasets",
    "triton",
    "liger-kernel",
    "trl",
)
# What the reference and fasttrain columns are, per --trainer
_SIDES = {
    "transformers": ("transformers.Trainer, optim=adamw_torch_fused", "fasttrain.Trainer"),
    "sft": ("TRL SFTTrainer, plain", "TRL SFTTrainer under fasttrain.patch()"),
    "dpo": ("TRL DPOTrainer, plain", "TRL DPOTrainer under fasttrain.patch()"),
    "kto": ("TRL KTOTrainer, plain", "TRL KTOTrainer under fasttrain.patch()"),
    "grpo": ("TRL GRPOTrainer, plain", "TRL GRPOTrainer under fasttrain.patch()"),
    "rloo": ("TRL RLOOTrainer, plain", "TRL RLOOTrainer under fasttrain.patch()"),
}


class PlotUnavailable(RuntimeError):
    """``--plot`` without matplotlib."""


def cpu_model() -> str:
    """The CPU's model name, for the provenance of every benchmark result."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def environment(results: dict[str, Any]) -> dict[str, Any]:
    versions: dict[str, str] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu_model(),
        "cores": cores,
        "memory_gib": round(_memory_gib() or 0.0, 1) or None,
        "platform": platform.platform(),
        "versions": versions,
    }
    gpu = results.get("reference", {}).get("gpu_name")
    if gpu:
        env["gpu"] = gpu
    return env


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _hot_paths(summary: dict[str, Any]) -> str:
    """'optimizer, loss on; off: sampler (group_by_length is not set)'. A status is "on" or "off: <why>": the
    "off: " is said once, before the list, not again inside each reason."""
    status = summary.get("hot_paths") or {}
    if not status:
        return "none reported" if summary["trainer"] == "fasttrain" else "-"
    on = [name for name, state in status.items() if state == "on"]
    off = []
    for name, state in status.items():
        if state != "on":
            reason = state.removeprefix("off:").strip() if state.startswith("off:") else state
            off.append(f"{name} ({reason})" if reason and reason != "off" else name)
    parts = ([", ".join(on) + " on"] if on else []) + (["off: " + ", ".join(off)] if off else [])
    return "; ".join(parts)


def plural(count: int, noun: str) -> str:
    """'1 step', '2 steps'."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


# Said before the runs (cli) and under the table: with nothing excluded, the first step's one-off costs count.
NO_WARMUP_NOTE = (
    "no warm-up step is excluded from the timing: the figures include the first step's one-off costs "
    "(kernel compilation, first allocations, cold caches); run 2 or more --steps (up to 2 are left out by "
    "default) with --warmup-steps unset or at least 1"
)
# Which way is better, per ratio: the rows carry it in their label, this line says how to read the parentheses.
RATIO_LEGEND = (
    "ratios in parentheses are the contender's value over the reference's: above 1x is better where a row "
    "says 'higher is better' (tokens/s, tokens per CPU-second), below 1x where it says 'lower is better' "
    "(step time, memory)"
)


def finished_columns(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Contenders with at least one finished run, in table order."""
    columns = [(name, data[name]) for name in ("reference", "liger", "fasttrain") if name in data]
    columns += list(data.get("ablations", {}).items())
    return columns


def _table_columns(data: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None]]:
    """``finished_columns`` plus, in their place, the contenders that failed before finishing a run (``None``)."""
    finished = dict(finished_columns(data))
    failed = [name for name in data.get("failed", {}) if name not in finished]
    order = ["reference", "liger", "fasttrain"]
    named = [(n, finished.get(n)) for n in order if n in finished or n in failed]
    rest = [(n, finished.get(n)) for n in dict.fromkeys([*finished, *failed]) if n not in order]
    return named + rest


def _first_line(error: str, limit: int = 160) -> str:
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    # RunFailed carries the child's log tail: its last line is the exception; the first says which run
    text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


HIGHER = "higher is better"
LOWER = "lower is better"


def rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the side-by-side table (one column per contender, ratios against the reference).
    A contender that failed before finishing a run has a column of "failed" and its error in the last row."""
    columns = _table_columns(data)
    comparison = data["comparison"]
    failed = data.get("failed", {})
    header = ["", *[name for name, _ in columns]]

    def line(label: str, key: str, digits: int = 1, ratio_key: str | None = None) -> list[str]:
        cells = [label]
        for name, summary in columns:
            if summary is None:
                cells.append("failed")
                continue
            cell = _fmt(summary.get(key), digits)
            vs = comparison.get(f"{name}_vs_reference")
            if ratio_key and vs is not None and cell != "n/a":
                cell += f" ({_ratio(vs.get(ratio_key))})"
            cells.append(cell)
        return cells

    if _has_phases(data):
        table = _phase_lines(line, synthetic=data.get("config", {}).get("completions") == "synthetic")
    else:
        table = [
            line(f"tokens/s ({HIGHER})", "tokens_per_s", 1, "tokens_per_s_ratio"),
            line(f"step time, s ({LOWER})", "step_time_s", 3, "step_time_ratio"),
            line(f"tokens per CPU-second ({HIGHER})", "tokens_per_cpu_s", 1, "tokens_per_cpu_s_ratio"),
            line(f"peak memory, MB ({LOWER})", "peak_memory_mb", 0, "peak_memory_ratio"),
            line(f"  of which above setup, MB ({LOWER})", "peak_above_setup_mb", 0, "peak_above_setup_ratio"),
        ]
        if "matmul_limit" in data:
            table.append(line(f"step at % of its matmul limit ({HIGHER})", "percent_of_matmul_limit", 0))
    table.append(line("final loss", "final_loss", 4))
    diff = ["largest per-step loss diff vs reference (abs / rel)"]
    worst = ["largest per-step metric diff vs reference (rel, metric)"]
    floor = ["largest loss diff between own repetitions"]
    for name, summary in columns:
        vs = comparison.get(f"{name}_vs_reference")
        if summary is None:
            diff.append("failed")
            worst.append("failed")
            floor.append("failed")
            continue
        if vs is None:
            diff.append("-")
            worst.append("-")
        else:
            d = vs["loss_difference"]
            diff.append(f"{_sci(d['max_abs'])} / {_sci(d['max_rel'])}".replace("n/a / n/a", "n/a"))
            w = vs.get("largest_metric_difference") or {}
            if w.get("metric"):
                worst.append(f"{_sci(w.get('max_rel'))} ({w['metric']})")
            else:
                worst.append("0 (every metric equal)" if w.get("max_rel") == 0 else "n/a")
        floor.append(_sci(summary["loss_difference_between_repetitions"]))
    table += [diff, worst, floor, ["hot paths", *[_hot_paths(s) if s else "failed" for _, s in columns]]]
    if failed:
        table.append(["error", *[_first_line(failed[n]) if n in failed else "-" for n, _ in columns]])
    return header, table


def _has_phases(data: dict[str, Any]) -> bool:
    """GRPO and RLOO results: a generation phase and a training phase per step (bench/phases.py)."""
    return any("phases" in summary for _, summary in finished_columns(data))


def _phase_lines(line, synthetic: bool = False) -> list[list[str]]:
    """The table's figures for a step in two phases, each row naming its phase; with synthetic completions no
    generation rows (their "generation" draws random numbers)."""
    rows = [
        line(f"training phase: scored tokens/s ({HIGHER})", "tokens_per_s", 1, "tokens_per_s_ratio"),
        line(
            f"training phase: s per step ({LOWER})", "training_phase_time_s", 3, "training_phase_time_s_ratio"
        ),
        line(
            f"training phase: scored tokens per CPU-second ({HIGHER})",
            "tokens_per_cpu_s",
            1,
            "tokens_per_cpu_s_ratio",
        ),
        line(
            f"training phase: peak memory, MB ({LOWER})",
            "training_peak_memory_mb",
            0,
            "training_peak_memory_mb_ratio",
        ),
        line(
            f"  of which above setup, MB ({LOWER})",
            "training_peak_above_setup_mb",
            0,
            "training_peak_above_setup_mb_ratio",
        ),
        line(
            f"generation: completion tokens/s ({HIGHER})",
            "generation_tokens_per_s",
            1,
            "generation_tokens_per_s_ratio",
        ),
        line(f"generation: s per step ({LOWER})", "generation_time_s", 3, "generation_time_s_ratio"),
        line(
            f"generation: peak memory, MB ({LOWER})",
            "generation_peak_memory_mb",
            0,
            "generation_peak_memory_mb_ratio",
        ),
        line(f"whole step: s per step ({LOWER})", "step_time_s", 3, "step_time_ratio"),
        line(f"whole step: scored tokens/s ({HIGHER})", "step_tokens_per_s", 1, "step_tokens_per_s_ratio"),
        line(f"whole run: peak memory, MB ({LOWER})", "peak_memory_mb", 0, "peak_memory_ratio"),
    ]
    return [row for row in rows if not (synthetic and row[0].startswith("generation:"))]


def rl_note(config: BenchConfig) -> str:
    """What one GRPO or RLOO step does: prompts, completions, where they come from."""
    from .rl_runs import STOP_IDS, SYNTHETIC

    completions = config.batch_size * config.grad_accum
    prompts = completions // config.num_generations
    if config.completions == SYNTHETIC:
        source = "synthetic: model.generate replaced by random tokens of log-normal lengths (median 180), no model call"
    else:
        source = "sampled by TRL with model.generate (temperature 1, no top-k/top-p, seeded by --seed)"
        if config.model in _builtin_names():
            source += (
                f"; the random-init model gets {STOP_IDS} extra end-of-completion ids (generation_config."
                "eos_token_id, both sides alike), so lengths vary below the limit"
            )
    return (
        f"each optimizer step: {plural(prompts, 'prompt')} x {config.num_generations} completions (batch "
        f"{config.batch_size} completions x grad-accum {config.grad_accum}), completions up to "
        f"{config.max_completion_length} tokens, {source}; rewards: length_reward, distinct_tokens_reward "
        "(fasttrain/bench/rewards.py)"
    )


def _builtin_names() -> tuple[str, ...]:
    from .models import BUILTIN_SHAPES

    return tuple(BUILTIN_SHAPES)


PHASES_NOTE = (
    "phases: generation = the time inside model.generate (TRL samples the completions there; fasttrain does not "
    "touch it, and both sides sample the same completions, so a generation ratio away from 1x is the machine's "
    "noise); training = the rest of each optimizer step (rewards, the reference model's log-probs where TRL "
    "computes them, the loss forward and backward, the optimizer step). Training-phase tokens/s = prompt + "
    "completion tokens through the policy's loss forwards (attention mask) / training-phase time; generation "
    "tokens/s = completion tokens kept (up to the first end-of-completion id) / generation time"
)


def _mean_completion(config: BenchConfig, summary: dict[str, Any]) -> str:
    per_step = summary.get("generated_tokens_per_step") or []
    completions = config.batch_size * config.grad_accum * len(per_step)
    if not completions:
        return ""
    return f"; completions generated: {sum(per_step) / completions:,.0f} tokens on average ({summary['trainer']}'s first run)"


def metric_rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per logged metric, the largest per-step difference of each contender from the reference (abs / rel)."""
    differences = {
        name: data["comparison"][f"{name}_vs_reference"].get("metric_differences", {})
        for name, _ in finished_columns(data)
        if f"{name}_vs_reference" in data["comparison"]
    }
    metrics = sorted({metric for per_metric in differences.values() for metric in per_metric})
    table = []
    for metric in metrics:
        cells = [metric]
        for per_metric in differences.values():
            d = per_metric.get(metric)
            cells.append("n/a" if d is None else f"{_sci(d['max_abs'])} / {_sci(d['max_rel'])}")
        table.append(cells)
    return ["metric", *differences], table


def share_rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per ablated hot path: fasttrain with every path on against fasttrain with that path off."""
    header = [
        "hot path switched off",
        "tokens/s without it",
        "fasttrain with it (speed-up)",
        "tokens per CPU-second (speed-up)",
        "peak memory without it (MB)",
        "fasttrain's peak with it (ratio)",
    ]
    fasttrain = data.get("fasttrain") or {}
    table = []
    for path, share in (data.get("shares") or {}).items():
        table.append(
            [
                path,
                _fmt(share["tokens_per_s_without"], 1),
                f"{_fmt(fasttrain.get('tokens_per_s'), 1)} ({_ratio(share['speedup'])})",
                _ratio(share["tokens_per_cpu_s_speedup"]),
                _fmt(share["peak_memory_mb_without"], 0),
                f"{_fmt(fasttrain.get('peak_memory_mb'), 0)} ({_ratio(share['peak_memory_ratio'])})",
            ]
        )
    return header, table


def _ratio(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.2f}x"


def _sci(value: Any) -> str:
    """Small loss differences are the point: scientific notation, never rounded to zero first."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{float(value):.2e}"


def describe(config: BenchConfig, data: dict[str, Any]) -> list[str]:
    finished = finished_columns(data)
    if not finished:
        return ["no run finished", *_progress_note(data)]
    reference = data.get("reference") or finished[0][1]  # settings every run shares
    dtype = "bf16 weights + bf16=True" if config.bf16 else "fp32"
    reference_side, fasttrain_side = _SIDES[config.trainer_type]
    phases = _has_phases(data)
    if phases:
        shape = f"{plural(config.steps, 'step')}, {_prompts_note(config)}" + _mean_completion(
            config, reference
        )
    else:
        shape = (
            f"{plural(config.steps, 'step')} x batch {config.batch_size} x grad-accum {config.grad_accum}, "
            f"{_lengths_note(config)} (batched as each Trainer's collator does: padded per batch unless a "
            f"packing hot path is on; {'grouped by length' if config.group_by_length else 'not grouped by length'})"
        )
    memory = f"memory: {reference['memory_kind']}; 'above setup' subtracts the value right after the model and data were built"
    if phases:
        memory += (
            "; each phase's peak is the highest value while that phase ran (the peak is read and reset at every "
            "change of phase), the whole run's includes the setup"
        )
    return [
        f"reference: {reference_side}; fasttrain: {fasttrain_side}",
        f"model {model_note(config.model, reference.get('model_shape'))}, dataset {config.dataset}, "
        f"device {config.device}, {dtype}, {shape}, "
        f"seed {config.seed}" + (f", {config.threads} CPU threads" if config.device == "cpu" else ""),
        *([rl_note(config), PHASES_NOTE] if phases else []),
        f"{plural(reference['repetitions'], 'repetition')} per contender, alternating, each in its own process; "
        "medians shown; tokens/s, step time and tokens per CPU-second count non-padding tokens; "
        + warmup_note(reference["warmup_steps_excluded"]),
        *([f"WARNING: {NO_WARMUP_NOTE}"] if reference["warmup_steps_excluded"] == 0 else []),
        memory,
        RATIO_LEGEND,
        "the loss and metric differences are the largest over all steps, relative to the reference's value at "
        "that step where it is above 1e-6 in magnitude (nearer zero: absolute only) (every numeric value the Trainer "
        "logs at each step, timings left out)",
        *_share_note(data),
        *_limit_note(data),
        *_load_note(data),
        *_progress_note(data),
    ]


def _limit_note(data: dict[str, Any]) -> list[str]:
    limit = data.get("matmul_limit")
    if not limit:
        return []
    return [
        "matmul limit: the model's FLOPs per trained token (6 x parameters + causal attention, from the shapes) x "
        f"tokens/s over this machine's GEMM rate, {limit['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s "
        f"({limit['measured']}, measured at the start): 100% would be a step spent entirely in GEMMs at full speed"
    ]


def warmup_note(excluded: int) -> str:
    """'every step timed', 'the first step not timed (warm-up)', 'the first 2 steps not timed (warm-up)'."""
    if excluded == 0:
        return "every step timed"
    return "the first " + ("step" if excluded == 1 else f"{excluded} steps") + " not timed (warm-up)"


def model_note(model: str, shape: dict[str, Any] | None = None) -> str:
    """'tiny (hidden 32, 1 layer, ...)': the shape the run recorded, else a built-in's own; a name alone when
    neither is known (results written before shapes were recorded, a model that failed to load)."""
    from .models import BUILTIN_SHAPES, builtin_summary, describe_summary

    if shape is None and model in BUILTIN_SHAPES:
        shape = builtin_summary(model)
    return f"{model} ({describe_summary(shape)})" if shape else model


def _lengths_note(config: BenchConfig) -> str:
    from .data import LOGNORMAL, LOGNORMAL_MEDIAN, LOGNORMAL_SIGMA, MIN_TOKENS

    if getattr(config, "lengths", "natural") == LOGNORMAL:
        return (
            f"example lengths log-normal (median {LOGNORMAL_MEDIAN}, sigma {LOGNORMAL_SIGMA}, "
            f"{MIN_TOKENS}..{config.seq_len} tokens)"
        )
    return f"sequences up to {config.seq_len} tokens (the data's natural lengths)"


def _prompts_note(config: BenchConfig) -> str:
    from .data import LOGNORMAL, LOGNORMAL_MEDIAN, MIN_TOKENS

    if getattr(config, "lengths", "natural") == LOGNORMAL:
        return f"prompts of log-normal lengths (median {LOGNORMAL_MEDIAN}, {MIN_TOKENS}..{config.seq_len} tokens)"
    return f"prompts up to {config.seq_len} tokens (the data's natural lengths)"


def _share_note(data: dict[str, Any]) -> list[str]:
    if not data.get("shares"):
        return []
    return [
        "each hot path's share (table below): fasttrain with every path on against fasttrain with that one "
        "path off (FASTTRAIN_DISABLE=<path>), medians of each; a speed-up above 1 is what the path adds, a "
        "peak ratio below 1 the memory it saves"
    ]


def _progress_note(data: dict[str, Any]) -> list[str]:
    """A file written while the bench runs says so; a failed contender's full error is in the JSON."""
    notes = []
    if data.get("complete") is False:
        notes.append(
            f"partial: {data.get('runs_done', '?')} of {data.get('runs_planned', '?')} runs done when this was "
            "written (rewritten after every run: a bench cut short keeps what finished)"
        )
    if "reference" not in data and data.get("failed", {}).get("reference"):
        notes.append("the reference failed: no ratios")
    for name in data.get("failed", {}):
        notes.append(f"{name} failed; its remaining repetitions were skipped (full error in the JSON)")
    return notes


def _load_note(data: dict[str, Any]) -> list[str]:
    """Other work on the machine slows both sides but makes wall-time ratios noisy: say how loaded it was."""
    load = data.get("load_average")
    cores = data.get("environment", {}).get("cores")
    if not load or not cores:
        return []
    note = f"machine load average (1 min) at start / end: {load['start']:.1f} / {load['end']:.1f} on {cores} cores"
    during = load.get("during_runs")
    highest = max(load["start"], load["end"])
    if during:  # sampled every few seconds while the runs ran: the runs themselves count up to their threads
        note += f"; during the runs: mean {during['mean']:.1f}, highest {during['max']:.1f}"
        highest = max(highest, during["mean"])
    if highest > cores:
        note += (
            " -- other processes competed for the CPU, so wall-time figures are noisy; "
            "tokens per CPU-second is much less affected"
        )
    return [note]


def text_table(config: BenchConfig, data: dict[str, Any]) -> str:
    header, table = rows(data)
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *table]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    header, table = share_rows(data)
    if table:
        widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
        shares = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *table]
        ]
        shares.insert(1, "  ".join("-" * w for w in widths))
        lines += ["", "Each hot path's share (fasttrain with it vs without it):", *shares]
    return "\n".join([*lines, "", *describe(config, data)])


def markdown(config: BenchConfig, data: dict[str, Any], title: str = "fasttrain bench") -> str:
    header, table = rows(data)
    env = data["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    machine = f"{env['cpu']}, {env['cores']} cores, {env['memory_gib']} GiB"
    if env.get("gpu"):
        machine = f"{env['gpu']}; host: {machine}"
    out = [
        f"# {title}",
        "",
        f"- date (UTC): {env['date_utc']}",
        f"- machine: {machine}",
        f"- versions: {versions}",
        f"- command: `{data['command']}`",
        f"- total wall time: {data['wall_s']:.0f} s",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join([" --- "] + [" ---: "] * (len(header) - 1)) + "|",
    ]
    out += ["| " + " | ".join(cell.replace("|", "/") for cell in r) + " |" for r in table]
    out += ["", *[f"- {line}" for line in describe(config, data)], ""]
    header, table = share_rows(data)
    if table:
        out += [
            "## Each hot path's share (fasttrain with every path on vs with that one off)",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join([" --- "] + [" ---: "] * (len(header) - 1)) + "|",
            *["| " + " | ".join(r) + " |" for r in table],
            "",
        ]
    header, table = metric_rows(data)
    if table:
        out += [
            "## Largest per-step difference from the reference, per logged metric (abs / rel)",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join([" --- "] + [" ---: "] * (len(header) - 1)) + "|",
            *["| " + " | ".join(r) + " |" for r in table],
            "",
        ]
    return "\n".join(out)


def _jsonable(value: Any) -> Any:
    """NaN is not JSON: write null instead."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def write_text(path: str, text: str) -> None:
    """Written whole or not at all: a bench killed at its time cap never leaves half a file."""
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(partial, path)


def write_json(path: str, data: dict[str, Any]) -> None:
    write_text(path, json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n")


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'fasttrain[plot]' (or matplotlib)"
        ) from None


def plot(path: str, config: BenchConfig, data: dict[str, Any]) -> None:
    """Loss curves overlaid, and bars for throughput and peak memory, in one PNG."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    columns = finished_columns(data)
    names = [name for name, _ in columns]
    fig, (ax_loss, ax_tps, ax_mem) = plt.subplots(
        1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [2, 1, 1]}
    )
    colors = ["0.6" if name == "reference" else f"C{i}" for i, name in enumerate(names)]
    for (name, summary), color in zip(columns, colors, strict=True):
        steps = [i + 1 for i, loss in enumerate(summary["losses"]) if loss is not None]
        losses = [loss for loss in summary["losses"] if loss is not None]
        if name == "reference":  # wide and pale underneath, so that matching curves stay visible
            ax_loss.plot(steps, losses, color="0.6", linewidth=4, alpha=0.6, label=name, zorder=1)
        else:
            ax_loss.plot(steps, losses, color=color, marker=".", label=name, zorder=2)
    ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title("loss per step")
    ax_loss.legend()
    for axis, key, title in (
        (ax_tps, "tokens_per_s", "throughput (tokens/s, higher is better)"),
        (ax_mem, "peak_memory_mb", f"peak memory (MB, lower is better)\n{columns[0][1]['memory_kind']}"),
    ):
        values = [summary[key] for _, summary in columns]
        bars = axis.bar(names, values, color=colors)
        base = values[0]
        axis.bar_label(bars, labels=[f"{v / base:.2f}x" if base else "" for v in values], fontsize=9)
        axis.set_title(title, fontsize=10)
        axis.tick_params(axis="x", rotation=30 if len(names) > 3 else 0)
    fig.suptitle(
        f"fasttrain bench: {config.model} on {config.device}, seq {config.seq_len}, batch {config.batch_size}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
