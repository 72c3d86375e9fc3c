"""CPU benchmark: what the chunked head's speculation saves against the exact recompute, side by side.

The speculation (``fasttrain.loss.chunked_head``): when the caller knows the upstream gradient of every scored
token (a mean's ``1/n``, SFT's ``-1/n``), the forward computes the gradients for it and the backward does not
recompute the logits (3 matmuls instead of 4; 2 instead of 3 for a frozen head). Each case runs both ways on the
same inputs, alternating, loss + backward timed:

- ``ce``: ``fused_linear_cross_entropy`` mean (speculating) vs ``reduction="none"`` then ``sum() / n`` (the
  same loss; the backward recomputes);
- ``trl_sft``: ``fused_token_log_probs`` with SFT's outputs and loss ``-sum(log_probs) / n``, ``uniform_grad=True``
  vs ``False``;
- ``frozen_head``: the same with the head frozen (LoRA: only the hidden states need a gradient).

Each in fp32 and under bf16 autocast. Reported: the median time of each way and their ratio (exact recompute
over speculation; > 1: the speculation wins), and whether the two gradients are bitwise equal.

    python benchmarks/bench_loss_speculation.py          # writes benchmarks/results/loss_speculation_cpu.{json,md}
    python benchmarks/bench_loss_speculation.py --tokens 256 --reps 2   # quick look
    python benchmarks/bench_loss_speculation.py --device cuda --tokens 8192 --hidden 2048 --vocab 151936 \
        --reps 6 --out DIR   # benchmarks/gpu/run.sh's speculation step (Triton kernels): DIR/loss_speculation_cuda.*
"""

from __future__ import annotations

import contextlib
import statistics
from functools import partial

import torch

import _common
from fasttrain.bench import provenance
from fasttrain.loss import fused_linear_cross_entropy, fused_token_log_probs


def _step(case: str, speculate: bool, h, w, labels, autocast) -> None:
    n = int((labels != -100).sum())
    with autocast:
        if case != "ce":  # trl_sft and frozen_head: SFT's outputs and loss
            outputs = ("log_probs", "entropy", "is_top1")
            out = fused_token_log_probs(h, w, labels, outputs=outputs, uniform_grad=speculate)
            loss = -out.log_probs.sum() / n
        elif speculate:
            loss = fused_linear_cross_entropy(h, w, labels)
        else:  # the same loss, its backward recomputing the logits
            loss = fused_linear_cross_entropy(h, w, labels, reduction="none").sum() / n
        loss.backward()


def _measure(case: str, dtype: str, args) -> dict:
    torch.manual_seed(0)
    h, w, labels = _common.lm_head_inputs(args.tokens, args.hidden, args.vocab, args.device)
    w.requires_grad_(case != "frozen_head")  # frozen: LoRA's head, only the hidden states need a gradient
    labels[::5] = -100
    bf16 = torch.autocast(args.device, dtype=torch.bfloat16)
    autocast = bf16 if dtype == "bf16" else contextlib.nullcontext()
    times: dict[bool, list[float]] = {True: [], False: []}
    grads: dict[bool, torch.Tensor] = {}
    for rep in range(args.reps + 1):  # the first round warms up
        for speculate in (True, False) if rep % 2 else (False, True):
            h.grad = w.grad = None  # freed outside the timed call
            seconds = provenance.timed(partial(_step, case, speculate, h, w, labels, autocast), args.device)
            if rep:
                times[speculate].append(seconds)
            grads[speculate] = h.grad.clone()
    spec, exact = (statistics.median(times[s]) for s in (True, False))
    return {"case": case, "dtype": dtype, "speculation_s": spec, "recompute_s": exact,
            "recompute_over_speculation": exact / spec,
            "hidden_grad_bitwise_equal": bool(torch.equal(grads[True], grads[False]))}  # fmt: skip


def main() -> None:
    parser = _common.parser(__doc__, device=True)
    sizes = _common.int_options(parser, tokens=1024, hidden=256, vocab=32_000, reps=5)
    args = parser.parse_args()
    rows = [
        _measure(case, dtype, args) for case in ("ce", "trl_sft", "frozen_head") for dtype in ("fp32", "bf16")
    ]
    result = _common.new_result(f"loss_speculation_{args.device}")
    result["settings"] = {**{k: getattr(args, k) for k in sizes}, "ignored": "1 label in 5"}
    result["rows"] = rows
    body = [
        f"- settings: {result['settings']}",
        "",
        "| case | dtype | speculation (s) | recompute (s) | recompute / speculation | hidden grad bitwise equal |",
        "| --- | --- | --- | --- | --- | --- |",
        *(f"| {r['case']} | {r['dtype']} | {r['speculation_s']:.3f} | {r['recompute_s']:.3f} | "
          f"{r['recompute_over_speculation']:.2f}x | {r['hidden_grad_bitwise_equal']} |" for r in rows),
    ]  # fmt: skip
    title = f"Chunked-head speculation vs exact recompute ({args.device})"
    _common.write(args.out, f"loss_speculation_{args.device}", result, title, body)


if __name__ == "__main__":
    main()
