"""GPU benchmark: fused-linear cross-entropy forward + backward, bf16, side by side.

Default mode: cross-entropy. Implementations (each skipped with a recorded reason when it is not installed
or fails):

- ``torch``: ``logits = hidden @ weight.T`` then ``ForCausalLMLoss``'s path (``.float()`` + cross-entropy);
- ``torch_compile``: the same function under ``torch.compile``;
- ``liger``: ``liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss`` (liger-kernel wheel);
- ``cce``: ``cut_cross_entropy.linear_cross_entropy`` (cut-cross-entropy, if it installs);
- ``fasttrain``: ``fasttrain.fused_linear_cross_entropy`` (Triton kernel).

``--trl``: TRL's fused LM-head contract (``model(..., fused_lm_head=True)``), cases ``sft`` (log-probs, entropy,
top-1; loss ``-sum(log_probs) / n``) and ``dpo`` (plus mean logits; sigmoid DPO loss over 8 sequences, a
per-sequence upstream gradient). Only the scored tokens go through the head, as in TRL. Implementations:

- ``plain``: materialised logits, ``log_softmax`` (+ entropy and top-1 without gradient);
- ``trl``: TRL's ``ChunkedLogProbFunction`` (its Triton kernel on CUDA);
- ``liger``: Liger's fused-linear cross-entropy, ``sft`` only (the loss alone: no entropy or top-1);
- ``fasttrain``: ``fused_token_log_probs`` as ``fasttrain.loss.trl_support`` calls it.

Before timing, ``--trl`` checks TRL's and fasttrain's bf16 results against the plain fp32 computation on the
first shape (per-token outputs and gradients, relative norms, recorded as ``check``). Which kernel serves TRL's head on CUDA (``trl_support.KERNEL_CHOICE``)
is decided by these timings: where ``trl`` is faster than ``fasttrain`` in both cases, set it to ``"trl"``.

For each shape (tokens x hidden x vocab): one untimed step per implementation for its peak memory
(``torch.cuda.max_memory_allocated`` above what the inputs already hold) and its loss, then ``--reps``
rounds in which every implementation runs one timed step in turn (CUDA events; medians). Beside each time,
the % of the roofline reached (``roofline.py``: 6 N H V FLOPs forward + backward, N the scored tokens (the
only ones that need the head), over the matmul throughput measured at the start of the run; or the bytes the step must
move over the copy bandwidth, whichever takes longer). Sized to
finish in under 4 minutes on one H200; a time budget skips what is left if it would not.

    python benchmarks/gpu/bench_loss_gpu.py --out benchmarks/results/
    python benchmarks/gpu/bench_loss_gpu.py --trl --out benchmarks/results/      # writes loss_trl_gpu.*
    TRITON_INTERPRET=1 python benchmarks/gpu/bench_loss_gpu.py --smoke --out /tmp/x   # CPU, tiny
    TRITON_INTERPRET=1 python benchmarks/gpu/bench_loss_gpu.py --trl --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

if "--smoke" in sys.argv and os.environ.get("TRITON_INTERPRET") is None:
    try:  # the kernel runs on CPU through the interpreter; must be set before triton is imported
        import torch as _torch

        if not _torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover
        pass

import roofline
import torch
from timing import Timer

IMPLS = ("torch", "torch_compile", "liger", "cce", "fasttrain")
TRL_IMPLS = ("plain", "trl", "liger", "fasttrain")
TRL_OUTPUTS = {
    "sft": ("log_probs", "entropy", "is_top1"),
    "dpo": ("log_probs", "entropy", "mean_logits", "is_top1"),
}


def _reference(hidden, weight, labels):
    from transformers.loss.loss_utils import fixed_cross_entropy

    logits = hidden @ weight.t()
    return fixed_cross_entropy(logits.float(), labels)


def build(impl: str, backend: str):
    """A callable (hidden, weight, labels) -> loss, or raises ImportError."""
    if impl == "torch":
        return _reference
    if impl == "torch_compile":
        return torch.compile(_reference, dynamic=True)
    if impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        module = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, y: module(w, h, y)
    if impl == "cce":
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, w, y: linear_cross_entropy(h, w, y)
    if impl == "fasttrain":
        from fasttrain import fused_linear_cross_entropy

        return lambda h, w, y: fused_linear_cross_entropy(h, w, y, backend=backend)
    raise ValueError(impl)


def _per_token(impl: str, case: str, backend: str, hidden, weight, labels):
    """(log_probs, entropy) of the scored tokens, by ``impl``."""
    import torch.nn.functional as F

    outputs = TRL_OUTPUTS[case]
    if impl == "plain":
        log_p = F.log_softmax((hidden @ weight.t()).float(), dim=-1)
        with torch.no_grad():
            entropy = -(log_p.exp() * log_p).sum(-1)
            _ = log_p.argmax(-1) == labels
        return log_p.gather(1, labels[:, None]).squeeze(1), entropy
    if impl == "trl":
        from trl.kernels import ChunkedLogProbFunction

        out = ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0, 32768, None, 1.0, outputs)
        return out[0], out[1]
    from fasttrain.loss.token_logprobs import fused_token_log_probs

    out = fused_token_log_probs(
        hidden, weight, labels, outputs=outputs, uniform_grad=case == "sft", backend=backend
    )
    return out.log_probs, out.entropy


def _trl_loss(case: str, log_probs, valid):
    if case == "sft":
        return -log_probs.sum() / valid.sum()
    per_token = log_probs.new_zeros(valid.shape).masked_scatter(valid, log_probs)
    ratios = per_token.reshape(8, -1).sum(1)  # the reference log-probs are a constant: left out
    chosen, rejected = ratios.chunk(2)
    return -torch.nn.functional.logsigmoid(0.1 * (chosen - rejected)).mean()


def build_trl(impl: str, case: str, backend: str):
    """A callable (hidden, weight, labels) -> loss through TRL's head contract, or raises ImportError."""
    if impl == "liger":
        if case != "sft":
            raise NotImplementedError("Liger has no per-token log-prob head for the DPO case")
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        module = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, y: module(w, h, y)
    if impl == "trl":
        import trl.kernels  # noqa: F401
    if impl not in ("plain", "trl", "fasttrain"):
        raise ValueError(impl)

    def fn(hidden, weight, labels):
        valid = labels != -100
        log_probs, _ = _per_token(impl, case, backend, hidden[valid], weight, labels[valid])
        return _trl_loss(case, log_probs, valid)

    return fn


