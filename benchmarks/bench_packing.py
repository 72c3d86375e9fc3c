"""Packing's share, side by side: the reference Trainer (padded) vs fasttrain packed vs fasttrain padded (packing off).

A tiny Qwen3-shaped model, log-normal example lengths (instruction-data-like), no length grouping on any side,
the LM collator (labels = input_ids, pad ignored). Same steps, same data, same seed; runs alternate, medians of
``--repeats``. Tokens/s counts real (non-pad) tokens. Writes packing.{json,md} (``--interleaved``:
packing_interleaved.json) under ``--out`` (default benchmarks/results).

    python benchmarks/bench_packing.py --repeats 2
    python benchmarks/bench_packing.py --repeats 1 --steps 2 --batch 2 --longest 64 --out /tmp   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import transformers

import _common
import fasttrain


def _model(vocab: int, hidden: int, layers: int):
    config = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=2048,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _dataset(n: int, vocab: int, median: int, longest: int, seed: int = 0):
    import datasets

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 0.8, n).astype(int), 16, longest)
    rows = [rng.integers(3, vocab, k).tolist() for k in lengths]
    return datasets.Dataset.from_dict({"input_ids": rows}), lengths


def _training_args(out: str, args) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=3e-3,
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def _run(kind: str, args, dataset, out: str):
    model = _model(args.vocab, args.hidden, args.layers)
    collator = transformers.DataCollatorForLanguageModeling(_common.word_level_tokenizer(), mlm=False)
    targs = _training_args(out, args)
    if kind == "reference":
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=dataset, data_collator=collator)
    else:
        paths = fasttrain.HotPaths(packing=kind == "fasttrain-packed")
        trainer = fasttrain.Trainer(
            model=model, args=targs, train_dataset=dataset, data_collator=collator, hot_paths=paths
        )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    status = getattr(trainer, "fasttrain_status", {})
    return seconds, [h["loss"] for h in trainer.state.log_history if "loss" in h], status.get("packing")


def _interleaved(args, dataset) -> dict:
    """One model, the same batches: forward + backward of each batch padded, then packed, alternating, ``--rounds``
    times; per-batch medians (less exposed to a loaded machine than whole runs minutes apart)."""
    from fasttrain.data import packing
    from fasttrain.integration import packing_policy

    model = _model(args.vocab, args.hidden, args.layers).train()
    collator = transformers.DataCollatorForLanguageModeling(_common.word_level_tokenizer(), mlm=False)
    cost = packing_policy.PackingCost(model.config, "sdpa")
    rows = [dataset[i] for i in range(len(dataset))]
    batches = [rows[i : i + args.batch] for i in range(0, len(rows), args.batch)]
    padded_s, packed_s, gate = [[] for _ in batches], [[] for _ in batches], []
    for b in batches:
        padded = collator([dict(r) for r in b])
        mask = padded["attention_mask"]
        gate.append(cost.worth_it(mask.shape[0], mask.shape[1], mask.sum(1).numpy()))
    for _ in range(args.rounds):
        for i, b in enumerate(batches):
            for kind, out in (("padded", padded_s), ("packed", packed_s)):
                batch = collator([dict(r) for r in b])
                if kind == "packed":
                    batch, _ = packing.pack(batch, flash=False)
                start = time.perf_counter()
                model(**batch).loss.backward()
                out[i].append(time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
    per_batch = [
        {"padded_s": statistics.median(a), "packed_s": statistics.median(b), "gate_packs": g}
        for a, b, g in zip(padded_s, packed_s, gate, strict=True)
    ]
    return {
        "per_batch": per_batch,
        "all_packed_speedup": sum(x["padded_s"] for x in per_batch) / sum(x["packed_s"] for x in per_batch),
        "gated_speedup": sum(x["padded_s"] for x in per_batch)
        / sum(x["packed_s"] if x["gate_packs"] else x["padded_s"] for x in per_batch),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--median", type=int, default=180)
    p.add_argument("--longest", type=int, default=1024)
    p.add_argument("--interleaved", action="store_true", help="per-batch forward+backward, padded vs packed")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()
    n = args.steps * args.batch
    dataset, lengths = _dataset(n, args.vocab, args.median, args.longest)
    if args.interleaved:
        result = _interleaved(args, dataset)
        result.update(
            date=_common.utc_now(),
            command=_common.command(),
            hardware=f"{_common.cpu_model()}, {os.cpu_count()} CPUs (shared), no GPU",
            versions=_common.versions("torch", "transformers"),
            settings={**vars(args), "out": str(args.out)},
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "packing_interleaved.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return
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
    diff = {
        k: max(abs(a - b) for a, b in zip(losses[k], losses["reference"], strict=True)) for k in kinds[1:]
    }
    result = {
        "date": _common.utc_now(),
        "command": _common.command(),
        "hardware": f"{_common.cpu_model()}, {os.cpu_count()} CPUs (shared), no GPU",
        "versions": _common.versions("torch", "transformers", "fasttrain"),
        "settings": {**vars(args), "out": str(args.out)},
        "real_tokens": tokens,
        "padded_tokens": int(
            sum(
                max(lengths[i : i + args.batch]) * len(lengths[i : i + args.batch])
                for i in range(0, n, args.batch)
            )
        ),
        "seconds": times,
        "median_seconds": median,
        "tokens_per_second": {k: tokens / v for k, v in median.items()},
        "speedup_vs_reference": {k: median["reference"] / v for k, v in median.items()},
        "packed_vs_fasttrain_padded": median["fasttrain-padded"] / median["fasttrain-packed"],
        "max_step_loss_diff_vs_reference": diff,
        "packing_status": packing,
        "losses": losses,
    }
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "packing.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# packing: reference padded vs fasttrain packed vs fasttrain padded",
        "",
        f"{result['date']}; {result['hardware']}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}",
        "",
        f"`{result['command']}`",
        "",
        f"Qwen3-shaped, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, sdpa; {n} examples, "
        f"log-normal lengths (median {args.median}, 16..{args.longest}), batch {args.batch}, {args.steps} steps, "
        f"no length grouping; {tokens} real tokens ({result['padded_tokens']} padded)",
        "",
        "| run | median s | real tokens/s | vs reference | max per-step loss diff vs reference |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k in kinds:
        lines.append(
            f"| {k} | {median[k]:.1f} | {tokens / median[k]:.0f} | {median['reference'] / median[k]:.2f}x "
            f"| {diff.get(k, 0.0):.2e} |"
        )
    lines += [
        "",
        f"packed vs fasttrain padded: {result['packed_vs_fasttrain_padded']:.2f}x; packing status: {packing}",
        "",
    ]
    (out / "packing.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
