"""GPU benchmark: FusedAdamW's modes and backends against torch's fused AdamW, alone and with gradient clipping.

For parameter lists shaped like GPT-2 124M, Llama-3.2 1B and Llama-2 7B, in fp32 and bf16 parameters
(gradients in the parameter dtype), it times per step (CUDA events, medians) the reference
``torch.optim.AdamW(fused=True)`` (``clip_grad_norm_`` + step for clip+step) and each FusedAdamW variant
(``defer_clip_grad_norm_`` + step), alternating with the reference when both optimizers' states fit:

- ``default``: moments in the parameter's dtype (torch's memory), on the Triton kernel and on the torch backend
  (torch's own kernel, the clip coefficient through its grad_scale): which of the two is faster decides the
  default backend on CUDA;
- ``float32``: fp32 moments (bf16 parameters only: for fp32 parameters it is ``default``);
- ``8bit``: blockwise 8-bit moments, the Triton kernel and the simple torch form (dequantize, torch's kernel,
  requantize: several passes), measured side by side;
- ``+sr``: stochastic rounding of bf16 parameters;
- bitsandbytes' and torchao's 8-bit AdamW where they import.

For each it records the state bytes per parameter (measured), the bytes a fused step must move per parameter
(2 x param + grad + 2 x state; clipping reads the gradient once more) and, beside each time, the % of the
roofline reached (``roofline.py``: those bytes over the copy bandwidth measured at the start of the run). Also: a small
sweep of launch configurations, and correctness on the 124M list (clip + step of each mode against its
reference: torch for ``default``, the torch backend for the others; per-tensor error relative to the update).

``--time-cap`` seconds (default 210) bounds the run: no new measurement starts past it, and what was measured
is written. ``--smoke`` runs tiny lists on CPU under TRITON_INTERPRET=1 (only to prove the script runs).
Results: ``<out>/adamw_gpu.json`` and ``.md`` (``adamw_gpu_smoke.*`` with ``--smoke``).

    python benchmarks/gpu/bench_adamw_gpu.py [--out benchmarks/results] [--reps 15] [--models ...]
        [--time-cap 210] [--smoke]
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

import roofline
import torch
from timing import Timer

from fasttrain import FusedAdamW
from fasttrain.kernels import adamw as kernels


def gpt2_124m():
    v, h, n = 50257, 768, 12
    shapes = [(v, h), (1024, h)]
    for _ in range(n):
        shapes += [
            (h,),
            (h,),
            (3 * h, h),
            (3 * h,),
            (h, h),
            (h,),
            (h,),
            (h,),
            (4 * h, h),
            (4 * h,),
            (h, 4 * h),
            (h,),
        ]
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
    "tiny-a": lambda: [(), (7,), (33, 65), (3000,), (5000,)],
    "tiny-b": lambda: llama(300, 32, 64, 2, 16, tied=False),
}
TORCH_FORM_MAX_PARAMS = 2_000_000_000  # the multi-pass torch form of 8-bit on the 7B list would take minutes


def variants(dtype, peers: bool):
    """name -> (optimizer factory, reps divisor): each FusedAdamW mode and backend, and the peers."""
    bf16 = dtype == torch.bfloat16
    out = {
        "default (triton)": (lambda ps: FusedAdamW(ps, lr=1e-4, backend="triton"), 1),
        "default (torch backend)": (lambda ps: FusedAdamW(ps, lr=1e-4, backend="torch"), 1),
    }
    if bf16:
        out["float32 (triton)"] = (
            lambda ps: FusedAdamW(ps, lr=1e-4, backend="triton", state_dtype=torch.float32),
            1,
        )
    out["8bit (triton)"] = (lambda ps: FusedAdamW(ps, lr=1e-4, backend="triton", state_dtype="8bit"), 1)
    out["8bit (torch form)"] = (lambda ps: FusedAdamW(ps, lr=1e-4, backend="torch", state_dtype="8bit"), 5)
    if bf16:
        out["default+sr (triton)"] = (
            lambda ps: FusedAdamW(ps, lr=1e-4, backend="triton", bf16_stochastic_rounding=True), 1,
        )  # fmt: skip
        out["8bit+sr (triton)"] = (
            lambda ps: FusedAdamW(ps, lr=1e-4, backend="triton", state_dtype="8bit", bf16_stochastic_rounding=True), 1,
        )  # fmt: skip
    if peers:
        try:
            import bitsandbytes as bnb

            out["bitsandbytes AdamW8bit"] = (lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-4), 1)
        except Exception:  # not installed, or no binary for this machine
            pass
        try:
            from torchao.optim import AdamW8bit

            out["torchao AdamW8bit"] = (lambda ps: AdamW8bit(ps, lr=1e-4), 1)
        except Exception:
            pass
    return out


def make_params(shapes, dtype, device):
    ps = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p) * 0.05  # norm well above 1: clipping is active
    return ps


def state_bytes(opt) -> int:
    """Bytes of the state (step counters excluded; shared tensors once; tensor subclasses unpacked)."""

    def tensors(v):
        if not isinstance(v, torch.Tensor):
            return []
        if type(v) is not torch.Tensor and hasattr(v, "__tensor_flatten__"):
            return [t for name in v.__tensor_flatten__()[0] for t in tensors(getattr(v, name))]
        return [v]

    seen = {}
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step":
                for t in tensors(value):
                    seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())


def free_bytes(device) -> float:
    return torch.cuda.mem_get_info()[0] if device.type == "cuda" else float("inf")


def release(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _state_bytes_estimate(variant: str, p_bytes: int) -> float:
    """Per parameter, before the state exists (to decide whether it fits beside the reference's)."""
    if "8bit" in variant or "AdamW8bit" in variant:
        return 2.1
    return 8.0 if variant.startswith("float32") else 2.0 * p_bytes


def _roofline(med: dict, n: int, p_bytes: int, state_per_param: float, limits, prefix: str = "") -> dict:
    """% of the hardware limit of the step and of clip + step (the same bytes for every implementation)."""
    return {
        kind: roofline.roofline_entry(
            med[prefix + kind] / 1e3, roofline.adamw_cost(n, p_bytes, p_bytes, state_per_param, clip), limits
        )
        for kind, clip in (("step", False), ("clip_step", True))
    }


def bench_model(name, shapes, dtype, device, timer, reps, warmup, peers, deadline, limits):
    n = sum(torch.Size(s).numel() for s in shapes)
    ps = make_params(shapes, dtype, device)
    p_bytes = ps[0].element_size()

    def run(opt, clip, fused_clip):
        def fn():
            if clip and fused_clip:
                opt.defer_clip_grad_norm_(1.0)
            elif clip:
                torch.nn.utils.clip_grad_norm_(ps, 1.0)
            opt.step()

        return fn

    def measure(fns, n_reps):
        times = {k: [] for k in fns}
        for fn in fns.values():  # warm-up (Triton compiles, state init)
            for _ in range(warmup):
                fn()
        for _ in range(n_reps):
            for key, fn in fns.items():
                times[key].append(timer(fn))
        return {k: statistics.median(v) for k, v in times.items()}

    ref = torch.optim.AdamW(ps, lr=1e-4, fused=True)
    ref_fns = {"ref_step": run(ref, False, False), "ref_clip_step": run(ref, True, False)}
    ref_block = measure(ref_fns, reps)
    ref_state = state_bytes(ref)
    rows = []
    for vname, (factory, divisor) in variants(dtype, peers).items():
        if time.perf_counter() > deadline:
            rows.append({"variant": vname, "skipped": "time cap"})
            continue
        if "torch form" in vname and n > TORCH_FORM_MAX_PARAMS:
            rows.append(
                {"variant": vname, "skipped": f"torch form not run above {TORCH_FORM_MAX_PARAMS:,} params"}
            )
            continue
        fused_clip = "AdamW8bit" not in vname
        need = n * _state_bytes_estimate(vname, p_bytes)
        if ref is not None and free_bytes(device) < 1.1 * need + 2**30:
            # both states do not fit (7B fp32): the reference's block times stand for it from here on
            ref = ref_fns = None
            release(device)
        try:
            opt = factory(ps)
            run(opt, False, fused_clip)()  # creates the state
            sb = state_bytes(opt)
            fits = ref is not None
            fns = {"step": run(opt, False, fused_clip), "clip_step": run(opt, True, fused_clip)}
            n_reps = max(2, reps // divisor)
            # side by side with the reference when both fit, else against its block
            med = measure({**ref_fns, **fns}, n_reps) if fits else {**ref_block, **measure(fns, n_reps)}
        except Exception as err:  # a peer without a kernel for this machine, an out-of-memory: say so, go on
            rows.append(
                {"variant": vname, "skipped": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
            )
            opt = None
            release(device)
            continue
        moved = 2 * p_bytes + p_bytes + 2 * sb / n
        rows.append(
            {
                "variant": vname,
                "alternating": fits,
                "median_ms": med,
                "speedup_step": med["ref_step"] / med["step"],
                "speedup_clip_step": med["ref_clip_step"] / med["clip_step"],
                "state_bytes_per_param": sb / n,
                "state_vs_torch": sb / ref_state,
                "bytes_moved_per_param": moved,
                "bandwidth_step_GBps": moved * n / (med["step"] / 1e3) / 1e9,
                "roofline": _roofline(med, n, p_bytes, sb / n, limits),
            }
        )
        del opt
        release(device)
    ref_moved = 2 * p_bytes + p_bytes + 2 * ref_state / n
    return {
        "model": name,
        "dtype": str(dtype).replace("torch.", ""),
        "n_params": n,
        "n_tensors": len(shapes),
        "reference_ms": ref_block,
        "reference_state_bytes_per_param": ref_state / n,
        "reference_bytes_moved_per_param": ref_moved,
        "reference_bandwidth_step_GBps": ref_moved * n / (ref_block["ref_step"] / 1e3) / 1e9,
        "reference_roofline": _roofline(ref_block, n, p_bytes, ref_state / n, limits, prefix="ref_"),
        "variants": rows,
    }


def sweep_configs(device, timer, reps, smoke):
    """Step time of the 1B fp32 list under a few (CHUNK, BLOCK, num_warps) choices (default mode)."""
    shapes = SMOKE_MODELS["tiny-b"]() if smoke else MODELS["llama3.2-1B"]()
    ps = make_params(shapes, torch.float32, device)
    configs = [(16384, 1024, 4), (8192, 1024, 4), (32768, 2048, 8), (65536, 4096, 8), (16384, 2048, 8)]
    if smoke:
        configs = configs[:1]
    saved = kernels.CHUNK, kernels.BLOCK, kernels.NUM_WARPS
    out = []
    try:
        for chunk, block, warps in configs:
            kernels.CHUNK, kernels.BLOCK, kernels.NUM_WARPS = chunk, block, warps
            opt = FusedAdamW(ps, lr=1e-4, backend="triton")
            for _ in range(2):
                opt.step()
            ts = [timer(opt.step) for _ in range(reps)]
            out.append(
                {"chunk": chunk, "block": block, "num_warps": warps, "median_ms": statistics.median(ts)}
            )
            del opt
    finally:
        kernels.CHUNK, kernels.BLOCK, kernels.NUM_WARPS = saved
    return out


def _tracks(ours, ref, start) -> float:
    """Worst per-tensor ||ours - ref|| / (||ref - start|| + one rounding step of the parameter) (as the tests)."""
    worst = 0.0
    for a, b, s in zip(ours, ref, start, strict=True):
        a32, b32, s32 = a.detach().float(), b.detach().float(), s.float()
        floor = float((torch.finfo(b.dtype).eps * b32.abs()).norm())
        worst = max(worst, float((a32 - b32).norm()) / (float((b32 - s32).norm()) + floor + 1e-30))
    return worst


def correctness(device, smoke):
    """Three clip + steps of each mode on the 124M (or tiny) list against its reference."""
    shapes = SMOKE_MODELS["tiny-a"]() if smoke else MODELS["gpt2-124M"]()
    checks = {}
    cases = [
        ("default fp32 vs torch fused", torch.float32, {}, "torch"),
        ("default bf16 vs torch fused", torch.bfloat16, {}, "torch"),
        ("8bit fp32: triton vs torch backend", torch.float32, {"state_dtype": "8bit"}, "ours-torch"),
        ("8bit+sr bf16: triton vs torch backend", torch.bfloat16, {"state_dtype": "8bit", "bf16_stochastic_rounding": True},
         "ours-torch"),
    ]  # fmt: skip
    for label, dtype, kwargs, ref_kind in cases:
        torch.manual_seed(0)
        a = make_params(shapes, dtype, device)
        b = [torch.nn.Parameter(p.detach().clone()) for p in a]
        start = [p.detach().clone() for p in a]
        ours = FusedAdamW(a, lr=1e-3, backend="triton", min_8bit_size=1024 if smoke else 4096, **kwargs)
        if ref_kind == "torch":
            ref = torch.optim.AdamW(b, lr=1e-3, fused=True)
        else:
            ref = FusedAdamW(b, lr=1e-3, backend="torch", min_8bit_size=1024 if smoke else 4096, **kwargs)
        norms = []
        for step in range(3):
            g = torch.Generator(device=device).manual_seed(step)
            for p, q in zip(a, b, strict=True):
                p.grad = torch.randn(p.shape, device=device, generator=g).to(dtype) * 0.05
                q.grad = p.grad.clone()
            n_ours = ours.defer_clip_grad_norm_(1.0)
            n_ref = (
                ref.defer_clip_grad_norm_(1.0)
                if ref_kind != "torch"
                else torch.nn.utils.clip_grad_norm_(b, 1.0)
            )
            norms.append(abs(float(n_ours) - float(n_ref)) / float(n_ref))
            ours.step()
            ref.step()
        checks[label] = {"max_rel_norm_diff": max(norms), "worst_tensor_err_vs_update": _tracks(a, b, start)}
        del a, b, start, ours, ref
        release(device)
    return checks


def decision(results) -> dict:
    """The default backend on CUDA by the measurements: Triton's default mode vs torch's kernel (clip + step)."""
    votes = []
    for r in results:
        v = {x["variant"]: x for x in r["variants"] if "median_ms" in x}
        if "default (triton)" in v and "default (torch backend)" in v:
            t, o = (
                v["default (triton)"]["median_ms"]["clip_step"],
                v["default (torch backend)"]["median_ms"]["clip_step"],
            )
            votes.append({"model": r["model"], "dtype": r["dtype"], "triton_over_torch_backend": o / t})
    faster = sum(1 for x in votes if x["triton_over_torch_backend"] > 1.0)
    return {"votes": votes, "triton_faster_in": f"{faster} of {len(votes)}",
            "verdict": "triton" if votes and faster * 2 > len(votes) else "torch"}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS)
    )
    ap.add_argument(
        "--time-cap", type=float, default=210.0, help="seconds after which no new measurement starts"
    )
    ap.add_argument(
        "--no-peers", action="store_true", help="skip bitsandbytes and torchao even if they import"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny lists on CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    t_start = time.perf_counter()
    deadline = t_start + args.time_cap

    if args.smoke:
        device = torch.device("cpu")
        models = SMOKE_MODELS
        reps, warmup = 1, 0  # a run-through, not a timing: every code path once
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --smoke for a CPU run-through")
        device = torch.device("cuda")
        models = {k: MODELS[k] for k in args.models.split(",")}
        reps, warmup = args.reps, args.warmup
    timer = Timer(device, unit="ms")

    check = correctness(device, args.smoke)  # correctness first
    print(json.dumps(check), flush=True)
    limits = roofline.load(Path(args.out), device.type, args.smoke)
    results = []
    for name, make in models.items():
        for dtype in (torch.float32, torch.bfloat16):
            if time.perf_counter() > deadline:
                break
            peers = not (args.smoke or args.no_peers)
            r = bench_model(name, make(), dtype, device, timer, reps, warmup, peers, deadline, limits)
            results.append(r)
            release(device)
            print(json.dumps(r), flush=True)
    sweep = sweep_configs(device, timer, reps, args.smoke) if time.perf_counter() < deadline else []

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
        "roofline_limits": limits.to_json(),
        "correctness_124M": check,
        "results": results,
        "default_backend_decision": decision(results),
        "config_sweep_llama1B_fp32_step": sweep,
        "wall_s": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "adamw_gpu_smoke" if args.smoke else "adamw_gpu"
    (out / f"{stem}.json").write_text(json.dumps(info, indent=2) + "\n")
    text = markdown(info)
    (out / f"{stem}.md").write_text(text)
    print(text)


def _pct(lim: dict, kind: str) -> str:
    return roofline.fmt_percent(lim[kind]["percent_of_limit"])


def markdown(info) -> str:
    lines = [
        "# AdamW step (+ clipping) on GPU: FusedAdamW modes and backends vs torch fused AdamW",
        "",
        f"- date: {info['date']}; device: {info['device']}; versions: {info['versions']}",
        f"- command: `{info['command']}`",
        f"- roofline: copy {info['roofline_limits']['copy_bytes_per_s'] / 1e9:,.0f} GB/s (read + write), "
        f"{info['roofline_limits']['source']}; kernel config {info['kernel_config']}",
        f"- default backend on CUDA by these figures: {info['default_backend_decision']['verdict']} "
        f"(Triton's default mode faster than torch's kernel in {info['default_backend_decision']['triton_faster_in']} "
        "model x dtype cases, clip + step)",
        "",
        "Correctness (3 clip + steps; worst per-tensor error relative to the update):",
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in info["correctness_124M"].items()]
    lines += [
        "",
        "Speedups are torch fused AdamW's time over the variant's (> 1: the variant is faster); state and moved bytes "
        "per parameter (moved = 2 x param + grad + 2 x state). '% lim' beside a time: the least time the hardware "
        "allows for the bytes the step must move (clip + step: the gradient read once more) over the measured time.",
        "",
        "| model | dtype | variant | step ms | % lim | speedup | clip+step ms | % lim | speedup | state B/p | vs torch "
        "| moved B/p | GB/s | side by side |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in info["results"]:
        ref, ref_lim = r["reference_ms"], r["reference_roofline"]
        lines.append(
            f"| {r['model']} | {r['dtype']} | torch AdamW(fused) | {ref['ref_step']:.3f} | {_pct(ref_lim, 'step')} | "
            f"1.00x | {ref['ref_clip_step']:.3f} | {_pct(ref_lim, 'clip_step')} | 1.00x | "
            f"{r['reference_state_bytes_per_param']:.2f} | 1.00x | {r['reference_bytes_moved_per_param']:.2f} | "
            f"{r['reference_bandwidth_step_GBps']:.0f} | |"
        )
        for v in r["variants"]:
            if "skipped" in v:
                lines.append(f"| {r['model']} | {r['dtype']} | {v['variant']} | skipped: {v['skipped']} |")
                continue
            m = v["median_ms"]
            lim = v["roofline"]
            lines.append(
                f"| {r['model']} | {r['dtype']} | {v['variant']} | {m['step']:.3f} | {_pct(lim, 'step')} | "
                f"{v['speedup_step']:.2f}x | {m['clip_step']:.3f} | {_pct(lim, 'clip_step')} | "
                f"{v['speedup_clip_step']:.2f}x | {v['state_bytes_per_param']:.2f} | {v['state_vs_torch']:.2f}x | "
                f"{v['bytes_moved_per_param']:.2f} | {v['bandwidth_step_GBps']:.0f} | "
                f"{'yes' if v['alternating'] else 'blocks'} |"
            )
    sweep = info["config_sweep_llama1B_fp32_step"]
    lines += ["", "Launch configurations (1B fp32 step, default mode):", ""]
    lines += [
        f"- CHUNK={s['chunk']} BLOCK={s['block']} warps={s['num_warps']}: {s['median_ms']:.3f} ms"
        for s in sweep
    ]
    lines.append(f"\nwall time: {info['wall_s']:.0f} s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
