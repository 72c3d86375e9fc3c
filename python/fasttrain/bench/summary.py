"""From raw runs to the figures the report shows: medians per contender, ratios, loss parity, and each hot
path's share when the bench ran ablations."""

from __future__ import annotations

import math
import statistics
from typing import Any

from .config import FASTTRAIN, LIGER, REFERENCE


def _median(values: list[float]) -> float:
    clean = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(clean) if clean else float("nan")


# A reference value this close to zero is a rounding zero (RLOO's on-policy loss is about 1e-8 at every step): a
# difference relative to it means nothing, so such steps count in the absolute difference only
REL_FLOOR = 1e-6


def loss_difference(a: list[float | None], b: list[float | None]) -> dict[str, float | int | None]:
    """Largest per-step |a - b| over the steps both logged, absolute, and relative to |a| over the steps where
    |a| > ``REL_FLOOR`` (None when there is no such step)."""
    pairs = [(x, y) for x, y in zip(a, b, strict=False) if x is not None and y is not None]
    if not pairs:
        return {"max_abs": None, "max_rel": None, "steps_compared": 0}
    relative = [abs(x - y) / abs(x) for x, y in pairs if abs(x) > REL_FLOOR]
    if len(relative) < len(pairs) and all(x == y for x, y in pairs if abs(x) <= REL_FLOOR):
        relative.append(0.0)  # equal where the value is about zero: no relative difference there either
    max_abs = max(abs(x - y) for x, y in pairs)
    return {"max_abs": max_abs, "max_rel": max(relative, default=None), "steps_compared": len(pairs)}


def metric_differences(a: dict[str, list], b: dict[str, list]) -> dict[str, dict[str, float | int | None]]:
    """``loss_difference`` for every metric both runs logged (loss, grad_norm, and whatever TRL adds)."""
    return {name: loss_difference(a[name], b[name]) for name in sorted(set(a) & set(b))}