def check_trl(case: str, backend: str, hidden, weight, labels) -> dict:
    """TRL's and fasttrain's bf16 results against the plain fp32 computation on the same (rounded) inputs:
    relative norm of the difference for the log-probs, the entropy and both gradients."""
    valid = labels != -100
    got = {}
    for impl, dtype in (("plain", torch.float32), ("trl", hidden.dtype), ("fasttrain", hidden.dtype)):
        h = hidden.detach().to(dtype).requires_grad_()
        w = weight.detach().to(dtype).requires_grad_()
        log_probs, entropy = _per_token(impl, case, backend, h[valid], w, labels[valid])
        _trl_loss(case, log_probs, valid).backward()
        got[impl] = {"log_probs": log_probs, "entropy": entropy, "grad_hidden": h.grad, "grad_weight": w.grad}
        del h, w
    ref = got.pop("plain")
    return {
        impl: {
            name: float(
                (x.detach().float() - ref[name].detach().float()).norm() / ref[name].detach().float().norm()
            )
            for name, x in outs.items()
        }
        for impl, outs in got.items()
    }


def run_shape(tokens, hidden_size, vocab, impls, fns, device, reps, deadline, check=None, roof=None):
    """``roof``: (cost of one step, hardware limits) for the % of the roofline beside each time."""
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g).to(device, torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) * hidden_size**-0.5).to(device, torch.bfloat16)
    weight.requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    labels[::7] = -100
    timer = Timer(device)
    out = {}
    if check is not None:  # correctness before speed
        try:
            out["check"] = check(hidden, weight, labels)
        except Exception as exc:
            out["check"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}

    def step(fn):
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, labels)
        loss.backward()
        return loss

    for impl in impls:
        if isinstance(fns[impl], str):
            out[impl] = {"skipped": fns[impl]}
            continue
        if time.monotonic() > deadline:
            out[impl] = {"skipped": "time budget"}
            continue
        try:
            step(fns[impl])  # warm-up (compilation, autotuning)
            hidden.grad = weight.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            loss = step(fns[impl])
            peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
            out[impl] = {
                "loss": float(loss.detach()),
                "peak_gib": None if peak is None else peak / 2**30,
                "times": [],
            }
        except Exception as exc:  # OOM or a library that does not run here: record and go on
            out[impl] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            hidden.grad = weight.grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    live = [i for i in impls if "times" in out.get(i, {})]
    for _ in range(reps):  # alternate implementations within each round
        if time.monotonic() > deadline:
            break
        for impl in live:
            out[impl]["times"].append(timer(lambda impl=impl: step(fns[impl])))
    for impl in live:
        times = out[impl].pop("times")
        out[impl]["time_ms"] = statistics.median(times) * 1e3 if times else None
        out[impl]["reps"] = len(times)
        if roof is not None:
            seconds = None if out[impl]["time_ms"] is None else out[impl]["time_ms"] / 1e3
            out[impl]["roofline"] = roofline.roofline_entry(seconds, *roof)
    hidden.grad = weight.grad = None  # the inputs go with this frame
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("triton", "transformers", "trl", "liger-kernel", "cut-cross-entropy", "fasttrain"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU (Triton interpreter)")
    parser.add_argument("--tokens", default="8192,16384,32768")
    parser.add_argument("--vocabs", default="128256,151936")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop starting new work after this")
    parser.add_argument("--name", default=None, help="results file name (default loss_gpu / loss_trl_gpu)")
    parser.add_argument("--trl", action="store_true", help="TRL's fused LM-head contract (sft and dpo cases)")
    args = parser.parse_args()
    if args.trl and "--tokens" not in sys.argv:
        args.tokens, args.vocabs = "8192,32768", "151936"
    if args.trl and "--impls" not in sys.argv:
        args.impls = ",".join(TRL_IMPLS)
    args.name = args.name or ("loss_trl_gpu" if args.trl else "loss_gpu")
    if args.smoke:
        # the vocabulary over 65,536 (another grid layout) in the loss step only: the TRL cases run the same
        # kernels, and in the interpreter that vocabulary is most of the step's time
        args.tokens, args.vocabs, args.hidden, args.reps = "64", "1000" if args.trl else "1000,70001", 32, 2
        args.budget_s = float("inf")  # a CPU check of the code path, not a timing
        args.name = args.name + "_smoke"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("no CUDA device: run with --smoke for a CPU check")
    backend = "triton" if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    cases = ("sft", "dpo") if args.trl else ("cross_entropy",)
    limits = roofline.load(args.out, device.type, args.smoke)
    deadline = time.monotonic() + args.budget_s
    shapes = [(int(t), int(v)) for v in args.vocabs.split(",") for t in args.tokens.split(",")]
    results = []
    for case in cases:
        fns = {}
        for impl in impls:
            try:
                fns[impl] = build_trl(impl, case, backend) if args.trl else build(impl, backend)
            except ImportError as exc:
                fns[impl] = f"not installed: {exc}"
            except NotImplementedError as exc:
                fns[impl] = f"n/a: {exc}"
        for n, (tokens, vocab) in enumerate(shapes):
            print(
                f"[bench_loss_gpu] {case} tokens={tokens} hidden={args.hidden} vocab={vocab}",
                file=sys.stderr,
                flush=True,
            )
            check = None
            if args.trl and n == 0 and not isinstance(fns.get("trl"), str):
                check = lambda h, w, y, case=case: check_trl(case, backend, h, w, y)  # noqa: E731
            # run_shape ignores every 7th label: only the scored tokens need the head (TRL's path gathers them)
            head_tokens = tokens - len(range(0, tokens, 7))
            roof = (roofline.linear_loss_cost(head_tokens, args.hidden, vocab), limits)
            try:
                res = run_shape(
                    tokens, args.hidden, vocab, impls, fns, device, args.reps, deadline, check, roof
                )
            except Exception:
                res = {"error": traceback.format_exc()[-500:]}
            results.append(
                {"case": case, "tokens": tokens, "hidden": args.hidden, "vocab": vocab, "impls": res}
            )
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)

    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.processor()})",
        "versions": versions(),
        "settings": {
            "reps": args.reps,
            "dtype": "bfloat16",
            "fasttrain_backend": backend,
            "smoke": args.smoke,
            "trl": args.trl,
        },
        "roofline_limits": limits.to_json(),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(record, impls))
    print(markdown(record, impls))


