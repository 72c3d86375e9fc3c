"""CPU benchmark: FusedAdamW's state modes against torch's fused AdamW and the 8-bit AdamWs of bitsandbytes and torchao.

Every optimizer on the same model, data and schedule: a Llama-architecture causal LM (random init, ~0.4M
parameters) trained ``--steps`` steps on the standard library's sources (a byte-level BPE of 1,024 tokens trained
on them), warm-up + cosine lr, clipping at 1.0. Reported: the state's bytes per parameter (measured from the state
tensors; as a ratio to torch's fused AdamW and to fp32 moments), the bytes a fused step must move per parameter
for that layout (2 x param + grad + 2 x state: a property of the layout, not a traffic counter), the final loss
(mean of the last 25 steps) and a held-out loss against the reference (bf16 parameters: FusedAdamW with fp32
moments; fp32: torch's fused AdamW), and the loss curves. bitsandbytes and torchao are used where they import.

    python benchmarks/bench_adamw_modes.py [--steps 200] [--out benchmarks/results]
"""

from __future__ import annotations

import importlib
import math
import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import _common
import bench_adamw
from fasttrain import FusedAdamW

SEQ_LEN, BATCH, EVAL_BATCHES, VOCAB = 128, 8, 4, 1024
PEAK_LR, WARMUP, MAX_NORM, WEIGHT_DECAY = 3e-3, 20, 1.0, 0.01
THREADS = 1  # steady timings on a shared machine


def model_config():
    # every matrix has >= 4,096 elements (k/v projections 48 x 96): all of them are quantized by the 8-bit modes
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False,
    )  # fmt: skip


def token_batches(n_batches: int) -> torch.Tensor:
    """int64 [n_batches, BATCH, SEQ_LEN]: stdlib sources through a byte-level BPE of VOCAB tokens trained on
    their first ~1 MB (a few seconds), joined by an end-of-text token, cut in sequences."""
    tok = _common.stdlib_bpe(VOCAB, 1_000_000, ["<|endoftext|>"])
    eos, need, ids = tok.token_to_id("<|endoftext|>"), n_batches * BATCH * SEQ_LEN, []
    for document in _common.stdlib_sources():
        ids += [*tok.encode(document).ids, eos]
        if len(ids) >= need:
            break
    return torch.tensor(ids[:need]).view(n_batches, BATCH, SEQ_LEN)


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return PEAK_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# FusedAdamW's state modes, label -> keyword arguments. On fp32 parameters the default state is fp32 moments and
# stochastic rounding is bf16's, so of these only the 8-bit state runs there.
FUSED_MODES = {
    "FusedAdamW (default: param-dtype states)": {},
    "FusedAdamW state_dtype=float32": {"state_dtype": torch.float32},
    "FusedAdamW default + stochastic rounding": {"bf16_stochastic_rounding": True},
    "FusedAdamW state_dtype='8bit'": {"state_dtype": "8bit"},
    "FusedAdamW '8bit' + stochastic rounding": {"state_dtype": "8bit", "bf16_stochastic_rounding": True},
}
FP32_MODES = ("FusedAdamW state_dtype='8bit'",)


def optimizers() -> dict:
    """label -> (param dtype, factory(params) -> optimizer): torch's fused AdamW, FusedAdamW's modes, the peers'
    8-bit AdamWs. A peer's package is imported when its run starts: where it is not installed, the results say so."""
    hyper = {"lr": PEAK_LR, "weight_decay": WEIGHT_DECAY}
    factories = {"torch AdamW(fused=True)": lambda ps: torch.optim.AdamW(ps, fused=True, **hyper)}
    factories |= {name: lambda ps, kw=kw: FusedAdamW(ps, **hyper, **kw) for name, kw in FUSED_MODES.items()}
    for name, module in bench_adamw.PEERS.items():
        factories[name] = lambda ps, module=module: importlib.import_module(module).AdamW8bit(ps, **hyper)
    return {
        f"{tag} | {name}": (dtype, make)
        for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))
        for name, make in factories.items()
        if tag == "bf16" or name not in FUSED_MODES or name in FP32_MODES
    }


def train(label, dtype, factory, data, steps):
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config()).to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = factory(params)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # torchao keeps lr as a tensor and refuses a float
                group["lr"].fill_(lr_at(step, steps))
            else:
                group["lr"] = lr_at(step, steps)
        batch = data[step]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        bench_adamw.clip_and_step(opt, params, MAX_NORM)
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            break
    train_s = time.perf_counter() - t0
    with torch.no_grad():
        held_out = [float(model(input_ids=b, labels=b).loss) for b in data[steps : steps + EVAL_BATCHES]]
    n, sb, p_bytes = sum(p.numel() for p in params), _common.state_bytes(opt), params[0].element_size()
    return {"label": label, "param_dtype": str(dtype).replace("torch.", ""), "n_params": n, "losses": losses,
            "final_loss": statistics.fmean(losses[-25:]), "held_out_loss": statistics.fmean(held_out),
            "state_bytes": sb, "state_bytes_per_param": sb / n, "bytes_moved_per_param": 3 * p_bytes + 2 * sb / n,
            "optimizer": type(opt).__module__ + "." + type(opt).__name__, "train_s": train_s}  # fmt: skip


