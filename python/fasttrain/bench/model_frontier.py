"""The model-size frontier: the largest real Qwen3 shape each optimizer setting fully fine-tunes in this
machine's memory, and its bytes per parameter (the method: docs/usage.md, "The memory frontiers").

    python -m fasttrain.bench.model_frontier --out benchmarks/results   # 0.6b, 1.7b, 4b: ~40 min on 2 cores
    python -m fasttrain.bench.model_frontier --shapes tiny,qwen3-cpu --seq-len 64 --out /tmp/mf   # a minute
"""

from __future__ import annotations

import os
import sys
import tempfile
from importlib.util import find_spec

from . import models, outputs
from .config import OPTIM_PACKAGES, BenchConfig
from .frontier import budget_for, under_budget
from .presets import MODEL_FRONTIER as CONTENDERS
from .runner import RunFailed

PLOT_TITLE = "The largest model fully fine-tuned in this machine's memory (2 steps, 512 tokens, grad. ckpt.)"


def run(name: str, shape: str, seq_len: int, budget: int, workdir: str) -> dict:
    contender, bf16, max_grad_norm, _ = CONTENDERS[name]
    config = BenchConfig(
        model=shape, dataset="default", device="cpu", steps=2, seq_len=seq_len, batch_size=1, grad_accum=1,
        bf16=bf16, seed=0, threads=len(os.sched_getaffinity(0)), learning_rate=1e-4, warmup_steps=1,
        group_by_length=False, lengths="full", gradient_checkpointing=True, max_grad_norm=max_grad_norm,
    )  # fmt: skip
    parameters = models.builtin_parameters(shape)
    row = {"contender": name, "shape": shape, "parameters": parameters}
    print(f"{name} at {shape} ...", file=sys.stderr, flush=True)
    try:
        result, peak, why = under_budget(config, contender, f"{name}-{shape}", budget, workdir)
    except RunFailed as exc:
        return {**row, "fits": False, "peak_bytes": None, "why": f"crashed: {str(exc)[-600:]}"}
    row.update(fits=why is None, peak_bytes=peak)
    if result is not None:  # it ran to its end (and may not fit yet: its high-water mark passed the budget)
        row.update(bytes_per_parameter=peak / parameters, losses=result["losses"])
        row.update(step_time_s=result["step_time_s"], optimizer=result["hot_paths"].get("optimizer"))
        row.update(optimizer_class=result["optimizer_class"])
    return {**row, "why": why}


def table(rows: list[dict], shapes: list[str]) -> list[str]:
    lines = []
    for name, (*_, what) in CONTENDERS.items():
        cells, largest = [], "none"
        for shape in shapes:
            row = next((r for r in rows if r["contender"] == name and r["shape"] == shape), None)
            if row is None:
                cells.append("not tried")
            elif row["fits"]:
                cells.append(
                    f"{row['peak_bytes'] / 2**30:.1f} GiB ({row['bytes_per_parameter']:.2f} B/param)"
                )
                largest = shape
            elif row["peak_bytes"]:
                cells.append(f"does not fit (stopped at {row['peak_bytes'] / 2**30:.1f} GiB)")
            else:
                cells.append("crashed")
        lines.append([f"{name}: {what}", *cells, largest])
    return outputs.md_table(["contender", *shapes, "largest that fits"], lines)


def plot(path: str, rows: list[dict], shapes: list[str], budget: int) -> None:
    params = {s: models.builtin_parameters(s) / 1e9 for s in shapes}
    runs = {n: [(params[r["shape"]], r["peak_bytes"], r["fits"]) for r in rows if r["contender"] == n]
            for n in CONTENDERS}  # fmt: skip
    with outputs.figure(path, (9, 5)) as ax:
        outputs.peaks(ax, runs, budget / 2**30, ("{}", None), 70, "budget (x: did not fit)")
        ax.set_xticks(list(params.values()), [f"{s}\n{p:.2f}B" for s, p in params.items()])
        ax.set(xlabel="Qwen3 shape (parameters)", ylabel="peak resident memory (GiB)", title=PLOT_TITLE)


def main(argv: list[str] | None = None) -> None:
    p = outputs.parser(__doc__, "model_frontier_cpu")
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b,qwen3-4b")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--memory-budget", help="default: the available memory less 10%% (at least 1 GiB)")
    names = "; ".join(f"{name}: {what}" for name, (*_, what) in CONTENDERS.items())
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated, of {names}")
    a = p.parse_args(argv)
    shapes = a.shapes.split(",")
    if unknown := [s for s in shapes if s not in models.BUILTIN_SHAPES]:
        p.error(f"unknown shapes {unknown}; choose from {', '.join(models.BUILTIN_SHAPES)}")
    chosen = [c.strip() for c in a.contenders.split(",")]
    if unknown := [c for c in chosen if c not in CONTENDERS]:
        p.error(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    # a contender's optimizer from a package this environment lacks: said now, not as a crash per shape
    needed = {c: OPTIM_PACKAGES[o] for c in chosen if (o := CONTENDERS[c][0].optim) in OPTIM_PACKAGES}
    if missing := [f"{c} trains with {CONTENDERS[c][0].optim}: pip install {pkg}" for c, pkg in needed.items()
                   if not find_spec(pkg)]:  # fmt: skip
        p.error("; ".join(missing))
    budget = budget_for("cpu", a.memory_budget)
    result = {
        **outputs.start(a, argv, "model_frontier_cpu", *sorted(set(needed.values()))),
        "budget_bytes": budget,
        "rows": [],
    }

    def save(complete: bool) -> str:
        result["complete"] = complete
        body = [
            f"Budget {budget / 2**30:.2f} GiB of resident memory (watched by the parent); 2 optimizer steps "
            f"at batch 1 on {a.seq_len} tokens with gradient checkpointing; B/param: peak resident memory "
            "over the parameters." + ("" if complete else " Not finished: the runs so far."),
            "",
            *table(result["rows"], shapes),
        ]
        plotted = lambda path: plot(path, result["rows"], shapes, budget)  # noqa: E731
        return outputs.save(a.out, result, "The model-size frontier (CPU)", body, plotted)

    with tempfile.TemporaryDirectory(prefix="fasttrain-model-frontier-") as workdir:
        for name in chosen:
            for shape in shapes:
                row = run(name, shape, a.seq_len, budget, workdir)
                result["rows"].append(row)
                print(
                    f"  {'fits' if row['fits'] else 'does not fit'}: {row.get('peak_bytes')}", file=sys.stderr
                )
                save(complete=False)
                if not row["fits"]:
                    break
    print(save(complete=True), end="")


if __name__ == "__main__":
    main()
