"""Benchmark: chunked fused-linear cross-entropy and TRL's fused LM head vs materialised logits, CPU or CUDA.

Cases (``--cases``): loss, model, head, trl_sft, trl_dpo, speculation, trl_sft_speculation, trl_lora_speculation.
How it measures (contenders, timing, memory, '% lim'): docs/method.md, "LM-head losses".

    python benchmarks/bench_loss.py                 # writes benchmarks/results/loss_cpu.{json,md}
    python benchmarks/bench_loss.py --cases trl_sft,trl_dpo --tokens 2048 --name loss_trl_cpu
    python benchmarks/bench_loss.py --cases head --tokens 460 --name head_gemms_cpu
    python benchmarks/bench_loss.py --device cuda --cases loss --tokens 8192,16384 --budget-s 33   # as the GPU kit
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

import _common
from fasttrain.bench import provenance, roofline

VOCAB = 151_936
HEAD_WIDTH = 1024  # Qwen3-0.6B's hidden size
# Triton-on-CUDA libraries; torch.compile's compilation would dwarf a CPU step. fasttrain_wide: chunks of ~hidden
# rows, against the default's memory-sized ones (that re-read the fp32 weight gradient: docs/measured.md)
CUDA_ONLY = ("fasttrain_wide", "torch_compile", "liger", "cce")
IMPLS = {
    "loss": ("reference", "fasttrain", "torch_linear_ce", "torch_chunked_ce", *CUDA_ONLY),
    "model": ("reference", "fasttrain"),
    "head": ("gemms", "reference", "fasttrain"),
    "trl_sft": ("plain", "trl", "fasttrain", "liger"),
    "trl_dpo": ("plain", "trl", "fasttrain"),
    "speculation": ("recompute", "fasttrain"),
    "trl_sft_speculation": ("recompute", "fasttrain"),
    "trl_lora_speculation": ("recompute", "fasttrain"),
}
TRL_OUTPUTS = {
    "trl_sft": ("log_probs", "entropy", "is_top1"),
    "trl_dpo": ("log_probs", "entropy", "mean_logits", "is_top1"),
}
# the fused kernels' backend: auto (torch on CPU, Triton on CUDA), or Triton's interpreter where it is asked for
BACKEND = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "auto"


def _reference(hidden, weight, labels):  # what ForCausalLMLoss runs after its shift
    from transformers.loss.loss_utils import fixed_cross_entropy

    return fixed_cross_entropy((hidden @ weight.t()).float(), labels)


def _loss_fn(impl: str):
    if impl == "reference":
        return _reference
    if impl in ("fasttrain", "recompute"):
        from fasttrain import fused_linear_cross_entropy

        if impl == "recompute":  # the same mean from per-token losses: the backward recomputes the logits
            return lambda h, w, y: fused_linear_cross_entropy(h, w, y, reduction="none", backend=BACKEND).sum() / (y != -100).sum()  # fmt: skip
        return lambda h, w, y: fused_linear_cross_entropy(h, w, y, backend=BACKEND)
    if impl == "fasttrain_wide":
        from fasttrain import fused_linear_cross_entropy

        return lambda h, w, y: fused_linear_cross_entropy(
            h, w, y, chunk_rows=1 << (h.shape[-1].bit_length() - 1)
        )
    if impl in ("torch_linear_ce", "torch_chunked_ce"):
        options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
        if options is None:  # a torch without F.linear_cross_entropy and its options (2.15 has both)
            raise ImportError(f"torch {torch.__version__} has no F.linear_cross_entropy")
        chunked = options() if impl == "torch_chunked_ce" else None
        return partial(torch.nn.functional.linear_cross_entropy, ignore_index=-100, options=chunked)
    if impl == "torch_compile":
        return torch.compile(_reference, dynamic=True)
    if impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        module = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, y: module(w, h, y)
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy


def _loss_step(impl: str, tokens: int, width: int, vocab: int, device: str, dtype: str):
    hidden, weight, labels = _common.lm_head_inputs(tokens, width, vocab, device, dtype)
    labels[::5] = -100
    fn = _loss_fn(impl)

    def step() -> float:
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, labels)
        loss.backward()
        return float(loss)

    return step


def _head_step(impl: str, tokens: int, width: int, vocab: int = VOCAB, device="cpu", dtype="float32"):
    if impl != "gemms":
        return _loss_step(impl, tokens, width, vocab, device, dtype)
    hidden, weight, _ = _common.lm_head_inputs(tokens, width, vocab, device, dtype)
    upstream = torch.randn(tokens, vocab, device=device, dtype=hidden.dtype).mul_(1e-6)

    def step() -> float:
        with torch.no_grad():
            logits, grad_hidden, grad_weight = hidden @ weight.t(), upstream @ weight, upstream.t() @ hidden
        return float(logits[0, 0] + grad_hidden[0, 0] + grad_weight[0, 0])

    return step


def _model_step(impl: str, tokens: int, width: int, vocab: int, device: str, dtype: str):
    from fasttrain.loss.model_patch import enable_fused_loss

    model = _common.tiny_qwen3(vocab, 256, 2, max_position_embeddings=4096)
    model = model.to(device, getattr(torch, dtype)).train()
    if impl == "fasttrain":
        assert enable_fused_loss(model) is None
    seq = tokens // 4
    input_ids = torch.randint(0, vocab, (4, seq), device=device)
    labels = input_ids.clone()
    labels[:, : seq // 4] = -100

    def step() -> float:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids, labels=labels)
        out.loss.backward()
        return float(out.loss)

    return step


def _trl_step(case: str, impl: str, tokens: int, width: int, vocab: int, device: str, dtype: str):
    from fasttrain.loss.token_logprobs import fused_token_log_probs

    if impl == "liger":  # the loss alone: Liger has no per-token log-prob head
        return _loss_step(impl, tokens, width, vocab, device, dtype)
    outputs = TRL_OUTPUTS.get(case, TRL_OUTPUTS["trl_sft"])  # the speculation cases: SFT's
    # the scored tokens only
    hidden, weight, labels = _common.lm_head_inputs(tokens, width, vocab, device, dtype)
    # LoRA's head is frozen: only the hidden states need a gradient
    weight.requires_grad_(case != "trl_lora_speculation")
    ref_logps = torch.randn(8, device=device) * 10 - 100 * tokens / 8
    if impl == "trl":
        from trl.kernels import ChunkedLogProbFunction

    def per_token():
        if impl == "plain":
            log_p = F.log_softmax((hidden @ weight.t()).float(), dim=-1)
            with torch.no_grad():  # the metrics TRL logs
                entropy = -(log_p.exp() * log_p).sum(-1)
            return log_p.gather(1, labels[:, None]).squeeze(1), entropy
        if impl == "trl":
            out = ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0, 32768, None, 1.0, outputs)
            return out[0], out[1]
        sft = case != "trl_dpo" and impl != "recompute"  # SFT's upstream gradient is -1/n for every token
        out = fused_token_log_probs(
            hidden, weight, labels, outputs=outputs, uniform_grad=sft, backend=BACKEND
        )
        return out.log_probs, out.entropy

    def step() -> float:
        hidden.grad = weight.grad = None
        log_probs, entropy = per_token()
        if case == "trl_dpo":  # sigmoid DPO over 8 sequences: 4 chosen, 4 rejected
            chosen, rejected = (log_probs.float().reshape(8, -1).sum(1) - ref_logps).chunk(2)
            loss = -F.logsigmoid(0.1 * (chosen - rejected)).mean()
        else:
            loss = -log_probs.float().sum() / tokens
        loss.backward()
        return float(loss) + 0.0 * float(entropy.sum())

    return step


def measure(case: str, impl: str, tokens: int, args) -> dict:
    """One run: build the case, one warm-up step, ``args.steps`` timed steps; time, peak memory and loss, or why
    it was skipped (an implementation that does not import)."""
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/statm") as f:
            base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    torch.manual_seed(0)
    width = HEAD_WIDTH if case == "head" else args.hidden
    shape = (tokens, width, args.vocab, args.device, args.dtype)
    builders = {"loss": _loss_step, "speculation": _loss_step, "head": _head_step, "model": _model_step}
    try:
        step = _trl_step(case, impl, *shape) if case.startswith("trl_") else builders[case](impl, *shape)
    except ImportError as exc:
        return {"skipped": str(exc)}
    loss = step()
    times = [provenance.timed(step, args.device) for _ in range(args.steps)]
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # fmt: skip
    return {"time_s": statistics.median(times), "peak_bytes": peak - base, "loss": loss}


def run(case: str, impl: str, tokens: int, args) -> dict:
    """One run, in a fresh process on CPU (one run's peak RSS cannot hide another's); on CUDA in this one (a
    process start would dwarf the steps)."""
    if args.device == "cuda":
        return measure(case, impl, tokens, args)
    settings = [f"--{k}={getattr(args, k)}" for k in ("steps", "hidden", "vocab", "device")]
    cmd = [sys.executable, __file__, "--child", case, impl, f"--tokens={tokens}", *settings]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{case}/{impl} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = _common.parser(__doc__, device=True)
    parser.add_argument("--child", nargs=2, metavar=("CASE", "IMPL"), help=argparse.SUPPRESS)
    parser.add_argument("--cases", default="loss,model", help="comma list of " + ", ".join(IMPLS))
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run (after one warm-up)")
    parser.add_argument("--tokens", help="comma list (default: 4096 on CPU, 8192,16384 on CUDA)")
    parser.add_argument("--hidden", type=int, help="hidden size of the loss and TRL cases (512 CPU, 4096 CUDA)")  # fmt: skip
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="no new run starts after this")
    parser.add_argument("--name", help="results file stem (default: loss_DEVICE)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.tokens = [int(t) for t in (args.tokens or ("8192,16384" if cuda else "4096")).split(",")]
    args.hidden = args.hidden or (4096 if cuda else 512)
    args.dtype = "bfloat16" if cuda else "float32"
    if args.child:
        return print(json.dumps(measure(*args.child, args.tokens[0], args)))
    deadline = time.monotonic() + args.budget_s
    result = _common.new_result(f"loss_{args.device}", "liger-kernel", "cut-cross-entropy")
    result["limits"] = limits = roofline.measure_limits(args.device)
    keys = ("device", "rounds", "steps", "tokens", "hidden", "vocab", "dtype")
    result["settings"] = {k: getattr(args, k) for k in keys}
    result["results"] = []
    stem, title = args.name or f"loss_{args.device}", f"Fused LM-head losses, {args.device}"
    for case in args.cases.split(","):
        impls = [i for i in IMPLS[case] if cuda or i not in CUDA_ONLY]
        for tokens in args.tokens:
            runs: dict[str, list[dict]] = {impl: [] for impl in impls}
            for r in range(args.rounds):
                for impl in impls if r % 2 == 0 else impls[::-1]:
                    if time.monotonic() < deadline:
                        runs[impl].append(run(case, impl, tokens, args))
                        print(f"[{case} {tokens}] round {r} {impl}: {runs[impl][-1]}", file=sys.stderr)
            impls_done = _summary(runs, case, tokens, args, limits)
            result["results"].append({"case": case, "tokens": tokens, "impls": impls_done})
            # written after each case and size: a run cut short (--budget-s, a timeout) keeps what it did
            _common.write(args.out, stem, result, title, _markdown(result))


def _summary(runs: dict[str, list[dict]], case: str, tokens: int, args, limits: dict) -> dict:
    """Each implementation's medians and '% lim'. The least the head's loss + backward must do: its three
    matmuls over the scored tokens, and moving hidden, weight and their gradients (never the logits)."""
    width, dtype_bytes = HEAD_WIDTH if case == "head" else args.hidden, 2 if args.dtype == "bfloat16" else 4
    scored = tokens - len(range(0, tokens, 5)) if case in ("loss", "speculation") else tokens
    frozen = case == "trl_lora_speculation"  # no weight gradient: two matmuls of three, one tensor less
    moved = (2.0 * tokens + (1 if frozen else 2) * args.vocab) * width * dtype_bytes
    cost = {"flops": (4.0 if frozen else 6.0) * scored * width * args.vocab, "moved": moved}
    out = {}
    for impl, rs in runs.items():
        done = [r for r in rs if "time_s" in r]
        if not done:
            out[impl] = {"skipped": rs[0]["skipped"] if rs else "time budget"}
            continue
        time_s = statistics.median(r["time_s"] for r in done)
        out[impl] = {"time_s": time_s, "peak_mib": statistics.median(r["peak_bytes"] for r in done) / 2**20,
                     "loss": done[0]["loss"], "runs": done,
                     "percent_of_limit": None if case == "model" else roofline.kernel_percent(time_s, limits, **cost)}  # fmt: skip
    return out


def _markdown(result: dict) -> list[str]:
    lim = result["limits"]
    lines = [
        f"- settings: {result['settings']}; implementations alternating, medians (see the script's docstring)",
        f"- '% lim': against {lim['matmul_flops_per_s'] / 1e12:,.3g} TFLOP/s ({lim['measured']}) and "
        f"{lim['copy_bytes_per_s'] / 1e9:,.1f} GB/s ({lim['copy_measured']})",
        "- speed-up = its time / fasttrain's (below 1: fasttrain is slower); memory = its peak / fasttrain's",
        "",
        "| case | tokens | implementation | time | peak | % lim | fasttrain's speed-up | fasttrain's memory ratio | loss |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["results"]:
        ours = r["impls"]["fasttrain"]
        for impl, x in r["impls"].items():
            if "time_s" not in x:
                lines.append(f"| {r['case']} | {r['tokens']} | {impl} | skipped: {x['skipped']} |")
                continue
            pct = "n/a" if x["percent_of_limit"] is None else f"{x['percent_of_limit']:.2g}%"
            vs = ("", "") if impl == "fasttrain" or "time_s" not in ours else (
                f"{x['time_s'] / ours['time_s']:.2f}x", f"{x['peak_mib'] / ours['peak_mib']:.1f}x")  # fmt: skip
            lines.append(f"| {r['case']} | {r['tokens']} | {impl} | {x['time_s']:.3f} s | {x['peak_mib']:,.0f} MiB "
                         f"| {pct} | {vs[0]} | {vs[1]} | {x['loss']:.6f} |")  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