def plot(path: Path, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True, layout="tight")
    for ax, tag in zip(axes, ("bf16", "fp32"), strict=True):
        for r in (r for r in results if r["label"].startswith(tag)):
            x = r["losses"]
            smooth = [statistics.fmean(x[max(0, i - 9) : i + 1]) for i in range(len(x))]  # of 10 steps
            ax.plot(smooth, label=r["label"].split(" | ")[1], linewidth=1.2)
        ax.set(title=f"{tag} parameters: training loss (mean of 10 steps)", xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("loss")
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = _common.parser(__doc__)
    _common.int_options(ap, steps=200)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    warnings.filterwarnings("ignore")
    t_start = time.perf_counter()
    info = _common.new_result("adamw_modes", "bitsandbytes", "torchao")
    data = token_batches(args.steps + EVAL_BATCHES)
    results, unavailable = [], {}
    for label, (dtype, factory) in optimizers().items():
        try:
            r = train(label, dtype, factory, data, args.steps)
        except Exception as err:  # a peer not installed, or that installs but fails on CPU: say how
            unavailable[label] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            traceback.print_exc()
            continue
        results.append(r)
        print(f"{label}: final {r['final_loss']:.4f}, held-out {r['held_out_loss']:.4f}, "
              f"{r['state_bytes_per_param']:.3f} B/param state, {r['train_s']:.0f} s", flush=True)  # fmt: skip
    by_label = {r["label"]: r for r in results}
    for r in results:
        tag = r["label"].split(" | ")[0]
        t = by_label.get(f"{tag} | torch AdamW(fused=True)")
        # the losses' reference: for bf16 parameters fp32 moments, for fp32 ones torch's fused AdamW
        ref = by_label.get(f"{tag} | FusedAdamW state_dtype=float32") if tag == "bf16" else t
        r["final_loss_vs_reference"] = r["final_loss"] / ref["final_loss"] if ref else None
        r["held_out_vs_reference"] = r["held_out_loss"] / ref["held_out_loss"] if ref else None
        r["state_vs_torch"] = r["state_bytes"] / t["state_bytes"] if t else None
        r["state_vs_fp32_states"] = r["state_bytes_per_param"] / 8.0
    info["setup"] = {"steps": args.steps, "torch_threads": THREADS, "seq_len": SEQ_LEN, "batch": BATCH,
                     "vocab": VOCAB, "peak_lr": PEAK_LR, "warmup": WARMUP, "max_norm": MAX_NORM,
                     "weight_decay": WEIGHT_DECAY, "model": model_config().to_dict()}  # fmt: skip
    info.update(unavailable=unavailable, results=results, wall_s=time.perf_counter() - t_start)
    title = "FusedAdamW state modes: memory and convergence (CPU)"
    print(_common.write(args.out, "adamw_modes", info, title, markdown(info)))
    if results:
        plot(args.out / "adamw_modes.png", results)


def _x(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}x"


def markdown(info: dict) -> list[str]:
    results = info["results"]
    n = results[0]["n_params"] if results else 0
    lines = [
        f"- model: Llama architecture, {n:,} parameters (hidden 96, 2 layers, vocab {VOCAB}, untied), random "
        f"init; {info['setup']['steps']} steps of {BATCH} x {SEQ_LEN} tokens of the stdlib corpus; lr {PEAK_LR} "
        f"(warm-up {WARMUP}, cosine to 10%), weight decay {WEIGHT_DECAY}, clip {MAX_NORM}; the same data, "
        f"init and schedule for every run; {info['setup']['torch_threads']} torch thread(s)",
        f"- wall time {info['wall_s'] / 60:.1f} min",
        "",
        "## Memory: optimizer state and bytes a step moves, per parameter",
        "",
        "State: measured from the state tensors after training (step counters excluded). Moved: 2 x param + grad "
        "+ 2 x state bytes (each stored tensor read and written once, the gradient read once).",
        "",
        "| params | optimizer | state B/param | vs torch fused | vs fp32 states | moved B/param/step |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        *[f"| {r['label']} | {r['state_bytes_per_param']:.3f} | {_x(r['state_vs_torch'])} | "
          f"{_x(r['state_vs_fp32_states'])} | {r['bytes_moved_per_param']:.2f} |" for r in results],
        "",
        "## Convergence",
        "",
        "Final loss: mean training loss of the last 25 steps; held-out: mean loss on "
        f"{EVAL_BATCHES} unseen batches. Ratios to the reference of the same parameter dtype (bf16: FusedAdamW "
        "with fp32 moments; fp32: torch's fused AdamW).",
        "",
        "| params | optimizer | final loss | vs reference | held-out loss | vs reference | train s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *[f"| {r['label']} | {r['final_loss']:.4f} | {_x(r['final_loss_vs_reference'], 3)} | "
          f"{r['held_out_loss']:.4f} | {_x(r['held_out_vs_reference'], 3)} | {r['train_s']:.0f} |" for r in results],
    ]  # fmt: skip
    if info["unavailable"]:
        lines += ["", "Not run:", ""] + [f"- {k}: {v}" for k, v in info["unavailable"].items()]
    return [*lines, "", "Loss curves: `adamw_modes.png`."]


if __name__ == "__main__":
    main()
