"""The convergence benchmark (issue 33, part 4): does training with fasttrain's optimizer modes still reach the loss
torch's AdamW reaches?

A small Qwen3-shaped model (transformers' Qwen3ForCausalLM, random init) learns the bench's real text, the Python
standard library's sources (``corpus``) tokenized with the built-in BPE (``tokenizer``), packed into rows of
--seq-len tokens. The eval split is whole documents that come after the training ones in the corpus order, so no
eval document was trained on. Every mode runs the same plain PyTorch loop (no Trainer: the loop's own overhead
would dominate a model this small on CPU): the same rows in the same order and the same init for a given seed,
linear warm-up then cosine decay, weight decay on matrices only, the gradient clipped at 1.0 (except where the
step runs inside backward, which cannot wait for a global norm: max_grad_norm 0 there). Eval loss on the fixed
eval rows every --eval-every steps, always in fp32 (a bf16 model is copied to fp32 for it), so every mode's
curve is measured by the same ruler.

torch fp32 runs several seeds: their [min, max] final eval loss is the spread a mode must land in to count as
"trains like AdamW". ``bf16 without SR`` is the control that shows the test can fail: bf16 weights rounded to
nearest lose updates smaller than half a bf16 ulp, so it is expected to fall behind.

    python -m fasttrain.bench.convergence --out benchmarks/results            # ~40 min on 2 shared cores
    python -m fasttrain.bench.convergence --preset tiny --steps 6 --batch-size 2 --seq-len 32 --out /tmp/cv
"""

from __future__ import annotations

import argparse
import copy
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from . import corpus, provenance, report, tokenizer

# The model's shape (Qwen3's architecture, scaled to train hundreds of steps in minutes on a CPU).
PRESETS: dict[str, dict[str, int]] = {
    # 500 steps of 4 x 64 tokens in ~2-10 min a mode on 2 shared CPU cores. Hidden 256 x 4 layers at 4 x 256 tokens
    # measured ~3 s a step (~25 min a run); here the 8192 x 128 embedding is most of the parameters, and on CPU the
    # bf16 + stochastic rounding + 8-bit step (~1 s for 1.3M parameters) costs more than forward and backward
    "small": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "intermediate_size": 384,
    },
    # for the test: the same code paths in seconds
    "tiny": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "intermediate_size": 64,
    },
}

# mode -> how it trains. optimizer "torch": torch.optim.AdamW; "fasttrain": FusedAdamW (torch backend: this is CPU)
MODES: dict[str, dict[str, Any]] = {
    "torch fp32": {"optimizer": "torch", "dtype": "float32", "options": {}, "clip": True},
    "fasttrain fp32": {"optimizer": "fasttrain", "dtype": "float32", "options": {}, "clip": True},
    "fasttrain 8-bit": {
        "optimizer": "fasttrain",
        "dtype": "float32",
        "options": {"state_dtype": "8bit"},
        "clip": True,
    },
    "fasttrain bf16+SR+8-bit": {
        "optimizer": "fasttrain",
        "dtype": "bfloat16",
        "options": {"state_dtype": "8bit", "bf16_stochastic_rounding": True},
        "clip": True,
    },
    "fasttrain bf16+SR+8-bit + step in backward": {
        "optimizer": "fasttrain",
        "dtype": "bfloat16",
        "options": {"state_dtype": "8bit", "bf16_stochastic_rounding": True},
        "clip": False,  # a global norm needs every gradient before the first update: max_grad_norm 0
        "in_backward": True,
    },
    "bf16 without SR": {"optimizer": "fasttrain", "dtype": "bfloat16", "options": {}, "clip": True},
}
REFERENCE = "torch fp32"
MAX_GRAD_NORM = 1.0
WEIGHT_DECAY = 0.1
MIN_LR_RATIO = 0.1  # cosine decays to 10% of the peak, not to 0: the last steps still learn