def largest_metric_difference(differences: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The metric whose per-step relative difference is largest, with that difference."""
    compared = {name: d for name, d in differences.items() if d["max_rel"] is not None}
    if not compared:
        return {"metric": None, "max_abs": None, "max_rel": None}
    if not any(d["max_rel"] > 0 for d in compared.values()):  # naming one metric would say it differs
        return {"metric": None, "max_abs": 0.0, "max_rel": 0.0}
    name = max(compared, key=lambda n: compared[n]["max_rel"])
    return {"metric": name, "max_abs": compared[name]["max_abs"], "max_rel": compared[name]["max_rel"]}


# GRPO and RLOO (bench/phases.py): the figures of each phase, medians over repetitions like the others; a run
# without them (every other trainer) leaves them out
PHASE_KEYS = ("generation_time_s", "generation_tokens_per_s", "generation_peak_memory_mb", "training_phase_time_s",
              "training_peak_memory_mb", "training_peak_above_setup_mb", "step_tokens_per_s")  # fmt: skip
# Medians over repetitions, in every run
_MEDIAN_KEYS = ("tokens_per_s", "step_time_s", "tokens_per_cpu_s", "peak_memory_mb", "memory_after_setup_mb",
                "peak_above_setup_mb")  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender: medians over its repetitions; losses and hot paths from its first repetition."""
    first = runs[0]
    summary: dict[str, Any] = {
        "trainer": first["trainer"],
        "trainer_class": first["trainer_class"],
        "fasttrain_disable": first.get("fasttrain_disable"),
        "repetitions": len(runs),
        **{key: _median([r.get(key, float("nan")) for r in runs]) for key in _MEDIAN_KEYS},
        "memory_kind": first["memory_kind"],
        "losses": first["losses"],
        # results written before every metric was recorded carry loss and grad_norm only
        "metrics": first.get("metrics")
        or {"loss": first["losses"], "grad_norm": first.get("grad_norms") or []},
        "final_loss": first["final_loss"],
        "hot_paths": first["hot_paths"],
        "warmup_steps_excluded": first["warmup_steps_excluded"],
        "model_shape": first.get("model_shape"),  # absent from results written before it was recorded
        "tokens_per_step": first["tokens_per_step"],
        # Repetitions of one contender should give the same losses: their spread is the noise floor
        # against which the reference-vs-fasttrain difference is read.
        "loss_difference_between_repetitions": max(
            (loss_difference(first["losses"], r["losses"])["max_abs"] or 0.0 for r in runs[1:]), default=None
        ),
        "runs": runs,
        **{key: _median([r.get(key) for r in runs]) for key in PHASE_KEYS if key in first},
        **{key: first[key] for key in ("phases", "generated_tokens_per_step", "gpu_name") if key in first},
    }
    if first.get("train_flops_per_token"):
        summary["train_flops_per_token"] = first["train_flops_per_token"]
    return summary


def _ratio(numerator: dict[str, Any], denominator: dict[str, Any], key: str) -> float:
    """``numerator[key] / denominator[key]``; NaN where either is missing, NaN or the denominator zero."""
    base, value = denominator.get(key), numerator.get(key)
    if not base or value is None or math.isnan(base) or math.isnan(value):
        return float("nan")
    return value / base


def compare(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    ratios = {key + "_ratio": key for key in PHASE_KEYS if key in reference and key in other}
    ratios.update(tokens_per_s_ratio="tokens_per_s", step_time_ratio="step_time_s",
                  tokens_per_cpu_s_ratio="tokens_per_cpu_s", peak_memory_ratio="peak_memory_mb",
                  peak_above_setup_ratio="peak_above_setup_mb")  # fmt: skip
    return {
        **{name: _ratio(other, reference, key) for name, key in ratios.items()},
        "loss_difference": loss_difference(reference["losses"], other["losses"]),
        "metric_differences": (diffs := metric_differences(reference["metrics"], other["metrics"])),
        "largest_metric_difference": largest_metric_difference(diffs),
    }


def build(results: dict[str, list[dict[str, Any]]], failures: dict[str, str] | None = None) -> dict[str, Any]:
    """``{"reference": {...}, "fasttrain": {...}, ["liger": {...}], ["ablations": {...}], "comparison": {...},
    "failed": {name: error}}``. A contender without a finished run has no entry (a failed one is in "failed");
    without a finished reference there is nothing to compare against and "comparison" is empty."""
    summaries = {name: summarize(runs) for name, runs in results.items() if runs}
    out = {name: summaries.pop(name) for name in (REFERENCE, FASTTRAIN, LIGER) if name in summaries}
    if summaries:  # what is left: the ablations
        out["ablations"] = summaries
    reference = out.get(REFERENCE)
    others = {name: out[name] for name in (FASTTRAIN, LIGER) if name in out} | summaries
    out["comparison"] = {f"{n}_vs_reference": compare(reference, o) for n, o in others.items() if reference}
    if FASTTRAIN in out and LIGER in out:
        out["comparison"]["fasttrain_vs_liger"] = compare(out[LIGER], out[FASTTRAIN])
    if FASTTRAIN in out and out.get("ablations"):
        out["shares"] = shares(out[FASTTRAIN], out["ablations"])
    out["failed"] = dict(failures or {})
    return out


ABLATION_PREFIX = f"{FASTTRAIN}-no-"


def shares(fasttrain: dict[str, Any], ablations: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each hot path's share (docs/method.md): fasttrain with every path on over ``fasttrain-no-<path>``, the
    ablation with that one path off (``all``: every path off at once)."""
    return {
        name.removeprefix(ABLATION_PREFIX): {
            "tokens_per_s_without": without["tokens_per_s"],
            "speedup": _ratio(fasttrain, without, "tokens_per_s"),
            "tokens_per_cpu_s_speedup": _ratio(fasttrain, without, "tokens_per_cpu_s"),
            "peak_memory_mb_without": without["peak_memory_mb"],
            "peak_memory_ratio": _ratio(fasttrain, without, "peak_memory_mb"),
            "peak_above_setup_ratio": _ratio(fasttrain, without, "peak_above_setup_mb"),
        }
        for name, without in ablations.items()
        if name.startswith(ABLATION_PREFIX)
    }
