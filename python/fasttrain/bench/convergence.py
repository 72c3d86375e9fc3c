"""The convergence benchmark (issue 33, part 4): does training with fasttrain's optimizer modes still reach
the loss torch's AdamW reaches? How it measures: docs/method.md, "Convergence"; the results: docs/measured.md.

    python -m fasttrain.bench.convergence --out benchmarks/results            # ~40 min on 2 shared cores
    python -m fasttrain.bench.convergence --preset tiny --steps 6 --batch-size 2 --seq-len 32 --out /tmp/cv
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import sys
import time
from typing import Any

import torch

from . import corpus, models, outputs, provenance, tokenizer

# The model's shape (Qwen3's architecture, scaled to train hundreds of steps in minutes on a CPU).
PRESETS: dict[str, dict[str, int]] = {
    # 500 steps of 4 x 64 tokens: 15 s to 3 min a run on 2 idle CPU cores (hidden 256 x 4 layers at 4 x 256
    # tokens was ~25 min); the 8192 x 128 embedding is most of the parameters
    "small": dataclasses.asdict(models.Shape(128, 2, 2, 1, 64, 384)),
    "tiny": dataclasses.asdict(models.Shape(32, 2, 2, 1, 16, 64)),  # for the test: the same code in seconds
}


def _mode(
    optimizer="fasttrain", dtype="float32", in_backward=False, embedding_state=None, clip=True, **options
):
    """How a mode trains. optimizer "torch": torch.optim.AdamW; "fasttrain": FusedAdamW (torch backend) with
    ``options``. in_backward: the step inside backward. clip: by the global norm (MAX_GRAD_NORM); never with
    in_backward, which has no global norm before the first update (max_grad_norm 0 there).
    embedding_state: the embedding's moments in this dtype (bitsandbytes' advice under 8-bit optimizers)."""
    return {"optimizer": optimizer, "dtype": dtype, "options": options, "in_backward": in_backward,
            "embedding_state": embedding_state, "clip": clip and not in_backward}  # fmt: skip


_SR_8BIT = {"state_dtype": "8bit", "bf16_stochastic_rounding": True}
MODES: dict[str, dict[str, Any]] = {
    "torch fp32": _mode("torch"),
    "fasttrain fp32": _mode(),
    "fasttrain 8-bit": _mode(state_dtype="8bit"),
    "fasttrain 8-bit + fp32 embedding moments": _mode(state_dtype="8bit", embedding_state="float32"),
    "fasttrain bf16+SR+8-bit": _mode(dtype="bfloat16", **_SR_8BIT),
    "fasttrain bf16+SR+8-bit + step in backward": _mode(dtype="bfloat16", in_backward=True, **_SR_8BIT),
    # what the step in backward changes is the clip: the same without it, and with the embedding's moments apart
    "fasttrain 8-bit without clip": _mode(state_dtype="8bit", clip=False),
    "fasttrain 8-bit + fp32 embedding moments without clip": _mode(
        state_dtype="8bit", embedding_state="float32", clip=False
    ),
    "fasttrain bf16+SR+8-bit + fp32 embedding moments + step in backward": _mode(
        dtype="bfloat16", in_backward=True, embedding_state="float32", **_SR_8BIT
    ),
    "bf16 without SR": _mode(dtype="bfloat16"),  # the control: rounded to nearest, bf16 loses small updates
}
REFERENCE = "torch fp32"
MAX_GRAD_NORM = 1.0
WEIGHT_DECAY = 0.1
MIN_LR_RATIO = 0.1  # cosine decays to 10% of the peak, not to 0: the last steps still learn
TITLE = "Convergence: fasttrain's optimizer modes against torch.optim.AdamW (CPU)"


def load_data(seq_len: int, train_rows: int, eval_rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train rows, eval rows, vocabulary size). Documents, in corpus order and joined with EOS, fill the
    training rows; the eval rows come from the documents after those (held out: no document is in both)."""
    path, _ = tokenizer.load_or_train()
    tok = tokenizer.as_transformers_tokenizer(path)
    eos = tok.convert_tokens_to_ids(tokenizer.EOS_TOKEN)
    documents = corpus.iter_documents()

    def rows(count: int) -> torch.Tensor:
        stream: list[int] = []
        # whole documents: what the last one spills past the rows goes unused
        while len(stream) < count * seq_len:
            stream += [*tok(next(documents), add_special_tokens=False)["input_ids"], eos]
        return torch.tensor(stream[: count * seq_len]).view(count, seq_len)

    return rows(train_rows), rows(eval_rows), len(tok)  # the training rows first: the eval rows come after