def _rows(docs: list[list[int]], seq_len: int, eos: int, limit: int) -> list[list[int]]:
    """Documents joined with EOS between them, cut into rows of seq_len tokens (the remainder dropped)."""
    rows: list[list[int]] = []
    buffer: list[int] = []
    for ids in docs:
        buffer.extend(ids)
        buffer.append(eos)
        while len(buffer) >= seq_len and len(rows) < limit:
            rows.append(buffer[:seq_len])
            buffer = buffer[seq_len:]
        if len(rows) >= limit:
            break
    return rows


def load_data(seq_len: int, train_rows: int, eval_rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train rows, eval rows, vocabulary size). Documents are tokenized in corpus order until the training rows
    are filled; the eval rows come from the documents after those (held out: no document is in both)."""
    path, _ = tokenizer.load_or_train()
    tok = tokenizer.as_transformers_tokenizer(path)
    eos = tok.convert_tokens_to_ids(tokenizer.EOS_TOKEN)
    documents = corpus.iter_documents()
    train_docs: list[list[int]] = []
    tokens = 0
    needed = train_rows * seq_len
    while tokens < needed:  # whole documents; the last one may spill past what the rows take, unused
        ids = tok(next(documents), add_special_tokens=False)["input_ids"]
        train_docs.append(ids)
        tokens += len(ids) + 1
    eval_docs: list[list[int]] = []
    tokens = 0
    while tokens < eval_rows * seq_len:
        ids = tok(next(documents), add_special_tokens=False)["input_ids"]
        eval_docs.append(ids)
        tokens += len(ids) + 1
    train = torch.tensor(_rows(train_docs, seq_len, eos, train_rows))
    held_out = torch.tensor(_rows(eval_docs, seq_len, eos, eval_rows))
    return train, held_out, len(tok)


def build_model(shape: dict[str, int], vocab_size: int, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, tie_word_embeddings=True, max_position_embeddings=4096, **shape
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    # always initialised in fp32, then cast: a bf16 mode starts from the fp32 init rounded, not another init
    return Qwen3ForCausalLM(config).to(dtype)


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Weight decay on matrices only (embeddings, projections), none on norms or biases."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to MIN_LR_RATIO of the peak at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def eval_loss(model: torch.nn.Module, rows: torch.Tensor, batch_size: int) -> float:
    """Mean token loss over the eval rows, in fp32 whatever the model's dtype (the same ruler for every mode)."""
    fp32 = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    fp32.eval()
    total = 0.0
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        total += fp32(input_ids=batch, labels=batch).loss.item() * len(batch)  # rows are equal-length
    model.train()
    return total / len(rows)


