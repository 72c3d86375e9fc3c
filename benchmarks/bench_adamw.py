"""Benchmark: gradient clipping + AdamW step, FusedAdamW against clip_grad_norm_ + torch's fused AdamW, CPU or CUDA.

How it measures (the reference, the contenders, error, '% lim'): docs/method.md, "Clipping and the AdamW step".

    python benchmarks/bench_adamw.py [--reps 9]        # CPU: benchmarks/results/adamw_cpu.{json,md}
    python benchmarks/bench_adamw.py --device cuda --models gpt2-124M,llama3.2-1B --reps 7 --time-cap 48
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import os
import statistics
import time
from functools import partial

import torch

import _common
from fasttrain import FusedAdamW
from fasttrain.bench import provenance, roofline


def llama(vocab, hidden, inter, layers, kv, tied=True):
    per_layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
                 (hidden, inter), (hidden,), (hidden,)]  # fmt: skip
    return [(vocab, hidden), *per_layer * layers, (hidden,), *([] if tied else [(vocab, hidden)])]


def gpt2(vocab=50257, h=768, layers=12):
    per_layer = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,),
                 (h, 4 * h), (h,)]  # fmt: skip
    return [(vocab, h), (1024, h), *per_layer * layers, (h,), (h,)]


MODELS = {
    "llama-50M": lambda: llama(32000, 512, 1536, 10, 512),
    "gpt2-124M": gpt2,
    "llama3.2-1B": lambda: llama(128256, 2048, 8192, 16, 512),
    "llama2-7B": lambda: llama(32000, 4096, 11008, 32, 4096, tied=False),
    "tiny": lambda: [(), (7,), (33, 65), (3000,), *llama(300, 32, 64, 2, 16, tied=False)],
}
PEERS = {"bitsandbytes AdamW8bit": "bitsandbytes.optim", "torchao AdamW8bit": "torchao.optim"}
DEFAULTS = {
    "cpu": {"models": "llama-50M", "dtypes": "float32", "grad_norms": "0.5,5"},
    "cuda": {"models": "gpt2-124M,llama3.2-1B,llama2-7B", "dtypes": "float32,bfloat16", "grad_norms": "5"},
}


def clip_and_step(opt, params, max_norm: float) -> None:
    """A clipped step as the Trainer takes it: FusedAdamW hands the clip's coefficient to its step kernel, any
    other optimizer steps on the gradients ``clip_grad_norm_`` rescaled."""
    if isinstance(opt, FusedAdamW):
        opt.defer_clip_grad_norm_(max_norm)
    else:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()


def contenders(dtype: torch.dtype, device: str) -> dict:
    """name -> optimizer factory."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"fasttrain": lambda ps: FusedAdamW(ps, lr=1e-4, weight_decay=0.01)}
    modes = {"default": {}, "8bit": {"state_dtype": "8bit"}}
    if dtype == torch.bfloat16:
        modes |= {"float32": {"state_dtype": torch.float32}, "default+sr": {"bf16_stochastic_rounding": True},
                  "8bit+sr": {"state_dtype": "8bit", "bf16_stochastic_rounding": True}}  # fmt: skip
    out = {f"{mode} (triton)": {"backend": "triton", **kw} for mode, kw in modes.items()}
    out |= {"default (torch backend)": {"backend": "torch"},
            "8bit (torch form)": {"backend": "torch", "state_dtype": "8bit"}}  # fmt: skip
    out = {name: lambda ps, kw=kw: FusedAdamW(ps, lr=1e-4, weight_decay=0.01, **kw) for name, kw in out.items()}  # fmt: skip
    if device == "cuda":
        for name, module in PEERS.items():
            with contextlib.suppress(Exception):  # not installed, or no binary for this machine
                cls = importlib.import_module(module).AdamW8bit
                out[name] = lambda ps, cls=cls: cls(ps, lr=1e-4, weight_decay=0.01)
    return out


def _distance(xs, ys) -> float:
    """The L2 distance between two lists of tensors, taken as one vector (each pair reduced in turn)."""
    pairs = zip(xs, ys, strict=True)
    return sum(float((x.detach().float() - y.detach().float()).norm()) ** 2 for x, y in pairs) ** 0.5