def _roofline_note(record: dict) -> list[str]:
    limits = record.get("roofline_limits")
    if not limits:
        return []
    return [
        "- '% lim': the least time the hardware allows over the measured time (6 N H V FLOPs at "
        f"{limits['matmul_flops_per_s'] / 1e12:,.3g} TFLOP/s, or the bytes the step must move at "
        f"{limits['copy_bytes_per_s'] / 1e9:,.0f} GB/s, whichever is longer); {limits['source']}"
    ]


def markdown(record: dict, impls: list[str]) -> str:
    title = "TRL's fused LM head" if record["settings"].get("trl") else "Fused-linear cross-entropy"
    lines = [
        f"# {title} on GPU (bf16, forward + backward)",
        "",
        f"- date: {record['date']}",
        f"- device: {record['device']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in record["versions"].items()),
        f"- command: `{record['command']}`",
        "- method: per shape, one untimed step per implementation for peak memory (max_memory_allocated above "
        f"the inputs), then {record['settings']['reps']} alternating rounds of timed steps; medians.",
        *_roofline_note(record),
        "",
        "| case | tokens | vocab | " + " | ".join(impls) + " |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in impls) + " |",
    ]
    checks = []
    for r in record["results"]:
        cells = []
        for impl in impls:
            x = r["impls"].get(impl, {}) if isinstance(r["impls"], dict) else {}
            if "time_ms" in x:
                mem = "" if x["peak_gib"] is None else f", {x['peak_gib']:.2f} GiB"
                t = "n/a" if x["time_ms"] is None else f"{x['time_ms']:.1f} ms"
                if "roofline" in x:
                    t += f" ({roofline.fmt_percent(x['roofline']['percent_of_limit'])} lim)"
                cells.append(t + mem)
            else:
                cells.append(x.get("skipped") or (x.get("error", "error")[:40]))
        lines.append(f"| {r.get('case', '')} | {r['tokens']} | {r['vocab']} | " + " | ".join(cells) + " |")
        if isinstance(r["impls"], dict) and "check" in r["impls"]:
            checks.append(f"- {r['case']}: " + json.dumps(r["impls"]["check"]))
    lines.append("")
    if checks:
        lines += [
            "Error against the plain fp32 computation (relative norm, first shape of each case):",
            *checks,
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
