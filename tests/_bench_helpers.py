"""What the bench's tests share: a test-sized configuration and worker results made by hand."""

from __future__ import annotations

import _tiny
from fasttrain.bench import provenance, summary
from fasttrain.bench.config import BenchConfig

CONFIG = _tiny.bench_config(steps=4, threads=1)


def run_result(name: str, trainer: str, tps: float, peak: float, losses: list[float], status=None) -> dict:
    """One worker result with these figures (the fields the summary and the report read)."""
    return {
        "contender": name,
        "trainer": trainer,
        "trainer_class": f"x.{trainer}",
        "fasttrain_disable": None,
        "steps": len(losses),
        "warmup_steps_excluded": 1,
        "tokens_per_s": tps,
        "step_time_s": 1.0 / tps,
        "step_times_s": [0.1] * len(losses),
        "tokens_per_step": [10] * len(losses),
        "timed_tokens": 30,
        "losses": losses,
        "grad_norms": [1.0] * len(losses),
        "final_loss": losses[-1],
        "hot_paths": status or {},
        "peak_memory_mb": peak,
        "memory_kind": "peak RSS (ru_maxrss)",
        "memory_after_setup_mb": 100.0,
        "peak_above_setup_mb": peak - 100.0,
    }


def full_data(results, failures=None, config: BenchConfig = CONFIG) -> dict:
    """What `fasttrain bench` writes for these results: the summary, the settings and the provenance."""
    data = summary.build(results, failures)
    origin = {**provenance.record(), "command": "fasttrain bench --model tiny"}
    data.update(config=config.to_json(), provenance=origin, wall_s=12.0)
    return data