def compare(name, factory, shapes, dtype, norm, args, limits) -> dict:
    """One contender against the reference on the same gradients, alternating; times, bytes, error, % lim."""
    # random parameters, and gradients scaled to a total norm of ``norm``
    g = torch.Generator(device=args.device).manual_seed(0)
    start = [torch.randn(s, generator=g, device=args.device).to(dtype) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=g, device=args.device).to(dtype) for s in shapes]
    scale = norm / float(torch.linalg.vector_norm(torch.stack([x.float().norm() for x in grads])))
    grads, params, opts = [x.mul_(scale) for x in grads], {}, {}
    for side, make in (("reference", lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True)),
                       (name, factory)):  # fmt: skip
        params[side] = [torch.nn.Parameter(x.clone()) for x in start]
        for p, x in zip(params[side], grads, strict=True):
            p.grad = x.clone()
        opts[side] = make(params[side])
    times = {side: {"clip_step": [], "step": []} for side in opts}
    for rep in range(args.warmup + args.reps):
        for side in list(opts)[:: -1 if rep % 2 else 1]:
            clip_step = partial(clip_and_step, opts[side], params[side], 1.0)
            for kind, call in (("clip_step", clip_step), ("step", opts[side].step)):
                for p, x in zip(params[side], grads, strict=True):
                    p.grad.copy_(x)  # every call steps on the same gradients
                seconds = provenance.timed(call, args.device)
                if rep >= args.warmup:
                    times[side][kind].append(seconds * 1e3)
    update = _distance(params["reference"], start)
    row = {"error_vs_update": _distance(params[name], params["reference"]) / max(update, 1e-15)}
    n, p_bytes = sum(x.numel() for x in start), start[0].element_size()
    for side, ms in times.items():
        med = {kind: statistics.median(t) for kind, t in ms.items()}
        state = _common.state_bytes(opts[side]) / n
        # 2 x param + grad (the param's dtype) + 2 x state; the clip's norm pass reads the gradient once more
        moved = {"step": 3 * p_bytes + 2 * state, "clip_step": 4 * p_bytes + 2 * state}
        row[side] = {"median_ms": med, "min_ms": {kind: min(t) for kind, t in ms.items()},
                     "state_bytes_per_param": state,
                     "percent_of_limit": {k: roofline.kernel_percent(med[k] / 1e3, limits, moved=n * moved[k])
                                          for k in med}}  # fmt: skip
    return row


def main() -> None:
    ap = _common.parser(__doc__, device=True)
    ap.add_argument("--models", help=f"comma list of {', '.join(MODELS)} (default: by device)")
    ap.add_argument("--dtypes", help="comma list of float32, bfloat16 (default: by device)")
    ap.add_argument("--grad-norms", help="comma list of gradient norms; max_norm is 1 (default: by device)")
    _common.int_options(ap, reps=9, warmup=2)
    ap.add_argument("--time-cap", type=float, default=float("inf"), help="no new start after these seconds")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    for key, value in DEFAULTS[args.device].items():
        setattr(args, key, getattr(args, key) or value)
    deadline = time.perf_counter() + args.time_cap
    stem, title = f"adamw_{args.device}", f"AdamW step + gradient clipping, {args.device}"
    result = _common.new_result(stem, "bitsandbytes", "torchao")
    result["limits"] = limits = roofline.measure_limits(args.device)
    result["settings"] = {k: getattr(args, k) for k in ("models", "dtypes", "grad_norms", "reps", "warmup")}
    rows = result["rows"] = []
    norms = map(float, args.grad_norms.split(","))
    for model, dtype, norm in itertools.product(args.models.split(","), args.dtypes.split(","), norms):
        shapes, dtype = MODELS[model](), getattr(torch, dtype)
        for name, factory in contenders(dtype, args.device).items():
            row = {"model": model, "n_params": sum(torch.Size(s).numel() for s in shapes), "dtype": str(dtype)[6:],
                   "grad_norm": norm, "contender": name}  # fmt: skip
            try:
                if time.perf_counter() > deadline:
                    raise TimeoutError("time cap")
                row |= compare(name, factory, shapes, dtype, norm, args, limits)
            except Exception as err:  # out of memory, the time cap, a peer with no kernel here: say so, go on
                if not (name in PEERS or isinstance(err, (torch.OutOfMemoryError, TimeoutError))):
                    raise
                row["skipped"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            rows.append(row)
            print(row, flush=True)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        # after every model x dtype x norm: a run cut short by its cap keeps what it measured
        _common.write(args.out, stem, result, title, markdown(result))


def markdown(result: dict) -> list[str]:
    lim = result["limits"]
    lines = [
        f"- reference: clip_grad_norm_ + torch.optim.AdamW(fused=True); settings {result['settings']}",
        f"- '% lim': against a copy rate of {lim['copy_bytes_per_s'] / 1e9:,.1f} GB/s ({lim['copy_measured']})",
        "- times in ms, medians of alternating repetitions; speed-up = reference's time / the contender's; error = "
        "|contender - reference| / |reference's update| over all parameters after the run",
        "",
        "| model | dtype | grad norm | contender | ref clip+step | clip+step | % lim | speed-up | speed-up (minima) "
        "| ref step | step | % lim | speed-up | state B/param (ref) | error |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for r in result["rows"]:
        head = f"| {r['model']} | {r['dtype']} | {r['grad_norm']:g} | {r['contender']} |"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']} |")
            continue
        ref, ours = r["reference"], r[r["contender"]]
        cells = []
        for kind in ("clip_step", "step"):
            pct = ours["percent_of_limit"][kind]
            cells += [f"{ref['median_ms'][kind]:.2f}", f"{ours['median_ms'][kind]:.2f}",
                      "n/a" if pct is None else f"{pct:.2g}%", f"{ref['median_ms'][kind] / ours['median_ms'][kind]:.2f}x"]  # fmt: skip
            if kind == "clip_step":
                cells.append(f"{ref['min_ms'][kind] / ours['min_ms'][kind]:.2f}x")
        state = f"{ours['state_bytes_per_param']:.2f} ({ref['state_bytes_per_param']:.2f})"
        lines.append(f"{head} {' | '.join(cells)} | {state} | {r['error_vs_update']:.1e} |")
    return lines


if __name__ == "__main__":
    main()