def build_model(shape: dict[str, int], vocab_size: int, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, tie_word_embeddings=True, max_position_embeddings=4096, **shape
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    # always initialised in fp32, then cast: a bf16 mode starts from the fp32 init rounded, not another init
    return Qwen3ForCausalLM(config).to(dtype)


def param_groups(model: torch.nn.Module, embedding_state: str | None = None) -> list[dict[str, Any]]:
    """Weight decay on matrices only (embeddings, projections), none on norms or biases; with
    ``embedding_state`` the embedding in a third group, its moments in that dtype."""
    own = [model.get_input_embeddings().weight] if embedding_state else []
    decay = [p for p in model.parameters() if p.ndim >= 2 and not any(p is e for e in own)]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]
    if own:
        groups.append({"params": own, "weight_decay": WEIGHT_DECAY, "state_dtype": embedding_state})
    return groups


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to MIN_LR_RATIO of the peak at the end."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def eval_loss(model: torch.nn.Module, rows: torch.Tensor, batch_size: int) -> float:
    """Mean token loss over the eval rows, in fp32 whatever the model's dtype (one ruler for every mode)."""
    fp32 = model if next(model.parameters()).dtype == torch.float32 else copy.deepcopy(model).float()
    fp32.eval()
    total = 0.0
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        total += fp32(input_ids=batch, labels=batch).loss.item() * len(batch)  # rows are equal-length
    model.train()
    return total / len(rows)


def _evidence(model: torch.nn.Module, opt: torch.optim.Optimizer, **found: Any) -> dict[str, Any]:
    """What the run actually trained with, read from the tensors (the test checks it against the mode's name),
    and what the loop ``found``."""
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    sr = any(g.get("bf16_stochastic_rounding", False) for g in opt.param_groups)
    embedding = opt.state[model.get_input_embeddings().weight].values()
    return {"optimizer": type(opt).__name__, "stochastic_rounding": sr,
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "state_dtypes": sorted({str(v.dtype) for v in states}),
            "embedding_state_dtypes": sorted({str(v.dtype) for v in embedding if torch.is_tensor(v)}),
            "uint8_state_tensors": sum(v.dtype == torch.uint8 for v in states), **found}  # fmt: skip