def _evidence(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What the run actually trained with, read from the tensors (the test checks it against the mode's name)."""
    state_dtypes = sorted(
        {str(v.dtype) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}
    )
    return {
        "optimizer": type(opt).__name__,
        "stochastic_rounding": any(g.get("bf16_stochastic_rounding", False) for g in opt.param_groups),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "state_dtypes": state_dtypes,
        "uint8_state_tensors": sum(
            1 for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dtype == torch.uint8
        ),
    }


def run(
    mode: str,
    seed: int,
    shape: dict[str, int],
    vocab_size: int,
    train: torch.Tensor,
    held_out: torch.Tensor,
    a,
) -> dict[str, Any]:
    from fasttrain.optim import FusedAdamW, step_in_backward

    spec = MODES[mode]
    load = (
        provenance.load_average()
    )  # per run: the shared machine's load moves between runs, and tokens/s with it
    model = build_model(shape, vocab_size, seed, getattr(torch, spec["dtype"]))
    model.train()
    if spec["optimizer"] == "torch":
        opt: torch.optim.Optimizer = torch.optim.AdamW(param_groups(model), lr=a.lr, foreach=False)
    else:
        opt = FusedAdamW(param_groups(model), lr=a.lr, backend="torch", **spec["options"])
    warmup = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, a.steps, warmup))
    handle = step_in_backward(opt) if spec.get("in_backward") else None
    # the same rows in the same order for every mode of one seed; a different permutation per seed
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    curve = [{"step": 0, "eval_loss": eval_loss(model, held_out, a.batch_size)}]
    train_losses: list[float] = []
    grads_after_backward: list[bool] = []
    train_seconds = 0.0
    for step in range(a.steps):
        idx = order[(step * a.batch_size + torch.arange(a.batch_size)) % len(train)]
        batch = train[idx]
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if step == 0:  # whether any gradient survived backward (step in backward frees each one it steps)
            grads_after_backward.append(any(p.grad is not None for p in model.parameters()))
        if spec["clip"]:
            if isinstance(opt, FusedAdamW):
                opt.defer_clip_grad_norm_(MAX_GRAD_NORM)  # fused into the step
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()  # in backward mode: a no-op, every parameter was stepped (and its gradient freed) in backward
        opt.zero_grad(set_to_none=True)
        sched.step()
        train_seconds += time.perf_counter() - start
        train_losses.append(loss.item())
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            curve.append({"step": step + 1, "eval_loss": eval_loss(model, held_out, a.batch_size)})
            print(f"  {mode} seed {seed} step {step + 1}: eval {curve[-1]['eval_loss']:.4f}", file=sys.stderr)
    evidence = _evidence(model, opt)
    evidence.update(
        grads_after_first_backward=grads_after_backward[0],
        max_grad_norm=MAX_GRAD_NORM if spec["clip"] else 0.0,
        updates_in_backward=handle.updates if handle else 0,
    )
    if handle:
        handle.remove()
    return {
        "mode": mode,
        "seed": seed,
        "eval_curve": curve,
        "train_losses": train_losses,
        "final_eval_loss": curve[-1]["eval_loss"],
        "tokens_per_s": a.steps * a.batch_size * a.seq_len / train_seconds,
        "train_seconds": train_seconds,
        "load_1min_at_start": load,
        "evidence": evidence,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each mode's seed-0 final eval loss against the reference's seed spread [min, max]."""
    ref = [r["final_eval_loss"] for r in runs if r["mode"] == REFERENCE]
    low, high = (min(ref), max(ref)) if ref else (math.nan, math.nan)
    rows = []
    for r in runs:
        if r["mode"] == REFERENCE and r["seed"] != min(x["seed"] for x in runs if x["mode"] == REFERENCE):
            continue
        loss = r["final_eval_loss"]
        # how far outside the band (0 inside), signed: positive is worse (higher loss) than the worst seed
        outside = loss - high if loss > high else (loss - low if loss < low else 0.0)
        rows.append(
            {
                "mode": r["mode"],
                "seed": r["seed"],
                "final_eval_loss": loss,
                "within_reference_spread": low <= loss <= high,
                "outside_by": outside,
                "tokens_per_s": r["tokens_per_s"],
            }
        )
    return {"reference": REFERENCE, "reference_seeds": len(ref), "spread": [low, high], "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    s, args = result["summary"], result["args"]
    low, high = s["spread"]
    out = [
        "# Convergence: fasttrain's optimizer modes against torch.optim.AdamW (CPU)",
        "",
        provenance.markdown(result["provenance"]),
        "",
        f"Qwen3ForCausalLM {result['shape']} (tied embeddings, vocab {result['vocab_size']}, "
        f"{result['parameters']:,} parameters), random init; {args['steps']} optimizer steps of "
        f"{args['batch_size']} x {args['seq_len']} tokens of stdlib source (built-in BPE), lr {args['lr']} "
        f"(linear warm-up {max(1, args['steps'] // 20)} steps, cosine to {MIN_LR_RATIO:g}x), weight decay "
        f"{WEIGHT_DECAY} on matrices, clip {MAX_GRAD_NORM} (max_grad_norm 0 for the step in backward). Eval loss "
        f"in fp32 on {result['eval_rows']} held-out rows (documents not trained on) every {args['eval_every']} "
        f"steps. Spread: {REFERENCE}'s final eval loss over seeds {args['seeds']}: "
        f"[{low:.4f}, {high:.4f}] (width {high - low:.4f}). Other modes run seed {min(args['seeds'])}.",
        "",
        "| mode | final eval loss | within the spread? | outside by | tokens/s |",
        "|---|---:|---|---:|---:|",
    ]
    for row in s["rows"]:
        within = "yes" if row["within_reference_spread"] else "no"
        out.append(
            f"| {row['mode']} | {row['final_eval_loss']:.4f} | {within} | {row['outside_by']:+.4f} | "
            f"{row['tokens_per_s']:,.0f} |"
        )
    out += [
        "",
        "outside by: the distance to the nearest edge of the spread (positive: a higher loss than every "
        f"{REFERENCE} seed). `bf16 without SR` is the control (bf16 weights rounded to nearest): expected to "
        "fall behind, which shows the check can fail. tokens/s: the training loop's wall clock (eval excluded), "
        "runs one after another on a possibly shared machine whose load moves between them (each run's load "
        "average at its start is in the JSON): compare them loosely.",
    ]
    return "\n".join(out) + "\n"


def plot(path: Path, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    ref = [r for r in result["runs"] if r["mode"] == REFERENCE]
    if ref:  # the reference's seeds as a band: a mode inside it is as close to AdamW as AdamW is to itself
        steps = [p["step"] for p in ref[0]["eval_curve"]]
        losses = [[p["eval_loss"] for p in r["eval_curve"]] for r in ref]
        ax.fill_between(
            steps,
            [min(v) for v in zip(*losses, strict=True)],
            [max(v) for v in zip(*losses, strict=True)],
            color="0.6",
            alpha=0.5,
            label=f"{REFERENCE}, seeds {[r['seed'] for r in ref]} (min-max)",
        )
    others = [r for r in result["runs"] if r["mode"] != REFERENCE]
    for i, r in enumerate(others):
        ax.plot(
            [p["step"] for p in r["eval_curve"]],
            [p["eval_loss"] for p in r["eval_curve"]],
            marker=".",
            color=f"C{i}",
            linestyle="--" if r["mode"] == "bf16 without SR" else "-",
            label=f"{r['mode']} (seed {r['seed']})",
        )
    ax.set(xlabel="optimizer step", ylabel="eval loss (fp32, held-out)", title="eval loss per step")
    finals = [r["final_eval_loss"] for r in result["runs"]]
    ax.set_ylim(min(finals) - 0.3, max(finals) + 1.5)  # the tail, where the modes differ, not the first drop
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", type=Path, required=True, help="a directory: convergence_cpu.{json,md,png} go there"
    )
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-rows", type=int, default=16)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated names of MODES")
    p.add_argument("--seeds", default="0,1,2", help=f"the seeds of {REFERENCE}; other modes run the first")
    p.add_argument("--preset", choices=PRESETS, default="small", help="the model's shape")
    a = p.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",")]
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    a.seeds = [int(s) for s in a.seeds.split(",")]
    command = shlex.join(
        ["python", "-m", "fasttrain.bench.convergence", *(sys.argv[1:] if argv is None else argv)]
    )
    prov = provenance.record(command_line=command)
    train, held_out, vocab_size = load_data(a.seq_len, a.steps * a.batch_size, a.eval_rows)
    shape = PRESETS[a.preset]
    parameters = sum(p.numel() for p in build_model(shape, vocab_size, 0, torch.float32).parameters())
    result = {
        "benchmark": "convergence_cpu",
        "provenance": prov,
        "args": {**vars(a), "out": str(a.out)},
        "shape": shape,
        "vocab_size": vocab_size,
        "parameters": parameters,
        "train_rows": len(train),
        "eval_rows": len(held_out),
        "runs": [],
    }
    a.out.mkdir(parents=True, exist_ok=True)
    for mode in modes:
        for seed in a.seeds if mode == REFERENCE else a.seeds[:1]:
            result["runs"].append(run(mode, seed, shape, vocab_size, train, held_out, a))
            # written after every run: a long run stopped early still leaves the runs it finished
            result["summary"] = summarize(result["runs"])
            report.write_json(str(a.out / "convergence_cpu.json"), result)
            report.write_text(str(a.out / "convergence_cpu.md"), markdown(result))
            plot(a.out / "convergence_cpu.png", result)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
