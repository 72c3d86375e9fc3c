"""LLaMA-Factory 0.9.5's SFT collator against the twin fasttrain installs in its place.

Run in LLaMA-Factory's environment (bash .ci/env-llamafactory):

    .ci-envs/llamafactory/bin/python benchmarks/bench_collators_llamafactory.py           # writes results/
    .ci-envs/llamafactory/bin/python benchmarks/bench_collators_llamafactory.py --smoke   # checks the script

The collator is built as LLaMA-Factory's SFT workflow builds it (train/sft/workflow.py: the qwen3 template, the
model, pad_to_multiple_of=8, label_pad_token_id=-100, the tokenizer right-padded) and called on rows as its dataset
hands them over (Python lists, images/videos/audios None). Its twin (``fasttrain.integration.llamafactory.
native_collator``) runs all of LLaMA-Factory's code and pads in Rust: the batches are the same byte for byte
(checked on the first batch here; tests/_llamafactory_collators.py checks every option). Batches of 2 to 64 rows of
lengths uniform in [16, --max-len], the prompt masked; calls alternate; medians. (transformers' own
DataCollatorForSeq2Seq is timed beside them as a reference point.)

Figures are written by this script only; never type them by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import transformers

import _common
from fasttrain.integration.llamafactory import native_collator

MEDIA = ("images", "videos", "audios")
IGNORE_INDEX = -100


def build(neat_packing: bool = False):
    """LLaMA-Factory's three collators with its workflow's arguments, a tokenizer and a tiny Qwen3 (the model
    decides whether position_ids are computed: only models with get_rope_index, Qwen2-VL's kind, get them)."""
    from llamafactory.data import (
        KTODataCollatorWithPadding,
        PairwiseDataCollatorWithPadding,
        SFTDataCollatorWith4DAttentionMask,
        get_template_and_fix_tokenizer,
    )
    from llamafactory.hparams import DataArguments

    tok = _common.word_level_tokenizer()
    tok.padding_side = "right"  # llamafactory.model.loader.load_tokenizer
    template = get_template_and_fix_tokenizer(tok, DataArguments(template="qwen3"))
    config = transformers.Qwen3Config(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    common = dict(
        template=template,
        model=model,
        pad_to_multiple_of=8,
        label_pad_token_id=IGNORE_INDEX,
        tokenizer=tok,
        processor=None,
    )
    sft = SFTDataCollatorWith4DAttentionMask(
        **common,
        block_diag_attn=neat_packing,
        neat_packing=neat_packing,
        attn_implementation="sdpa",
        compute_dtype=torch.float32,
    )
    return tok, model, sft, PairwiseDataCollatorWithPadding(**common), KTODataCollatorWithPadding(**common)


def sft_row(rng: np.random.Generator, low: int, high: int, vocab: int) -> dict:
    n = int(rng.integers(low, high + 1))
    ids = rng.integers(2, vocab, n).tolist()
    prompt = int(rng.integers(1, n))
    return {"input_ids": ids, "attention_mask": [1] * n, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]}


def rows(batch: int, rng: np.random.Generator, low: int, high: int, vocab: int) -> list[dict]:
    """SFT rows as LLaMA-Factory's processor (data/processor/supervised.py) writes them, media columns None."""
    return [{**sft_row(rng, low, high, vocab), **dict.fromkeys(MEDIA)} for _ in range(batch)]


def without_media(batch: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in MEDIA} for row in batch]


def difference(a, b) -> str | None:
    """None when ``a`` and ``b`` are the same batch (type, keys in order, dtypes, shapes, values), else how not."""
    if type(a) is not type(b):
        return f"type {type(a).__name__} vs {type(b).__name__}"
    if list(a.keys()) != list(b.keys()):
        return f"keys {list(a.keys())} vs {list(b.keys())}"
    for k in a.keys():  # noqa: SIM118 - BatchEncoding
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"{k}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}"
        if not torch.equal(x, y):
            return f"{k}: values differ"
    return None


def timed(fn, batch) -> float:
    with _common.gc_paused():
        start = time.perf_counter()
        fn(batch)
        return time.perf_counter() - start


