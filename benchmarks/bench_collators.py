"""fasttrain's Rust collators against transformers' and TRL's collators, side by side in one run.

How it measures (batches, inputs, TRL's collators): docs/method.md, "Collators".

Usage:
    python benchmarks/bench_collators.py            # writes benchmarks/results/collators.{json,md}
    python benchmarks/bench_collators.py --batch 8 --max-len 64 --calls 3 --batches 2 --out /tmp   # smoke run
"""

from __future__ import annotations

import statistics

import datasets
import numpy as np
import torch
import transformers

import _common
import fasttrain as ft  # the public collators

PAD_ID = 0
VOCAB = 32_000


def make_rows(batch: int, min_len: int, max_len: int, rng: np.random.Generator, data: str) -> list[dict]:
    """One batch of numpy rows: "plain" (input_ids, attention_mask), "labels" (+ labels of another length),
    "sft" (input_ids, labels with the prompt masked), "packed" (documents packed into rows of about 4 x max_len,
    seq_lengths), "preference" (prompt_ids, chosen_ids, rejected_ids), "unpaired" (KTO's prompt_ids,
    completion_ids, KL_completion_ids: the completions rotated by one, label). Prompts are at most max_len / 4
    tokens long, answers and completions max_len / 2."""

    def ids(longest: int) -> np.ndarray:  # random tokens, a random length in [min_len, longest]
        return rng.integers(1, VOCAB, int(rng.integers(min_len, longest + 1)))

    quarter, half = max_len // 4, max_len // 2  # prompts', answers' longest
    rows = []
    for _ in range(batch):
        if data == "sft":
            row = {"input_ids": ids(max_len)}
            row["labels"] = row["input_ids"].copy()
            row["labels"][: int(rng.integers(0, len(row["labels"])))] = -100  # the prompt
        elif data == "packed":
            docs = []
            while sum(docs) < 4 * max_len:
                docs.append(int(rng.integers(min_len, max_len + 1)))
            row = {"input_ids": rng.integers(1, VOCAB, sum(docs)), "seq_lengths": np.asarray(docs)}
        elif data == "preference":
            row = dict(prompt_ids=ids(quarter), chosen_ids=ids(half), rejected_ids=ids(half))
        elif data == "unpaired":
            row = dict(prompt_ids=ids(quarter), completion_ids=ids(half), label=np.bool_(rng.integers(0, 2)))
        else:
            row = {"input_ids": ids(max_len)}
            row["attention_mask"] = np.ones(len(row["input_ids"]), dtype=np.int64)
            if data == "labels":
                row["labels"] = ids(max_len)
        rows.append(row)
    if data == "unpaired":  # KTOTrainer's KL completions: (x_1, y_n), (x_2, y_1), ...
        for row, previous in zip(rows, rows[-1:] + rows[:-1], strict=True):
            row["KL_completion_ids"] = previous["completion_ids"]
    return rows


CONVERT = {"list": lambda v: v.tolist(), "numpy": lambda v: v.astype(np.int64),
           "torch": lambda v: torch.from_numpy(v.astype(np.int64))}  # fmt: skip


def convert(rows: list[dict], kind: str) -> list[dict]:
    if kind == "arrow":
        ds = datasets.Dataset.from_dict({k: [r[k].tolist() for r in rows] for k in rows[0]})
        return list(ds.with_format("numpy"))
    return [{k: CONVERT[kind](v) for k, v in r.items()} for r in rows]


def cases(tok, max_len: int) -> list[tuple[str, str, object, object, str]]:
    """(collator name, input kind, reference collator, ours, data of make_rows)."""
    kwargs = {
        "DataCollatorWithPadding": ((tok,), {}, "plain", ("list", "numpy", "arrow", "torch")),
        "DataCollatorForLanguageModeling": ((tok,), {"mlm": False}, "plain", ("list", "numpy")),
        "DataCollatorForSeq2Seq": ((tok,), {}, "labels", ("list", "numpy")),
        "DataCollatorWithFlattening": ((), {"return_flash_attn_kwargs": True}, "plain", ("list", "numpy")),
    }
    out = [
        (name + ("(mlm=False)" if "mlm" in kw else ""), kind, getattr(transformers, name)(*a, **kw),
         getattr(ft, name)(*a, **kw), data)
        for name, (a, kw, data, kinds) in kwargs.items()
        for kind in kinds
    ]  # fmt: skip
    return out + trl_cases(max_len)


