"""Packing's share, side by side: the reference Trainer (padded) vs fasttrain packed vs fasttrain padded (packing off).

A tiny Qwen3-shaped model, log-normal example lengths (instruction-data-like), no length grouping on any side,
the LM collator (labels = input_ids, pad ignored). Same steps, same data, same seed; runs alternate, medians of
``--repeats``. Tokens/s counts real (non-pad) tokens. Writes packing.{json,md} under ``--out``.

    python benchmarks/bench_packing.py --repeats 2
    python benchmarks/bench_packing.py --repeats 1 --steps 2 --batch 2 --longest 64 --out /tmp   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import datasets
import numpy as np
import transformers

import _common
import fasttrain


def _dataset(n: int, vocab: int, median: int, longest: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.8, n).astype(int), 16, longest)
    rows = [rng.integers(3, vocab, k).tolist() for k in lengths]
    return datasets.Dataset.from_dict({"input_ids": rows}), lengths


def _run(kind: str, args, dataset, out: str):
    model = _common.tiny_qwen3(args.vocab, args.hidden, args.layers, max_position_embeddings=2048,
                               attn_implementation="sdpa")  # fmt: skip
    collator = transformers.DataCollatorForLanguageModeling(_common.word_level_tokenizer(), mlm=False)
    targs = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps, learning_rate=3e-3,
        warmup_steps=1, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0,
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    if kind == "reference":
        trainer = transformers.Trainer(model, targs, collator, dataset)
    else:
        paths = fasttrain.HotPaths(packing=kind == "fasttrain-packed")
        trainer = fasttrain.Trainer(model, targs, collator, dataset, hot_paths=paths)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    status = getattr(trainer, "fasttrain_status", {})
    return seconds, [h["loss"] for h in trainer.state.log_history if "loss" in h], status.get("packing")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.int_options(
        p, repeats=2, steps=6, batch=8, hidden=128, layers=2, vocab=8000, median=180, longest=1024
    )
    p.add_argument("--out", type=Path, default=_common.RESULTS)
    args = p.parse_args()
    n = args.steps * args.batch
    result = _common.new_result("packing")
    result["settings"] = {**vars(args), "out": str(args.out)}
    dataset, lengths = _dataset(n, args.vocab, args.median, args.longest)
    tokens = int(lengths.sum())  # the random sampler sees every row once in steps * batch rows
    kinds = ("reference", "fasttrain-packed", "fasttrain-padded")
    times = {k: [] for k in kinds}
    losses, packing = {}, {}
    for r in range(args.repeats):
        for kind in kinds:
            seconds, loss, status = _run(kind, args, dataset, f"/tmp/bench_packing/{kind}-{r}")
            times[kind].append(seconds)
            losses[kind], packing[kind] = loss, status
            print(f"{kind} repeat {r}: {seconds:.1f} s, packing={status}", flush=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    diff = {k: max(abs(a - b) for a, b in zip(losses[k], losses["reference"], strict=True)) for k in kinds}
    batches = [lengths[i : i + args.batch] for i in range(0, n, args.batch)]
    result.update(real_tokens=tokens, padded_tokens=int(sum(max(b) * len(b) for b in batches)), seconds=times,
                  median_seconds=median, tokens_per_second={k: tokens / v for k, v in median.items()},
                  speedup_vs_reference={k: median["reference"] / v for k, v in median.items()},
                  packed_vs_fasttrain_padded=median["fasttrain-padded"] / median["fasttrain-packed"],
                  max_step_loss_diff_vs_reference=diff, packing_status=packing, losses=losses)  # fmt: skip
    lines = [
        f"Qwen3-shaped, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, sdpa; {n} examples, "
        f"log-normal lengths (median {args.median}, 16..{args.longest}), batch {args.batch}, {args.steps} steps, "
        f"no length grouping; {tokens} real tokens ({result['padded_tokens']} padded)",
        "",
        "| run | median s | real tokens/s | vs reference | max per-step loss diff vs reference |",
        "| --- | ---: | ---: | ---: | ---: |",
        *[f"| {k} | {median[k]:.1f} | {tokens / median[k]:.0f} | {median['reference'] / median[k]:.2f}x "
          f"| {diff[k]:.2e} |" for k in kinds],
        "",
        f"packed vs fasttrain padded: {result['packed_vs_fasttrain_padded']:.2f}x; packing status: {packing}",
    ]  # fmt: skip
    title = "packing: reference padded vs fasttrain packed vs fasttrain padded"
    print(_common.write(args.out, "packing", result, title, lines))


if __name__ == "__main__":
    main()
