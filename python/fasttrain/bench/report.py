"""What the bench shows and writes: the side-by-side table (terminal and Markdown), the JSON, the plot."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from . import provenance
from .config import BenchConfig
from .data import FULL, LOGNORMAL, describe_lognormal
from .models import BUILTIN_SHAPES, builtin_summary, describe_summary
from .rl_runs import STOP_IDS, SYNTHETIC

# What the reference and fasttrain columns are, per --trainer
_SIDES = {t: (f"TRL {t.upper()}Trainer, plain", f"TRL {t.upper()}Trainer under fasttrain.patch()")
          for t in ("sft", "dpo", "kto", "grpo", "rloo")}  # fmt: skip
_SIDES["transformers"] = ("transformers.Trainer, optim=adamw_torch_fused", "fasttrain.Trainer")


class PlotUnavailable(RuntimeError):
    """``--plot`` without matplotlib."""


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _fmt(value: Any, digits: int = 1) -> str:
    return "n/a" if _missing(value) else f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def _hot_paths(summary: dict[str, Any]) -> str:
    """'optimizer, loss on; off: sampler (group_by_length is not set)'. A status is "on" or "off: <why>": the
    "off: " is said once, before the list, not again inside each reason."""
    status = summary.get("hot_paths") or {}
    if not status:
        return "none reported"
    on = [name for name, state in status.items() if state == "on"]
    reasons = {name: state.removeprefix("off:").strip() for name, state in status.items() if state != "on"}
    off = [f"{name} ({reason})" if reason and reason != "off" else name for name, reason in reasons.items()]
    return "; ".join(([", ".join(on) + " on"] if on else []) + (["off: " + ", ".join(off)] if off else []))


def plural(count: int, noun: str) -> str:
    """'1 step', '2 steps'."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


# Said before the runs (cli) and under the table: with nothing excluded, the first step's one-off costs count.
NO_WARMUP_NOTE = (
    "no warm-up step is excluded from the timing: the figures include the first step's one-off costs "
    "(kernel compilation, first allocations, cold caches); run 2 or more --steps (up to 2 are left out by "
    "default) with --warmup-steps unset or at least 1"
)


_ORDER = ("reference", "liger", "fasttrain")  # the table's first columns; the ablations follow