def measure(args, rng: np.random.Generator) -> list[dict]:
    tok, model, sft, _, _ = build()
    hf = transformers.DataCollatorForSeq2Seq(
        tok, model=model, pad_to_multiple_of=8, label_pad_token_id=IGNORE_INDEX
    )
    contenders = {
        "llamafactory": sft,
        "transformers": lambda b: hf(without_media(b)),
        "fasttrain": native_collator(sft),  # LLaMA-Factory's code, padded in Rust
    }
    results = []
    for batch_size in args.batch_sizes:
        batches = [rows(batch_size, rng, 16, args.max_len, len(tok)) for _ in range(args.batches)]
        assert difference(sft([dict(r) for r in batches[0]]), contenders["fasttrain"](batches[0])) is None
        for fn in contenders.values():  # warm-up: first calls pay for imports and allocations
            fn([dict(r) for r in batches[0]])
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for i in range(args.calls):
            # fresh shallow copies, made outside the timed call: LLaMA-Factory's collator pops the media keys
            batch = [dict(r) for r in batches[i % len(batches)]]
            for name, fn in contenders.items():
                times[name].append(timed(fn, [dict(r) for r in batch]))
        median = {name: statistics.median(t) for name, t in times.items()}
        row = {"batch": batch_size, **{f"{n}_examples_per_s": batch_size / m for n, m in median.items()}}
        row["speedup_vs_llamafactory"] = median["llamafactory"] / median["fasttrain"]
        results.append(row)
        print(
            f"batch {batch_size:3d}: llamafactory {row['llamafactory_examples_per_s']:10,.0f}/s  transformers "
            f"{row['transformers_examples_per_s']:10,.0f}/s  fasttrain {row['fasttrain_examples_per_s']:10,.0f}/s  "
            f"x{row['speedup_vs_llamafactory']:.1f}",
            flush=True,
        )
    return results


def markdown(r: dict) -> str:
    m, s = r["machine"], r["setup"]
    lines = [
        "# LLaMA-Factory's SFT collator against fasttrain's twin of it",
        "",
        f"- Date (UTC): {r['date_utc']}",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; load average at start "
        f"{', '.join(f'{x:.1f}' for x in m['load_average_1_5_15min_at_start'])}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
        f"- Command: `{r['command']}`",
        f"- SFTDataCollatorWith4DAttentionMask as LLaMA-Factory builds it, and fasttrain's twin of it (the same "
        f"object, padded in Rust); transformers' DataCollatorForSeq2Seq beside them (pad_to_multiple_of=8, "
        f"label_pad_token_id=-100, media keys dropped inside the timed call). Rows of lengths uniform in "
        f"[16, {s['max_len']}], {s['calls']} alternating calls over {s['batches']} batches per size, medians.",
        "",
        "## Speed (examples/s)",
        "",
        "| batch | LLaMA-Factory SFT | transformers | fasttrain's twin | twin / LLaMA-Factory |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for x in r["speed"]:
        lines.append(
            f"| {x['batch']} | {x['llamafactory_examples_per_s']:,.0f} | "
            f"{x['transformers_examples_per_s']:,.0f} | {x['fasttrain_examples_per_s']:,.0f} | "
            f"{x['speedup_vs_llamafactory']:.1f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument(
        "--calls", type=int, default=40, help="timed calls per contender and batch size (alternating)"
    )
    p.add_argument("--batches", type=int, default=4, help="distinct batches cycled through")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; results are not written")
    args = p.parse_args()
    if args.smoke:
        args.batch_sizes, args.max_len, args.calls, args.batches = [2, 8], 64, 3, 2
    transformers.logging.set_verbosity_error()
    rng = np.random.default_rng(args.seed)
    record = {
        "benchmark": "collators_llamafactory",
        "date_utc": _common.utc_now(),
        "command": _common.command(),
        "machine": {
            "cpu": _common.cpu_model(),
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_1_5_15min_at_start": list(os.getloadavg()),
        },
        "versions": _common.versions("llamafactory", "fasttrain", "transformers", "torch", "numpy"),
        "setup": {"max_len": args.max_len, "calls": args.calls, "batches": args.batches, "seed": args.seed},
        "speed": measure(args, rng),
    }
    if args.smoke:
        print("smoke run: results not written")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "collators_llamafactory.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / "collators_llamafactory.md").write_text(markdown(record))
    print(f"wrote {args.out / 'collators_llamafactory.json'} and {args.out / 'collators_llamafactory.md'}")


if __name__ == "__main__":
    main()
