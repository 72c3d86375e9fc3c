"""The model-size frontier: the largest real Qwen3 shape each optimizer setting fully fine-tunes in this machine's
memory, and its bytes per parameter.

Every run is ``fasttrain bench``'s worker in a process of its own: the shape at random init, 2 optimizer steps at
batch 1 on one example of exactly --seq-len tokens, the Trainer's gradient checkpointing, under a memory budget the
parent watches (runner.run_one: resident memory read every 20 ms, the child stopped past the budget; a run whose own
high-water mark passed it does not fit either). Shapes are tried smallest first; a contender stops at its first
shape that does not fit. Bytes per parameter: the peak resident memory over the shape's parameters (the process's
libraries, ~0.6 GiB, included).

Contenders: the reference Trainer (its default optimizer, adamw_torch_fused) with fp32 and with bf16 weights;
fasttrain.Trainer by default (fp32), with 8-bit moments, and lean: bf16 weights with stochastic rounding, 8-bit
moments and the step inside backward (which needs max_grad_norm 0: a global clip waits for every gradient).

    python -m fasttrain.bench.model_frontier --out benchmarks/results   # qwen3-0.6b, -1.7b, -4b; ~40 min, 2 cores
    python -m fasttrain.bench.model_frontier --shapes tiny,qwen3-cpu --seq-len 64 --out /tmp/mf   # a minute
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

from . import models, provenance, report
from .config import FASTTRAIN, REFERENCE, BenchConfig, Contender
from .frontier import default_budget, parse_size
from .runner import OverBudget, RunFailed, run_one

LEAN = "state_dtype=8bit,bf16_stochastic_rounding=true,step_in_backward=true"
# name -> (contender, bf16 weights, max_grad_norm, what it is)
CONTENDERS: dict[str, tuple[Contender, bool, float | None, str]] = {
    "reference-fp32": (Contender("reference-fp32", REFERENCE), False, None, "fp32 weights, adamw_torch_fused"),
    "reference-bf16": (Contender("reference-bf16", REFERENCE), True, None, "bf16 weights, adamw_torch_fused"),
    "fasttrain-fp32": (Contender("fasttrain-fp32", FASTTRAIN), False, None, "fp32 weights, FusedAdamW"),
    "fasttrain-8bit": (Contender("fasttrain-8bit", FASTTRAIN, optim_args="state_dtype=8bit"), False, None,
                       "fp32 weights, 8-bit moments"),
    "fasttrain-lean": (Contender("fasttrain-lean", FASTTRAIN, optim_args=LEAN), True, 0.0,
                       "bf16 weights + stochastic rounding, 8-bit moments, step in backward (max_grad_norm 0)"),
}  # fmt: skip


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
        result = run_one(config, contender, workdir, f"{contender.name}-{shape}", lambda _: None, budget)
    except OverBudget as exc:
        row.update(fits=False, peak_bytes=exc.peak_bytes, why="passed the budget (stopped by the parent)")
        return row
    except RunFailed as exc:
        row.update(fits=False, peak_bytes=None, why=f"crashed: {str(exc)[-600:]}")
        return row
    peak = int(result["peak_memory_mb"] * 2**20)
    row.update(
        fits=peak <= budget, peak_bytes=peak, bytes_per_parameter=peak / parameters,
        losses=result["losses"], step_time_s=result["step_time_s"], optimizer=result["hot_paths"].get("optimizer"),
        why=None if peak <= budget else "its high-water mark passed the budget",
    )  # fmt: skip
    return row


def table(rows: list[dict], shapes: list[str]) -> list[str]:
    lines = [
        "| contender | " + " | ".join(shapes) + " | largest that fits |",
        "|---" * (len(shapes) + 2) + "|",
    ]
    for name in CONTENDERS:
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
        lines.append(f"| {name}: {CONTENDERS[name][3]} | " + " | ".join(cells) + f" | {largest} |")
    return lines


def plot(path: Path, rows: list[dict], shapes: list[str], budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    params = {s: models.builtin_parameters(s) / 1e9 for s in shapes}
    for i, name in enumerate(CONTENDERS):
        mine = [r for r in rows if r["contender"] == name]
        fit = [(params[r["shape"]], r["peak_bytes"] / 2**30) for r in mine if r["fits"]]
        if fit:
            ax.plot(*zip(*fit, strict=True), marker="o", color=f"C{i}", label=name)
        miss = [params[r["shape"]] for r in mine if not r["fits"]]
        if miss:
            ax.scatter(miss, [budget / 2**30] * len(miss), marker="x", s=70, color=f"C{i}")
    ax.axhline(budget / 2**30, linestyle="--", color="k", linewidth=1, label="budget (x: did not fit)")
    ax.set_xticks(list(params.values()), [f"{s}\n{p:.2f}B" for s, p in params.items()])
    ax.set(xlabel="Qwen3 shape (parameters)", ylabel="peak resident memory (GiB)",
           title="The largest model fully fine-tuned in this machine's memory (2 steps, 512 tokens, grad. ckpt.)")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b,qwen3-4b")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--memory-budget", help="default: the available memory less 10%% (at least 1 GiB)")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated names of CONTENDERS")
    p.add_argument(
        "--out", type=Path, required=True, help="a directory: model_frontier_cpu.{json,md,png} go there"
    )
    a = p.parse_args()
    shapes = a.shapes.split(",")
    if unknown := [s for s in shapes if s not in models.BUILTIN_SHAPES]:
        p.error(f"unknown shapes {unknown}; choose from {', '.join(models.BUILTIN_SHAPES)}")
    chosen = [c.strip() for c in a.contenders.split(",")]
    if unknown := [c for c in chosen if c not in CONTENDERS]:
        p.error(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    budget = parse_size(a.memory_budget) if a.memory_budget else default_budget()
    command = shlex.join(["python", "-m", "fasttrain.bench.model_frontier", *sys.argv[1:]])
    result = {"benchmark": "model_frontier_cpu", "provenance": provenance.record(command_line=command)}
    result.update(args={**vars(a), "out": str(a.out)}, budget_bytes=budget, rows=[])
    stem = a.out / "model_frontier_cpu"
    a.out.mkdir(parents=True, exist_ok=True)

    def write(complete: bool) -> str:
        """The files, rewritten after every run: a run cut short keeps what finished."""
        result["complete"] = complete
        body = [
            f"Budget {budget / 2**30:.2f} GiB of resident memory (watched by the parent); 2 optimizer steps at batch 1 "
            f"on {a.seq_len} tokens with gradient checkpointing; B/param: peak resident memory over the parameters."
            + ("" if complete else " Not finished: the runs so far."),
            "",
            *table(result["rows"], shapes),
        ]
        report.write_json(f"{stem}.json", result)
        text = "\n".join(
            ["# The model-size frontier (CPU)", "", provenance.markdown(result["provenance"]), "", *body]
        )
        report.write_text(f"{stem}.md", text + "\n")
        plot(Path(f"{stem}.png"), result["rows"], shapes, budget)
        return text

    with tempfile.TemporaryDirectory(prefix="fasttrain-model-frontier-") as workdir:
        for name in chosen:
            for shape in shapes:
                row = run(name, shape, a.seq_len, budget, workdir)
                result["rows"].append(row)
                print(
                    f"  {'fits' if row['fits'] else 'does not fit'}: {row.get('peak_bytes')}", file=sys.stderr
                )
                write(complete=False)
                if not row["fits"]:
                    break
    print(write(complete=True))


if __name__ == "__main__":
    main()
