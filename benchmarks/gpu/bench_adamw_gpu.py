"""GPU benchmark: FusedAdamW (Triton) against torch's fused AdamW, alone and with gradient clipping.

For parameter lists shaped like GPT-2 124M, Llama-3.2 1B and Llama-2 7B, in fp32 and bf16
parameters (gradients in the parameter dtype), it times per step (CUDA events, medians of
alternating repetitions):

- ``step``: ``torch.optim.AdamW(fused=True).step()`` vs ``FusedAdamW.step()``;
- ``clip+step``: ``clip_grad_norm_`` + torch fused step vs ``FusedAdamW.defer_clip_grad_norm_`` + ``step()``;

and the achieved bandwidth from the bytes each step must move (fp32: read p, g, m, v and write p, m, v
= 28 B/parameter; bf16 parameters with our fp32 states: 22 B; torch's fused AdamW keeps bf16 states
for bf16 parameters: 14 B) against the measured device copy bandwidth. Also records a small
sweep of launch configurations and a correctness check against torch on the 124M list.

Runs in under 4 minutes on one H200. ``--smoke`` runs tiny lists on CPU under TRITON_INTERPRET=1
(only to prove the script runs). Results: ``<out>/adamw_gpu.json`` and ``.md``.

    python benchmarks/gpu/bench_adamw_gpu.py [--out benchmarks/results] [--reps 15] [--smoke]
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # must precede the first import of triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import datetime as dt
import gc
import json
import platform
import shlex
import statistics
import time
from pathlib import Path

import torch

from fasttrain import FusedAdamW
from fasttrain.kernels import adamw as kernels


def gpt2_124m():
    v, h, n = 50257, 768, 12
    shapes = [(v, h), (1024, h)]
    for _ in range(n):
        shapes += [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    return [*shapes, (h,), (h,)]


def llama(vocab, hidden, inter, layers, kv, tied):
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]
        shapes += [(inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    shapes.append((hidden,))
    if not tied:
        shapes.append((vocab, hidden))
    return shapes


MODELS = {
    "gpt2-124M": gpt2_124m,
    "llama3.2-1B": lambda: llama(128256, 2048, 8192, 16, 512, tied=True),
    "llama2-7B": lambda: llama(32000, 4096, 11008, 32, 4096, tied=False),
}
SMOKE_MODELS = {
    "tiny-a": lambda: [(), (7,), (33, 65), (3000,)],
    "tiny-b": lambda: llama(300, 32, 64, 2, 16, tied=False),
}


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def copy_bandwidth(device, timer, smoke) -> float:
    n = 2**16 if smoke else 2**30  # 4 GiB fp32
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = [timer(lambda: dst.copy_(src)) for _ in range(10)]
    return 2 * n * 4 / (statistics.median(times) / 1e3)  # bytes/s (read + write)


def make_params(shapes, dtype, device):
    ps = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p) * 0.05  # norm well above 1: clipping is active
    return ps


def bench_model(name, shapes, dtype, device, timer, reps, warmup, smoke):
    n = sum(torch.Size(s).numel() for s in shapes)
    backend = "triton"
    ps = make_params(shapes, dtype, device)
    # one set of parameters and gradients shared by both optimizers (memory: 7B fp32 would not fit
    # twice); each optimizer has its own states. When the states do not fit, blocks replace alternation.
    state_bytes_ours = 8 * n
    state_bytes_ref = 2 * n * ps[0].element_size()
    fits_both = smoke or (
        torch.cuda.mem_get_info()[0] > (state_bytes_ours + state_bytes_ref) * 1.1 + 2**30
    )
    variants = {
        "torch_step": None,
        "ours_step": None,
        "torch_clip_step": None,
        "ours_clip_step": None,
    }
    times = {k: [] for k in variants}

    def run_ref(opt, clip):
        def fn():
            if clip:
                torch.nn.utils.clip_grad_norm_(ps, 1.0)
            opt.step()

        return fn

    def run_ours(opt, clip):
        def fn():
            if clip:
                opt.defer_clip_grad_norm_(1.0)
            opt.step()

        return fn

    def measure(pairs):
        for fn in pairs.values():  # warm-up (Triton compiles, state init)
            for _ in range(warmup):
                fn()
        for _ in range(reps):
            for key, fn in pairs.items():
                times[key].append(timer(fn))

    if fits_both:
        ref = torch.optim.AdamW(ps, lr=1e-4, fused=True)
        ours = FusedAdamW(ps, lr=1e-4, backend=backend)
        measure(
            {
                "torch_step": run_ref(ref, False),
                "ours_step": run_ours(ours, False),
                "torch_clip_step": run_ref(ref, True),
                "ours_clip_step": run_ours(ours, True),
            }
        )
        del ref, ours
    else:
        ref = torch.optim.AdamW(ps, lr=1e-4, fused=True)
        measure({"torch_step": run_ref(ref, False), "torch_clip_step": run_ref(ref, True)})
        del ref
        gc.collect()
        torch.cuda.empty_cache()
        ours = FusedAdamW(ps, lr=1e-4, backend=backend)
        measure({"ours_step": run_ours(ours, False), "ours_clip_step": run_ours(ours, True)})
        del ours
    med = {k: statistics.median(v) for k, v in times.items()}
    low = dtype != torch.float32
    bytes_ours = n * (22 if low else 28)
    bytes_ref = n * (14 if low else 28)
    g_bytes = n * (2 if low else 4)
    return {
        "model": name,
        "dtype": str(dtype).replace("torch.", ""),
        "n_params": n,
        "n_tensors": len(shapes),
        "alternating": fits_both,
        "median_ms": med,
        "speedup_step": med["torch_step"] / med["ours_step"],
        "speedup_clip_step": med["torch_clip_step"] / med["ours_clip_step"],
        "bandwidth_ours_step_GBps": bytes_ours / (med["ours_step"] / 1e3) / 1e9,
        "bandwidth_torch_step_GBps": bytes_ref / (med["torch_step"] / 1e3) / 1e9,
        "bandwidth_ours_clip_step_GBps": (bytes_ours + g_bytes) / (med["ours_clip_step"] / 1e3) / 1e9,
        "bytes_per_param_ours": bytes_ours / n,
        "bytes_per_param_torch": bytes_ref / n,
    }


def sweep_configs(device, timer, reps, smoke):
    """Step time of the 1B fp32 list under a few (CHUNK, BLOCK, num_warps) choices."""
    shapes = SMOKE_MODELS["tiny-b"]() if smoke else MODELS["llama3.2-1B"]()
    ps = make_params(shapes, torch.float32, device)
    configs = [(16384, 1024, 4), (8192, 1024, 4), (32768, 2048, 8), (65536, 4096, 8), (16384, 2048, 8)]
    if smoke:
        configs = configs[:2]
    saved = kernels.CHUNK, kernels.BLOCK, kernels.NUM_WARPS
    out = []
    try:
        for chunk, block, warps in configs:
            kernels.CHUNK, kernels.BLOCK, kernels.NUM_WARPS = chunk, block, warps
            opt = FusedAdamW(ps, lr=1e-4, backend="triton")
            for _ in range(2):
                opt.step()
            ts = [timer(opt.step) for _ in range(reps)]
            out.append({"chunk": chunk, "block": block, "num_warps": warps, "median_ms": statistics.median(ts)})
            del opt
    finally:
        kernels.CHUNK, kernels.BLOCK, kernels.NUM_WARPS = saved
    return out


def correctness(device, smoke):
    """One clip + step of ours vs clip_grad_norm_ + torch AdamW (fp32) on the 124M (or tiny) list."""
    shapes = SMOKE_MODELS["tiny-a"]() if smoke else MODELS["gpt2-124M"]()
    torch.manual_seed(0)
    a = make_params(shapes, torch.float32, device)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b, strict=True):
        q.grad = p.grad.clone()
    ours = FusedAdamW(a, lr=1e-3, backend="triton")
    ref = torch.optim.AdamW(b, lr=1e-3)
    n_ours = ours.defer_clip_grad_norm_(1.0)
    n_ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    ours.step()
    ref.step()
    diff = max(((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item() for p, q in zip(a, b, strict=True))
    return {"norm_ours": float(n_ours), "norm_torch": float(n_ref), "max_rel_param_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    ap.add_argument("--smoke", action="store_true", help="tiny lists on CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    t_start = time.perf_counter()

    if args.smoke:
        device = torch.device("cpu")
        models = SMOKE_MODELS
        reps, warmup = 2, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --smoke for a CPU run-through")
        device = torch.device("cuda")
        models = {k: MODELS[k] for k in args.models.split(",")}
        reps, warmup = args.reps, args.warmup
    timer = Timer(device)

    copy_bw = copy_bandwidth(device, timer, args.smoke)
    results = []
    for name, make in models.items():
        for dtype in (torch.float32, torch.bfloat16):
            r = bench_model(name, make(), dtype, device, timer, reps, warmup, args.smoke)
            gc.collect()  # the lists of the last model must be gone before the next one (7B: 100+ GB)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            r["fraction_of_copy_bw_ours_step"] = r["bandwidth_ours_step_GBps"] * 1e9 / copy_bw
            results.append(r)
            print(json.dumps(r), flush=True)
    sweep = sweep_configs(device, timer, reps, args.smoke)
    check = correctness(device, args.smoke)

    import triton

    info = {
        "benchmark": "adamw_gpu",
        "smoke": args.smoke,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
        },
        "kernel_config": {"chunk": kernels.CHUNK, "block": kernels.BLOCK, "num_warps": kernels.NUM_WARPS},
        "copy_bandwidth_GBps": copy_bw / 1e9,
        "results": results,
        "config_sweep_llama1B_fp32_step": sweep,
        "correctness_124M_fp32": check,
        "wall_s": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "adamw_gpu_smoke" if args.smoke else "adamw_gpu"
    (out / f"{stem}.json").write_text(json.dumps(info, indent=2) + "\n")
    lines = [
        "# AdamW step (+ clipping) on GPU: FusedAdamW (Triton) vs torch fused AdamW",
        "",
        f"- date: {info['date']}; device: {info['device']}; versions: {info['versions']}",
        f"- command: `{info['command']}`",
        f"- measured copy bandwidth: {copy_bw / 1e9:.0f} GB/s; kernel config {info['kernel_config']}",
        f"- correctness (124M fp32, clip + step vs torch): {check}",
        "- bytes/param: fp32 28 (both); bf16 params: ours 22 (fp32 states), torch 14 (bf16 states)",
        "",
        "| model | dtype | params | torch step ms | ours step ms | step speedup | torch clip+step ms "
        "| ours clip+step ms | clip+step speedup | ours GB/s | % of copy BW |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        m = r["median_ms"]
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['n_params'] / 1e6:.0f}M | {m['torch_step']:.3f} | "
            f"{m['ours_step']:.3f} | {r['speedup_step']:.2f}x | {m['torch_clip_step']:.3f} | "
            f"{m['ours_clip_step']:.3f} | {r['speedup_clip_step']:.2f}x | {r['bandwidth_ours_step_GBps']:.0f} | "
            f"{100 * r['fraction_of_copy_bw_ours_step']:.0f}% |"
        )
    lines += ["", "Launch configurations (1B fp32 step):", ""]
    lines += [f"- CHUNK={s['chunk']} BLOCK={s['block']} warps={s['num_warps']}: {s['median_ms']:.3f} ms" for s in sweep]
    lines.append(f"\nwall time: {info['wall_s']:.0f} s")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