def run(mode: str, seed: int, train: torch.Tensor, held_out: torch.Tensor, vocab: int, a) -> dict[str, Any]:
    """One mode's run: a plain PyTorch loop, the same for every mode (a Trainer's own overhead would dominate
    a model this small on CPU), eval loss at step 0, every --eval-every steps and at the end."""
    from fasttrain.optim import FusedAdamW, step_in_backward

    spec = MODES[mode]
    # per run: a shared machine's load moves between runs, and tokens/s with it
    load = provenance.load_average()
    model = build_model(PRESETS[a.preset], vocab, seed, getattr(torch, spec["dtype"]))
    model.train()
    if spec["optimizer"] == "torch":
        opt: torch.optim.Optimizer = torch.optim.AdamW(param_groups(model), lr=a.lr, foreach=False)
    else:
        groups = param_groups(model, spec["embedding_state"])
        opt = FusedAdamW(groups, lr=a.lr, backend="torch", **spec["options"])
    warmup = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, a.steps, warmup))
    handle = step_in_backward(opt) if spec["in_backward"] else None
    # the same rows in the same order for every mode of one seed; a different permutation per seed
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    curve = [{"step": 0, "eval_loss": eval_loss(model, held_out, a.batch_size)}]
    train_losses: list[float] = []
    train_seconds, clipped = 0.0, 0  # clipped: the steps whose gradients went through a clip
    for step in range(a.steps):
        batch = train[order[(step * a.batch_size + torch.arange(a.batch_size)) % len(train)]]
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        if step == 0:  # whether any gradient survived backward (step in backward frees each one it steps)
            grads_after_first_backward = any(p.grad is not None for p in model.parameters())
        clipped += spec["clip"]
        if spec["clip"] and isinstance(opt, FusedAdamW):
            opt.defer_clip_grad_norm_(MAX_GRAD_NORM)  # fused into the step
        elif spec["clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        # in backward mode a no-op: every parameter was stepped (and its gradient freed) in backward
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        train_seconds += time.perf_counter() - start
        train_losses.append(loss.item())
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            curve.append({"step": step + 1, "eval_loss": eval_loss(model, held_out, a.batch_size)})
            print(f"  {mode} seed {seed} step {step + 1}: eval {curve[-1]['eval_loss']:.4f}", file=sys.stderr)
    evidence = _evidence(
        model, opt, grads_after_first_backward=grads_after_first_backward,
        max_grad_norm=MAX_GRAD_NORM if spec["clip"] else 0.0, clipped_steps=clipped,
        updates_in_backward=handle.updates if handle else 0,
    )  # fmt: skip
    if handle:
        handle.remove()
    tokens_per_s = a.steps * a.batch_size * a.seq_len / train_seconds
    return {"mode": mode, "seed": seed, "eval_curve": curve, "train_losses": train_losses,
            "final_eval_loss": curve[-1]["eval_loss"], "tokens_per_s": tokens_per_s,
            "train_seconds": train_seconds, "load_1min_at_start": load, "evidence": evidence}  # fmt: skip


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each mode's mean final eval loss over its seeds against the reference's seed spread [min, max], and its
    difference from the reference run of the same seed (the same init and data order), seed by seed."""
    ref = {r["seed"]: r["final_eval_loss"] for r in runs if r["mode"] == REFERENCE}
    low, high = (min(ref.values()), max(ref.values())) if ref else (math.nan, math.nan)
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        loss = statistics.fmean(r["final_eval_loss"] for r in mine)
        paired = [r["final_eval_loss"] - ref[r["seed"]] for r in mine if r["seed"] in ref]
        # how far outside the band (0 inside), signed: positive is worse (higher loss) than the worst seed
        outside = loss - high if loss > high else (loss - low if loss < low else 0.0)
        rows.append({"mode": mode, "seeds": [r["seed"] for r in mine], "final_eval_loss": loss,
                     "final_eval_losses": [r["final_eval_loss"] for r in mine], "paired_differences": paired,
                     "paired_mean": statistics.fmean(paired) if paired else math.nan,
                     "within_reference_spread": low <= loss <= high, "outside_by": outside,
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine)})  # fmt: skip
    return {"reference": REFERENCE, "reference_seeds": len(ref), "spread": [low, high], "rows": rows}


def markdown(result: dict[str, Any]) -> list[str]:
    """The Markdown under the title and the provenance."""
    s, args = result["summary"], result["args"]
    low, high = s["spread"]
    table = [
        [r["mode"], " / ".join(f"{x:.4f}" for x in r["final_eval_losses"]), f"{r['final_eval_loss']:.4f}",
         "yes" if r["within_reference_spread"] else "no", f"{r['outside_by']:+.4f}",
         " / ".join(f"{x:+.4f}" for x in r["paired_differences"]), f"{r['paired_mean']:+.4f}",
         f"{r['tokens_per_s']:,.0f}"]
        for r in s["rows"]
    ]  # fmt: skip
    header = ["mode", "final eval loss by seed", "mean", "mean within the spread?", "outside by",
              f"minus {REFERENCE}, same seed", "mean difference", "tokens/s (median)"]  # fmt: skip
    return [
        f"Qwen3ForCausalLM {result['shape']} (tied embeddings, vocab {result['vocab_size']}, "
        f"{result['parameters']:,} parameters), random init; {args['steps']} optimizer steps of "
        f"{args['batch_size']} x {args['seq_len']} tokens of stdlib source (built-in BPE), lr {args['lr']} "
        f"(linear warm-up {max(1, args['steps'] // 20)} steps, cosine to {MIN_LR_RATIO:g}x), weight decay "
        f"{WEIGHT_DECAY} on matrices, clip {MAX_GRAD_NORM} (none in backward or 'without clip'). "
        f"Eval loss in fp32 on {result['eval_rows']} held-out rows (documents not trained on) every "
        f"{args['eval_every']} steps. Spread: {REFERENCE}'s final eval loss over seeds {args['seeds']}: "
        f"[{low:.4f}, {high:.4f}] (width {high - low:.4f}). Every mode runs every seed.",
        "",
        *outputs.md_table(header, table, "|---|---|---:|---|---:|---|---:|---:|"),
        "",
        "outside by: from the mean to the spread's nearest edge (positive: higher than every seed's loss). "
        "`bf16 without SR`, the control (rounded to nearest), should fall behind: the check can fail. tokens/s: "
        "the loop's wall clock (eval excluded) on a machine whose load moves (each run's is in the JSON).",
    ]


def plot(path: str, result: dict[str, Any]) -> None:
    with outputs.figure(path, (9, 5.5)) as ax:
        ref = [r for r in result["runs"] if r["mode"] == REFERENCE]
        # the reference's seeds as a band: a mode inside it is as close to AdamW as AdamW is to itself
        if ref:
            losses = list(zip(*[[p["eval_loss"] for p in r["eval_curve"]] for r in ref], strict=True))
            ax.fill_between([p["step"] for p in ref[0]["eval_curve"]], [min(v) for v in losses],
                            [max(v) for v in losses], color="0.6", alpha=0.5,
                            label=f"{REFERENCE}, seeds {[r['seed'] for r in ref]} (min-max)")  # fmt: skip
        others = dict.fromkeys(r["mode"] for r in result["runs"] if r["mode"] != REFERENCE)
        for i, mode in enumerate(others):  # each mode's mean over its seeds
            mine = [r["eval_curve"] for r in result["runs"] if r["mode"] == mode]
            steps = [p["step"] for p in mine[0]]
            losses = [statistics.fmean(c[k]["eval_loss"] for c in mine) for k in range(len(steps))]
            ax.plot(steps, losses, marker=".", color=f"C{i}", label=f"{mode} (mean of {len(mine)} seeds)",
                    linestyle="--" if mode == "bf16 without SR" else "-")  # fmt: skip
        ax.set(xlabel="optimizer step", ylabel="eval loss (fp32, held-out)", title="eval loss per step")
        finals = [r["final_eval_loss"] for r in result["runs"]]  # the tail, where the modes differ, in view
        ax.set_ylim(min(finals) - 0.3, max(finals) + 1.5)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = outputs.parser(__doc__, "convergence_cpu")
    for option, default in (("--steps", 500), ("--batch-size", 4), ("--seq-len", 64), ("--lr", 1e-3),
                            ("--eval-every", 50), ("--eval-rows", 16)):  # fmt: skip
        p.add_argument(option, type=type(default), default=default)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated names of MODES")
    p.add_argument("--seeds", default="0,1,2", help="the seeds every mode runs",
                   type=lambda text: [int(s) for s in text.split(",")])  # fmt: skip
    p.add_argument("--preset", choices=PRESETS, default="small", help="the model's shape")
    a = p.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",")]
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    result = outputs.start(a, argv, "convergence_cpu")
    train, held_out, vocab = load_data(a.seq_len, a.steps * a.batch_size, a.eval_rows)
    shape = PRESETS[a.preset]
    parameters = sum(p.numel() for p in build_model(shape, vocab, 0, torch.float32).parameters())
    result.update(shape=shape, vocab_size=vocab, parameters=parameters, train_rows=len(train),
                  eval_rows=len(held_out), runs=[])  # fmt: skip
    for mode in modes:
        for seed in a.seeds:
            result["runs"].append(run(mode, seed, train, held_out, vocab, a))
            result["summary"] = summarize(result["runs"])
            # written after every run: a long run stopped early still leaves the runs it finished
            text = outputs.save(a.out, result, TITLE, markdown(result), lambda path: plot(path, result))
    print(text)
    return result


if __name__ == "__main__":
    main()