def finished_columns(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Contenders with at least one finished run, in table order."""
    return [(name, data[name]) for name in _ORDER if name in data] + list(data.get("ablations", {}).items())


def _table_columns(data: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None]]:
    """``finished_columns`` plus, in their place, the contenders that failed before finishing a run (``None``)."""
    finished = dict(finished_columns(data))
    rank = {name: index for index, name in enumerate(_ORDER)}
    names = sorted(dict.fromkeys([*finished, *data.get("failed", {})]), key=lambda n: rank.get(n, len(rank)))
    return [(name, finished.get(name)) for name in names]


def _first_line(error: str, limit: int = 160) -> str:
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    # RunFailed carries the child's log tail: its last line is the exception; the first says which run
    text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


HIGHER, LOWER = "higher is better", "lower is better"
# The table's figures: (label, key, digits, key of the ratio against the reference)
_ROWS = [
    (f"tokens/s ({HIGHER})", "tokens_per_s", 1, "tokens_per_s_ratio"),
    (f"step time, s ({LOWER})", "step_time_s", 3, "step_time_ratio"),
    (f"tokens per CPU-second ({HIGHER})", "tokens_per_cpu_s", 1, "tokens_per_cpu_s_ratio"),
    (f"peak memory, MB ({LOWER})", "peak_memory_mb", 0, "peak_memory_ratio"),
    (f"  of which above setup, MB ({LOWER})", "peak_above_setup_mb", 0, "peak_above_setup_ratio"),
    (f"step at % of its matmul limit ({HIGHER})", "percent_of_matmul_limit", 0, None),
]
# GRPO and RLOO: a step in two phases (bench/phases.py), each row naming its phase
_PHASE_ROWS = [
    (f"training phase: scored tokens/s ({HIGHER})", "tokens_per_s", 1, "tokens_per_s_ratio"),
    (f"training phase: s per step ({LOWER})", "training_phase_time_s", 3, "training_phase_time_s_ratio"),
    (f"training phase: scored tokens per CPU-second ({HIGHER})", "tokens_per_cpu_s", 1, "tokens_per_cpu_s_ratio"),
    (f"training phase: peak memory, MB ({LOWER})", "training_peak_memory_mb", 0, "training_peak_memory_mb_ratio"),
    (f"  of which above setup, MB ({LOWER})", "training_peak_above_setup_mb", 0,
     "training_peak_above_setup_mb_ratio"),
    (f"generation: completion tokens/s ({HIGHER})", "generation_tokens_per_s", 1, "generation_tokens_per_s_ratio"),
    (f"generation: s per step ({LOWER})", "generation_time_s", 3, "generation_time_s_ratio"),
    (f"generation: peak memory, MB ({LOWER})", "generation_peak_memory_mb", 0, "generation_peak_memory_mb_ratio"),
    (f"whole step: s per step ({LOWER})", "step_time_s", 3, "step_time_ratio"),
    (f"whole step: scored tokens/s ({HIGHER})", "step_tokens_per_s", 1, "step_tokens_per_s_ratio"),
    (f"whole run: peak memory, MB ({LOWER})", "peak_memory_mb", 0, "peak_memory_ratio"),
]  # fmt: skip


def rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the side-by-side table (one column per contender, ratios against the reference).
    A contender that failed before finishing a run has a column of "failed" and its error in the last row."""
    columns = _table_columns(data)
    vs_reference = {name: data["comparison"].get(f"{name}_vs_reference") for name, _ in columns}

    def line(label: str, cell) -> list[str]:
        """``cell(summary, comparison with the reference or None)`` per contender; "failed" for a failed one."""
        return [label, *("failed" if s is None else cell(s, vs_reference[n]) for n, s in columns)]

    def figure(label: str, key: str, digits: int = 1, ratio_key: str | None = None) -> list[str]:
        def cell(summary: dict[str, Any], vs: dict[str, Any] | None) -> str:
            text = _fmt(summary.get(key), digits)
            return f"{text} ({_ratio(vs.get(ratio_key))})" if ratio_key and vs and text != "n/a" else text

        return line(label, cell)

    synthetic = data.get("config", {}).get("completions") == "synthetic"
    figures = _PHASE_ROWS if _has_phases(data) else _ROWS[: 6 if "matmul_limit" in data else 5]
    # synthetic completions: no generation rows (their "generation" draws random numbers)
    table = [figure(*row) for row in figures if not (synthetic and row[0].startswith("generation:"))]
    table.append(figure("final loss", "final_loss", 4))

    def worst(w: dict[str, Any]) -> str:
        if w.get("metric"):
            return f"{_sci(w.get('max_rel'))} ({w['metric']})"
        return "0 (every metric equal)" if w.get("max_rel") == 0 else "n/a"

    table += [
        line("largest per-step loss diff vs reference (abs / rel)",
                  lambda s, vs: "-" if vs is None else _abs_rel(vs["loss_difference"]).replace("n/a / n/a", "n/a")),
        line("largest per-step metric diff vs reference (rel, metric)",
                  lambda s, vs: "-" if vs is None else worst(vs.get("largest_metric_difference") or {})),
        line("largest loss diff between own repetitions",
                  lambda s, vs: _sci(s["loss_difference_between_repetitions"])),
    ]  # fmt: skip
    if failed := data.get("failed"):
        table.append(["error", *[_first_line(failed[n]) if n in failed else "-" for n, _ in columns]])
    return ["", *[name for name, _ in columns]], table


def _has_phases(data: dict[str, Any]) -> bool:
    """GRPO and RLOO results: a generation phase and a training phase per step (bench/phases.py)."""
    return any("phases" in summary for _, summary in finished_columns(data))


def rl_note(config: BenchConfig) -> str:
    """What one GRPO or RLOO step does: prompts, completions, where they come from."""
    prompts = config.batch_size * config.grad_accum // config.num_generations
    if config.completions == SYNTHETIC:
        source = f"synthetic ({describe_lognormal(config.max_completion_length, lower=1)}, no model call)"
    else:
        source = "sampled by TRL's model.generate, seeded"
        if config.model in BUILTIN_SHAPES:
            source += f", {STOP_IDS} extra end-of-completion ids"
    return (
        f"each optimizer step: {plural(prompts, 'prompt')} x {config.num_generations} completions (batch "
        f"{config.batch_size} x grad-accum {config.grad_accum}), completions up to "
        f"{config.max_completion_length} tokens, {source}"
    )


def _mean_completion(config: BenchConfig, summary: dict[str, Any]) -> str:
    per_step = summary.get("generated_tokens_per_step") or []
    completions = config.batch_size * config.grad_accum * len(per_step)
    if not completions:
        return ""
    return f"; completions generated: {sum(per_step) / completions:,.0f} tokens on average ({summary['trainer']}'s first run)"


def metric_rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per logged metric, the largest per-step difference of each contender from the reference (abs / rel)."""
    vs = {name: data["comparison"].get(f"{name}_vs_reference") for name, _ in finished_columns(data)}
    differences = {name: c.get("metric_differences", {}) for name, c in vs.items() if c is not None}
    metrics = sorted({metric for per_metric in differences.values() for metric in per_metric})
    table = [[metric, *[_abs_rel(d.get(metric)) for d in differences.values()]] for metric in metrics]
    return ["metric", *differences], table


def _abs_rel(difference: dict[str, Any] | None) -> str:
    return "n/a" if difference is None else f"{_sci(difference['max_abs'])} / {_sci(difference['max_rel'])}"


def share_rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """One row per ablated hot path: fasttrain with every path on against fasttrain with that path off."""
    header = ["hot path switched off", "tokens/s without it", "fasttrain with it (speed-up)",
              "tokens per CPU-second (speed-up)", "peak memory without it (MB)", "fasttrain's peak with it (ratio)"]  # fmt: skip
    ours = data.get("fasttrain") or {}
    table = [
        [path, _fmt(share["tokens_per_s_without"], 1),
         f"{_fmt(ours.get('tokens_per_s'), 1)} ({_ratio(share['speedup'])})", _ratio(share["tokens_per_cpu_s_speedup"]),
         _fmt(share["peak_memory_mb_without"], 0),
         f"{_fmt(ours.get('peak_memory_mb'), 0)} ({_ratio(share['peak_memory_ratio'])})"]
        for path, share in (data.get("shares") or {}).items()
    ]  # fmt: skip
    return header, table


def _ratio(value: Any) -> str:
    return "n/a" if _missing(value) else f"{value:.2f}x"


def _sci(value: Any) -> str:
    """Small loss differences are the point: scientific notation, never rounded to zero first."""
    return "n/a" if _missing(value) else f"{float(value):.2e}"


def describe(config: BenchConfig, data: dict[str, Any]) -> list[str]:
    """The run-specific lines under the table: what ran, what was left out, the run's status. How each figure
    is measured is written once, in docs/method.md."""
    finished = finished_columns(data)
    if not finished:
        return ["no run finished", *_progress_note(data)]
    reference = data.get("reference") or finished[0][1]  # settings every run shares
    dtype = "bf16 weights + bf16=True" if config.bf16 else "fp32"
    reference_side, fasttrain_side = _SIDES[config.trainer_type]
    phases = _has_phases(data)
    lengths = _lengths_note(config, "prompts" if phases else "sequences")
    if phases:
        shape = f"{plural(config.steps, 'step')}, {lengths}" + _mean_completion(config, reference)
    else:
        grouped = "grouped by length" if config.group_by_length else "not grouped by length"
        shape = f"{plural(config.steps, 'step')} x batch {config.batch_size} x grad-accum {config.grad_accum}, {lengths}, {grouped}"
    excluded = reference["warmup_steps_excluded"]
    m = data.get("matmul_limit")  # measured before the runs (--trainer transformers only)
    return [
        f"reference: {reference_side}; fasttrain: {fasttrain_side}",
        f"model {model_note(config.model, reference.get('model_shape'))}, dataset {config.dataset}, "
        f"device {config.device}, {dtype}, {shape}, "
        f"seed {config.seed}" + (f", {config.threads} CPU threads" if config.device == "cpu" else ""),
        *([rl_note(config)] if phases else []),
        f"{plural(reference['repetitions'], 'repetition')} per contender, medians; {warmup_note(excluded)}; "
        f"memory: {reference['memory_kind']}",
        *([f"WARNING: {NO_WARMUP_NOTE}"] if excluded == 0 else []),
        *([f"matmul limit: {m['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s ({m['measured']})"] if m else []),
        *_load_note(data),
        *_progress_note(data),
        "how each figure is measured: docs/method.md",
    ]


def warmup_note(excluded: int) -> str:
    """'every step timed', 'the first step not timed (warm-up)', 'the first 2 steps not timed (warm-up)'."""
    if excluded == 0:
        return "every step timed"
    return "the first " + ("step" if excluded == 1 else f"{excluded} steps") + " not timed (warm-up)"


def model_note(model: str, shape: dict[str, Any] | None = None) -> str:
    """'tiny (hidden 32, 1 layer, ...)': the shape the run recorded, else a built-in's own; a name alone when
    neither is known (a model that failed to load)."""
    if shape is None and model in BUILTIN_SHAPES:
        shape = builtin_summary(model)
    return f"{model} ({describe_summary(shape)})" if shape else model


def _lengths_note(config: BenchConfig, what: str) -> str:
    if config.lengths == LOGNORMAL:
        return f"{what}: {describe_lognormal(config.seq_len)}"
    if config.lengths == FULL:
        return f"{what} of exactly {config.seq_len} tokens (cut from the data read as one stream)"
    return f"{what} up to {config.seq_len} tokens (the data's natural lengths)"


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
    origin = data.get("provenance") or {}
    start, cores = origin.get("load_1min_at_start"), (origin.get("machine") or {}).get("cores")
    load = data.get("load_average") or {}
    if start is None or load.get("end") is None or not cores:
        return []
    note = f"machine load average (1 min) at start / end: {start:.1f} / {load['end']:.1f} on {cores} cores"
    during = load.get("during_runs")
    highest = max(start, load["end"])
    if during:  # sampled every few seconds while the runs ran: the runs themselves count up to their threads
        note += f"; during the runs: mean {during['mean']:.1f}, highest {during['max']:.1f}"
        highest = max(highest, during["mean"])
    if highest > cores:
        note += " -- other processes competed for the CPU: wall-time figures are noisy, tokens per CPU-second less so"
    return [note]


def status_lines(data: dict[str, Any]) -> list[str]:
    """Each fasttrain contender's hot-path status, one line each under the table (as a table cell it made the
    table hundreds of characters wide)."""
    return [
        f"hot paths, {name}: {_hot_paths(summary)}"
        for name, summary in finished_columns(data)
        if summary["trainer"] == "fasttrain" or summary.get("hot_paths")
    ]


def _aligned(header: list[str], table: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *table]]
    return [lines[0], "  ".join("-" * w for w in widths), *lines[1:]]


def _markdown_table(header: list[str], table: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join([" --- "] + [" ---: "] * (len(header) - 1)) + "|",
        *["| " + " | ".join(cell.replace("|", "/") for cell in r) + " |" for r in table],
        "",
    ]


SHARES_TITLE = "Each hot path's share (fasttrain with every path on vs with that one off)"
METRICS_TITLE = "Largest per-step difference from the reference, per logged metric (abs / rel)"


def text_table(config: BenchConfig, data: dict[str, Any]) -> str:
    lines = _aligned(*rows(data))
    header, table = share_rows(data)
    if table:
        lines += ["", f"{SHARES_TITLE}:", *_aligned(header, table)]
    return "\n".join([*lines, "", *status_lines(data), *describe(config, data)])


def markdown(config: BenchConfig, data: dict[str, Any]) -> str:
    out = ["# fasttrain bench", "", provenance.markdown(data["provenance"])]
    out += [f"- total wall time: {data['wall_s']:.0f} s", "", *_markdown_table(*rows(data))]
    out += [*[f"- {line}" for line in [*status_lines(data), *describe(config, data)]], ""]
    for name, (header, table) in ((SHARES_TITLE, share_rows(data)), (METRICS_TITLE, metric_rows(data))):
        if table:
            out += [f"## {name}", "", *_markdown_table(header, table)]
    return "\n".join(out)


def write_text(path: str, text: str) -> None:
    """Written whole or not at all: a bench killed at its time cap never leaves half a file."""
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(partial, path)


def write_json(path: str, data: dict[str, Any]) -> None:
    """NaN is not JSON: null instead (dumped, then read back with NaN and infinities as None)."""
    strict = json.loads(json.dumps(data), parse_constant=lambda _: None)
    write_text(path, json.dumps(strict, indent=2, allow_nan=False) + "\n")


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
    fig, (ax_loss, ax_tps, ax_mem) = plt.subplots(1, 3, figsize=(15, 4.5), width_ratios=[2, 1, 1])
    colors = ["0.6" if name == "reference" else f"C{i}" for i, name in enumerate(names)]
    for (name, summary), color in zip(columns, colors, strict=True):
        steps_losses = [(i + 1, loss) for i, loss in enumerate(summary["losses"]) if loss is not None]
        # the reference wide and pale underneath, so that matching curves stay visible
        wide = name == "reference"
        style = {"linewidth": 4, "alpha": 0.6, "zorder": 1} if wide else {"marker": ".", "zorder": 2}
        ax_loss.plot(*zip(*steps_losses, strict=True), color=color, label=name, **style)
    ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title="loss per step")
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
