"""CPU benchmark: chunked fused-linear cross-entropy vs materialised logits, side by side.

Two cases, each measured in a fresh subprocess per run (so one run's memory cannot hide another's),
reference and fasttrain alternating, medians over rounds:

- ``loss``: loss + backward at 4,096 tokens x hidden 512 x vocab 151,936 (fp32). Reference:
  ``logits = hidden @ weight.T`` then transformers' ``ForCausalLMLoss`` path (``.float()`` +
  ``F.cross_entropy``); ours: ``fasttrain.fused_linear_cross_entropy`` (backend auto = PyTorch on CPU).
- ``model``: forward + backward of a Qwen3-shaped model (hidden 256, 2 layers, vocab 151,936) on
  4 x 1,024 tokens with labels. Reference: the unpatched transformers model; ours: the same model
  after ``fasttrain.loss.model_patch.enable_fused_loss``.

- ``head``: the LM head of the Qwen3-0.6B shape, loss + backward at ``--tokens`` x hidden 1,024 x vocab 151,936
  (fp32), three ways: ``gemms`` (its three GEMMs alone: logits, the hidden states' gradient, the weight's gradient,
  each into a fresh output as in a step: the floor any head implementation stands on), ``reference``
  (materialised logits and transformers' loss) and ``fasttrain``.

- ``trl_sft`` / ``trl_dpo``: TRL's fused LM-head contract (``model(..., fused_lm_head=True)``), loss +
  backward at 2,048 tokens x hidden 512 x vocab 151,936 (fp32), three ways: ``plain`` (materialised logits,
  ``log_softmax``), ``trl`` (TRL's ``ChunkedLogProbFunction``, its chunked torch path on CPU) and
  ``fasttrain`` (``fused_token_log_probs``, as ``trl_support`` calls it). ``trl_sft``: the outputs SFTTrainer
  asks for (log-probs, entropy, top-1) and its loss ``-sum(log_probs) / n``; ``trl_dpo``: DPOTrainer's
  (plus mean logits) and the sigmoid DPO loss over 8 sequences (a per-sequence upstream gradient).

Memory: peak RSS of the child (``ru_maxrss``) minus its RSS after imports, i.e. inputs, parameters and
everything the step allocates. Time: median wall time of the timed steps inside a child (after one
warm-up step), then the median over rounds.

    python benchmarks/bench_loss.py                 # writes benchmarks/results/loss_cpu.{json,md}
    python benchmarks/bench_loss.py --rounds 1 --tokens 256   # quick look
    python benchmarks/bench_loss.py --cases trl_sft,trl_dpo --tokens 2048 --name loss_trl_cpu
    python benchmarks/bench_loss.py --cases head --tokens 460 --name head_gemms_cpu
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
from pathlib import Path

import _common

HERE = Path(__file__).resolve().parent
VOCAB = 151_936
# implementations per case, the first being the reference the speed-ups are taken against
IMPLS = {
    "loss": ("reference", "fasttrain"),
    "model": ("reference", "fasttrain"),
    "head": ("gemms", "reference", "fasttrain"),
    "trl_sft": ("plain", "trl", "fasttrain"),
    "trl_dpo": ("plain", "trl", "fasttrain"),
}
TRL_OUTPUTS = {
    "trl_sft": ("log_probs", "entropy", "is_top1"),
    "trl_dpo": ("log_probs", "entropy", "mean_logits", "is_top1"),
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(case: str, impl: str, steps: int, tokens: int) -> None:
    import torch

    torch.manual_seed(0)
    baseline = _rss_bytes()
    if case == "loss":
        step = _loss_step(impl, tokens)
    elif case == "head":
        step = _head_step(impl, tokens)
    elif case == "model":
        step = _model_step(impl, tokens)
    else:
        step = _trl_step(case, impl, tokens)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        loss = step()
        if i:  # the first step warms up
            times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB
    print(json.dumps({"time_s": statistics.median(times), "peak_bytes": peak - baseline, "loss": loss}))


def _loss_step(impl: str, tokens: int):
    import torch
    from transformers.loss.loss_utils import fixed_cross_entropy

    from fasttrain import fused_linear_cross_entropy

    hidden = torch.randn(tokens, 512, requires_grad=True)
    weight = torch.randn(VOCAB, 512).mul_(0.02).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,))
    labels[::5] = -100

    def step() -> float:
        hidden.grad = weight.grad = None
        if impl == "reference":
            logits = hidden @ weight.t()
            loss = fixed_cross_entropy(logits.float(), labels)  # what ForCausalLMLoss runs after its shift
        else:
            loss = fused_linear_cross_entropy(hidden, weight, labels)
        loss.backward()
        return float(loss)

    return step


def _head_step(impl: str, tokens: int, width: int = 1024):
    import torch
    from transformers.loss.loss_utils import fixed_cross_entropy

    from fasttrain import fused_linear_cross_entropy

    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(VOCAB, width).mul_(0.02).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,))
    upstream = torch.randn(tokens, VOCAB).mul_(1e-6) if impl == "gemms" else None

    def step() -> float:
        hidden.grad = weight.grad = None
        if impl == "gemms":
            with torch.no_grad():
                logits = hidden @ weight.t()
                grad_hidden = upstream @ weight
                grad_weight = upstream.t() @ hidden
            return float(logits[0, 0] + grad_hidden[0, 0] + grad_weight[0, 0])
        if impl == "reference":
            loss = fixed_cross_entropy((hidden @ weight.t()).float(), labels)
        else:
            loss = fused_linear_cross_entropy(hidden, weight, labels)
        loss.backward()
        return float(loss)

    return step


def _model_step(impl: str, tokens: int):
    import torch
    import transformers

    from fasttrain.loss.model_patch import enable_fused_loss

    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
    )
    model = transformers.Qwen3ForCausalLM(config).train()
    if impl == "fasttrain":
        assert enable_fused_loss(model) is None
    seq = tokens // 4
    input_ids = torch.randint(0, VOCAB, (4, seq))
    labels = input_ids.clone()
    labels[:, : seq // 4] = -100

    def step() -> float:
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids, labels=labels)
        out.loss.backward()
        return float(out.loss)

    return step


def _trl_step(case: str, impl: str, tokens: int):
    import torch
    import torch.nn.functional as F

    from fasttrain.loss.token_logprobs import fused_token_log_probs

    outputs = TRL_OUTPUTS[case]
    hidden = torch.randn(tokens, 512, requires_grad=True)
    weight = torch.randn(VOCAB, 512).mul_(0.02).requires_grad_()
    labels = torch.randint(0, VOCAB, (tokens,))  # the scored tokens only (the fused head compacts them)
    ref_logps = torch.randn(8) * 10 - 100 * tokens / 8

    def per_token():
        if impl == "plain":
            log_p = F.log_softmax(hidden @ weight.t(), dim=-1)
            with torch.no_grad():  # the metrics TRL logs
                entropy = -(log_p.exp() * log_p).sum(-1)
                is_top1 = log_p.argmax(-1) == labels
            return log_p.gather(1, labels[:, None]).squeeze(1), entropy, is_top1
        if impl == "trl":
            from trl.kernels import ChunkedLogProbFunction

            out = ChunkedLogProbFunction.apply(hidden, weight, None, labels, 1.0, 32768, None, 1.0, outputs)
            return out[0], out[1], out[4]
        out = fused_token_log_probs(hidden, weight, labels, outputs=outputs, uniform_grad=case == "trl_sft")
        return out.log_probs, out.entropy, out.is_top1

    def step() -> float:
        hidden.grad = weight.grad = None
        log_probs, entropy, _ = per_token()
        if case == "trl_sft":
            loss = -log_probs.sum() / tokens
        else:  # sigmoid DPO over 8 sequences: 4 chosen, 4 rejected
            ratios = log_probs.reshape(8, -1).sum(1) - ref_logps
            chosen, rejected = ratios.chunk(2)
            loss = -F.logsigmoid(0.1 * (chosen - rejected)).mean()
        loss.backward()
        return float(loss) + 0.0 * float(entropy.sum())

    return step


def _run_child(case: str, impl: str, steps: int, tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--child", case, impl, "--steps", str(steps), "--tokens", str(tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{case}/{impl} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _machine() -> dict:
    import torch

    return {"cpu": _common.cpu_model(), "cores": os.cpu_count(), "threads_used": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", nargs=2, metavar=("CASE", "IMPL"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--cases", default="loss,model", help="comma-separated: loss, model, head, trl_sft, trl_dpo"
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating reference/fasttrain rounds")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per child (after one warm-up)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--name", default="loss_cpu")
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], args.steps, args.tokens)
        return

    results = {}
    for case in args.cases.split(","):
        impls = IMPLS[case]
        runs: dict[str, list[dict]] = {impl: [] for impl in impls}
        for r in range(args.rounds):
            order = impls if r % 2 == 0 else impls[::-1]
            for impl in order:
                res = _run_child(case, impl, args.steps, args.tokens)
                runs[impl].append(res)
                print(f"[{case}] round {r} {impl}: {res}", file=sys.stderr)
        summary = {}
        for impl, rs in runs.items():
            summary[impl] = {
                "time_s": statistics.median(x["time_s"] for x in rs),
                "peak_mib": statistics.median(x["peak_bytes"] for x in rs) / 2**20,
                "loss": rs[0]["loss"],
                "runs": rs,
            }
        ours = summary["fasttrain"]
        for impl in impls[:-1]:  # fasttrain against each other implementation
            suffix = "" if len(impls) == 2 else f"_vs_{impl}"
            summary[f"memory_ratio{suffix}"] = summary[impl]["peak_mib"] / ours["peak_mib"]
            summary[f"speedup{suffix}"] = summary[impl]["time_s"] / ours["time_s"]
        results[case] = summary

    record = {
        "date": _common.utc_now(),
        "command": _common.command(),
        "machine": _machine(),
        "versions": _common.versions("torch", "transformers", "fasttrain", "trl"),
        "settings": {"rounds": args.rounds, "steps": args.steps, "tokens": args.tokens, "vocab": VOCAB},
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / f"{args.name}.md").write_text(_markdown(record))
    print(_markdown(record))


CASE_TITLES = {
    "loss": "loss + backward, {tokens} tokens x hidden 512 x vocab 151,936 (fp32)",
    "model": "Qwen3-shaped model (hidden 256, 2 layers, vocab 151,936), 4 x {seq} tokens, forward + backward (fp32)",
    "head": "LM head of the Qwen3-0.6B shape, loss + backward, {tokens} tokens x 1,024 x 151,936 (fp32)",
    "trl_sft": "TRL SFT head (log-probs, entropy, top-1; -sum/n), {tokens} tokens x 512 x 151,936 (fp32)",
    "trl_dpo": "TRL DPO head (+ mean logits; sigmoid loss, 8 sequences), {tokens} tokens x 512 x 151,936 (fp32)",
}


def _markdown(record: dict) -> str:
    s = record["settings"]
    cases = record["results"]
    lines = [
        "# Fused-linear cross-entropy and TRL's fused LM head on CPU",
        "",
        f"- date: {record['date']}",
        f"- machine: {record['machine']['cpu']}, {record['machine']['cores']} cores "
        f"({record['machine']['threads_used']} torch threads)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in record["versions"].items()),
        f"- command: `{record['command']}`",
        f"- method: each run in its own process, implementations alternating (order reversed every other round), "
        f"{s['rounds']} rounds x {s['steps']} timed steps (after a warm-up); medians. Peak = child's peak RSS "
        "minus its RSS after imports.",
        "",
    ]
    pairs = {c: r for c, r in cases.items() if len(IMPLS[c]) == 2}
    if pairs:
        lines += [
            "| case | reference peak | fasttrain peak | memory ratio | reference time | fasttrain time | speed-up |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for case, r in pairs.items():
            title = CASE_TITLES.get(case, case).format(tokens=s["tokens"], seq=s["tokens"] // 4)
            lines.append(
                f"| {title} | {r['reference']['peak_mib']:,.0f} MiB | {r['fasttrain']['peak_mib']:,.0f} MiB | "
                f"{r['memory_ratio']:.1f}x | {r['reference']['time_s']:.2f} s | {r['fasttrain']['time_s']:.2f} s | "
                f"{r['speedup']:.2f}x |"
            )
        lines.append("")
    if "head" in cases:
        r = cases["head"]
        lines += [
            "| case | its three GEMMs alone | reference (materialised logits) | fasttrain | fasttrain / GEMMs |",
            "| --- | ---: | ---: | ---: | ---: |",
            f"| {CASE_TITLES['head'].format(tokens=s['tokens'])} | "
            + " | ".join(f"{r[i]['time_s']:.2f} s, {r[i]['peak_mib']:,.0f} MiB" for i in IMPLS["head"])
            + f" | {r['fasttrain']['time_s'] / r['gemms']['time_s']:.2f}x |",
            "",
        ]
    triples = {c: r for c, r in cases.items() if len(IMPLS[c]) == 3 and c != "head"}
    if triples:
        lines += [
            "| case | plain logits | TRL chunked | fasttrain | speed-up vs TRL | memory ratio vs TRL "
            "| speed-up vs plain | memory ratio vs plain |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for case, r in triples.items():
            title = CASE_TITLES.get(case, case).format(tokens=s["tokens"], seq=s["tokens"] // 4)
            cells = [f"{r[i]['time_s']:.2f} s, {r[i]['peak_mib']:,.0f} MiB" for i in IMPLS[case]]
            lines.append(
                f"| {title} | {' | '.join(cells)} | {r['speedup_vs_trl']:.2f}x | {r['memory_ratio_vs_trl']:.1f}x "
                f"| {r['speedup_vs_plain']:.2f}x | {r['memory_ratio_vs_plain']:.1f}x |"
            )
        lines.append("")
    lines += [
        "Speed-up = their time / fasttrain's (below 1: fasttrain is slower); memory ratio = their peak / "
        "fasttrain's.",
        "",
        "Losses (first run): "
        + "; ".join(
            f"{c}: " + ", ".join(f"{i} {r[i]['loss']:.6f}" for i in IMPLS[c]) for c, r in cases.items()
        ),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
