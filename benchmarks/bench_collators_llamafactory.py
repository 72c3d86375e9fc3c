"""LLaMA-Factory 0.9.5's SFT collator against the twin fasttrain installs in its place.

Run in LLaMA-Factory's environment (bash .ci/env-llamafactory):

    .ci-envs/llamafactory/bin/python benchmarks/bench_collators_llamafactory.py           # writes results/
    .ci-envs/llamafactory/bin/python benchmarks/bench_collators_llamafactory.py --batch-sizes 2 8 --max-len 64 \
        --calls 3 --batches 2 --out /tmp   # smoke run

How it measures: docs/method.md, "Collators".
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

import _common
from fasttrain.integration.llamafactory import native_collator

MEDIA = ("images", "videos", "audios")
IGNORE_INDEX = -100


def build():
    """LLaMA-Factory's SFT collator with its workflow's arguments, a tokenizer and a tiny Qwen3 (the model decides
    whether position_ids are computed: only models with get_rope_index, Qwen2-VL's kind, get them)."""
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments

    tok = _common.word_level_tokenizer()
    tok.padding_side = "right"  # llamafactory.model.loader.load_tokenizer
    template = get_template_and_fix_tokenizer(tok, DataArguments(template="qwen3"))
    model = _common.tiny_qwen3(len(tok), 16, 1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    sft = SFTDataCollatorWith4DAttentionMask(
        template=template, model=model, pad_to_multiple_of=8, label_pad_token_id=IGNORE_INDEX, tokenizer=tok,
        processor=None, block_diag_attn=False, neat_packing=False, attn_implementation="sdpa",
        compute_dtype=torch.float32,
    )  # fmt: skip
    return tok, model, sft


def rows(batch: int, rng: np.random.Generator, high: int, vocab: int) -> list[dict]:
    """SFT rows as LLaMA-Factory's processor (data/processor/supervised.py) writes them (lengths 16..high, the
    prompt masked), media columns None."""
    out = []
    for n in rng.integers(16, high + 1, batch):
        ids, prompt = rng.integers(2, vocab, n).tolist(), int(rng.integers(1, n))
        labels = [IGNORE_INDEX] * prompt + ids[prompt:]
        out.append(
            {"input_ids": ids, "attention_mask": [1] * int(n), "labels": labels, **dict.fromkeys(MEDIA)}
        )
    return out


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    # --calls: timed calls per contender and batch size (alternating); --batches: distinct batches cycled through
    setup = _common.int_options(p, max_len=2048, calls=40, batches=4, seed=0)
    args = p.parse_args()
    transformers.logging.set_verbosity_error()
    record = _common.new_result("collators_llamafactory", "llamafactory", "numpy")
    record["setup"] = {name: getattr(args, name) for name in setup}
    tok, model, sft = build()
    hf = transformers.DataCollatorForSeq2Seq(
        tok, model=model, pad_to_multiple_of=8, label_pad_token_id=IGNORE_INDEX
    )
    contenders = {
        "llamafactory": sft,
        "transformers": lambda b: hf([{k: v for k, v in row.items() if k not in MEDIA} for row in b]),
        "fasttrain": native_collator(sft),  # LLaMA-Factory's code, padded in Rust
    }
    rng, record["speed"] = np.random.default_rng(args.seed), []
    for batch_size in args.batch_sizes:
        batches = [rows(batch_size, rng, args.max_len, len(tok)) for _ in range(args.batches)]
        first = [dict(r) for r in batches[0]]  # a copy: LLaMA-Factory's collator pops the media keys
        assert _common.batch_difference(sft(first), contenders["fasttrain"](batches[0])) is None
        times = _common.time_collators(contenders, batches, args.calls, copy_rows=True)
        median = {name: wall for name, (wall, _) in times.items()}
        row = {"batch": batch_size, **{f"{n}_examples_per_s": batch_size / m for n, m in median.items()}}
        row["speedup_vs_llamafactory"] = median["llamafactory"] / median["fasttrain"]
        record["speed"].append(row)
        print(f"batch {batch_size:3d}: {row}", flush=True)
    lines = [
        "SFTDataCollatorWith4DAttentionMask as LLaMA-Factory builds it, and fasttrain's twin of it (the same "
        "object, padded in Rust); transformers' DataCollatorForSeq2Seq beside them (pad_to_multiple_of=8, "
        "label_pad_token_id=-100, media keys dropped inside the timed call). Rows of lengths uniform in "
        f"[16, {args.max_len}], {args.calls} alternating calls over {args.batches} batches per size, medians.",
        "",
        "## Speed (examples/s)",
        "",
        "| batch | LLaMA-Factory SFT | transformers | fasttrain's twin | twin / LLaMA-Factory |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {x['batch']} | {x['llamafactory_examples_per_s']:,.0f} | {x['transformers_examples_per_s']:,.0f} "
              f"| {x['fasttrain_examples_per_s']:,.0f} | {x['speedup_vs_llamafactory']:.1f}x |" for x in record["speed"]]  # fmt: skip
    title = "LLaMA-Factory's SFT collator against fasttrain's twin of it"
    _common.write(args.out, "collators_llamafactory", record, title, lines)


if __name__ == "__main__":
    main()