def trl_cases(max_len: int) -> list[tuple[str, str, object, object, str]]:
    try:
        from trl.trainer import dpo_trainer, kto_trainer, sft_trainer
    except ImportError:
        print("trl is not installed: TRL's collators are not measured", flush=True)
        return []
    from fasttrain.data import trl_collators as ours

    lm = "DataCollatorForLanguageModeling"
    free, short = dict(padding_free=True), dict(max_length=max_len // 2)
    table = [  # (name, TRL's module, class, keyword arguments beside the pad id, data)
        (f"TRL SFT {lm}", sft_trainer, lm, {}, "sft"),
        (f"TRL SFT {lm}(padding_free)", sft_trainer, lm, free, "sft"),
        (f"TRL SFT {lm}(padding_free, packed)", sft_trainer, lm, free, "packed"),
        (f"TRL DPO DataCollatorForPreference(max_length={max_len // 2})", dpo_trainer,
         "DataCollatorForPreference", short, "preference"),
        (f"TRL KTO DataCollatorForUnpairedPreference(max_length={max_len // 2})", kto_trainer,
         "DataCollatorForUnpairedPreference", short, "unpaired"),
    ]  # fmt: skip
    return [
        (name, "list", getattr(module, cls)(pad_token_id=PAD_ID, **kw), getattr(ours, cls)(pad_token_id=PAD_ID, **kw), data)
        for name, module, cls, kw, data in table
    ]  # fmt: skip


def main() -> None:
    p = _common.parser(__doc__)
    # --calls: timed calls per collator and case (alternating); --batches: distinct batches cycled through
    _common.int_options(p, batch=64, min_len=16, max_len=2048, calls=30, batches=4, seed=0)
    args = p.parse_args()
    record = _common.new_result("collators", "numpy")
    tok = _common.word_level_tokenizer()  # pad id 0 = PAD_ID
    rng = np.random.default_rng(args.seed)
    raw = {
        data: [make_rows(args.batch, args.min_len, args.max_len, rng, data) for _ in range(args.batches)]
        for data in ("plain", "labels", "sft", "packed", "preference", "unpaired")
    }
    results = []
    for name, kind, ref, ours, data in cases(tok, args.max_len):
        batches = [convert(rows, kind) for rows in raw[data]]
        if differ := _common.batch_difference(ours(batches[0]), ref(batches[0])):
            raise SystemExit(f"{name} on {kind} input: outputs differ from the reference: {differ}")
        times = _common.time_collators({"reference": ref, "fasttrain": ours}, batches, args.calls)
        (r_med, r_cpu), (o_med, o_cpu) = times["reference"], times["fasttrain"]
        tokens = statistics.mean(
            sum(sum(len(v) for k, v in r.items() if k.endswith("ids")) for r in rows) for rows in raw[data]
        )
        results.append(
            {"collator": name, "input": kind, "reference_ms_per_batch": r_med * 1e3,
             "fasttrain_ms_per_batch": o_med * 1e3, "reference_examples_per_s": args.batch / r_med,
             "fasttrain_examples_per_s": args.batch / o_med, "speedup": r_med / o_med,
             "reference_cpu_ms_per_batch": r_cpu * 1e3, "fasttrain_cpu_ms_per_batch": o_cpu * 1e3,
             "speedup_cpu_time": r_cpu / o_cpu, "mean_tokens_per_batch": tokens}
        )  # fmt: skip
        print(f"{name:62s} {kind:6s} x{r_med / o_med:6.1f}  (CPU time x{r_cpu / o_cpu:6.1f})", flush=True)
    method = (
        "reference and fasttrain called alternately on the same batches, the garbage collector run before and off "
        "during each call (as timeit does); medians of wall time, and of the process's CPU time (which leaves out "
        "time spent descheduled on a loaded machine)"
    )
    record["setup"] = {"batch": args.batch, "lengths": [args.min_len, args.max_len], "timed_calls_per_collator":
                       args.calls, "distinct_batches": args.batches, "return_tensors": "pt", "method": method}  # fmt: skip
    record["results"] = results
    lines = [
        f"Batch {args.batch}, lengths uniform in [{args.min_len}, {args.max_len}], {args.calls} timed calls per "
        f"collator over {args.batches} batches, return_tensors='pt'; {method}. Outputs checked identical first.",
        "",
        "| collator | input | reference ms/batch | fasttrain ms/batch | reference examples/s "
        "| fasttrain examples/s | speedup | CPU ms/batch: reference, fasttrain | speedup (CPU time) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {x['collator']} | {x['input']} | {x['reference_ms_per_batch']:.2f} | {x['fasttrain_ms_per_batch']:.3f} "
              f"| {x['reference_examples_per_s']:,.0f} | {x['fasttrain_examples_per_s']:,.0f} | {x['speedup']:.1f}x "
              f"| {x['reference_cpu_ms_per_batch']:.2f}, {x['fasttrain_cpu_ms_per_batch']:.3f} "
              f"| {x['speedup_cpu_time']:.1f}x |" for x in results]  # fmt: skip
    _common.write(args.out, "collators", record, "Collators: fasttrain (Rust) vs transformers and TRL", lines)


if __name__ == "__main__":
    main()
