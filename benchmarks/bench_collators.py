"""fasttrain's Rust collators against transformers' and TRL's collators, side by side in one run.

For each case both collators get the same batches (64 examples of random length 16-2048 by default),
alternating call by call (reference, ours, reference, ours, ...) so that both see the same machine
load; the figures are medians over all calls. Before timing, each case checks that both outputs are
identical (keys, dtypes, shapes, values).

Input kinds: "list" (Python lists, as a tokenizer or `datasets` without a format returns them),
"numpy" (int64 arrays), "arrow" (rows of a `datasets.Dataset` in numpy format: arrays read from the
Arrow buffers) and "torch" (int64 CPU tensors).

TRL's collators (when trl is installed): SFTTrainer's ``DataCollatorForLanguageModeling`` padded, padding-free,
and padding-free on packed examples (``seq_lengths``, documents of 16-2048 tokens packed into rows of up to
8192), and DPOTrainer's ``DataCollatorForPreference`` (prompts of 16-512 tokens, answers of 16-1024,
``max_length=1024``), and KTOTrainer's ``DataCollatorForUnpairedPreference`` (prompts of 16-512 tokens,
completions of 16-1024 and KL completions rotated by one within the batch as KTOTrainer builds them,
``max_length=1024``), all on Python lists as SFTTrainer, DPOTrainer and KTOTrainer hand them over.

Usage:
    python benchmarks/bench_collators.py            # writes benchmarks/results/collators.{json,md}
    python benchmarks/bench_collators.py --smoke     # tiny run, checks that the script works
    python benchmarks/bench_collators.py --only "TRL KTO" --out /tmp/bench   # one collator, results elsewhere

Figures are written by this script only; never type them by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

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
    "sft" (input_ids, labels with the prompt masked), "packed" (documents packed into rows, seq_lengths),
    "preference" (prompt_ids, chosen_ids, rejected_ids), "unpaired" (KTO's prompt_ids, completion_ids,
    KL_completion_ids: the completions rotated by one, label)."""
    rows = []
    for n in rng.integers(min_len, max_len + 1, batch):
        ids = rng.integers(1, VOCAB, n)
        if data == "sft":
            labels = ids.copy()
            labels[: int(rng.integers(0, n))] = -100
            rows.append({"input_ids": ids, "labels": labels})
        elif data == "packed":
            docs = []
            while sum(docs) < 4 * max_len:
                docs.append(int(rng.integers(min_len, max_len + 1)))
            total = sum(docs)
            rows.append({"input_ids": rng.integers(1, VOCAB, total), "seq_lengths": np.asarray(docs)})
        elif data == "preference":
            rows.append(
                {
                    "prompt_ids": rng.integers(1, VOCAB, int(rng.integers(min_len, max_len // 4 + 1))),
                    "chosen_ids": rng.integers(1, VOCAB, int(rng.integers(min_len, max_len // 2 + 1))),
                    "rejected_ids": rng.integers(1, VOCAB, int(rng.integers(min_len, max_len // 2 + 1))),
                }
            )
        elif data == "unpaired":
            rows.append(
                {
                    "prompt_ids": rng.integers(1, VOCAB, int(rng.integers(min_len, max_len // 4 + 1))),
                    "completion_ids": rng.integers(1, VOCAB, int(rng.integers(min_len, max_len // 2 + 1))),
                    "label": np.bool_(rng.integers(0, 2)),
                }
            )
        else:
            row = {"input_ids": ids, "attention_mask": np.ones(n, dtype=np.int64)}
            if data == "labels":
                row["labels"] = rng.integers(1, VOCAB, int(rng.integers(min_len, max_len + 1)))
            rows.append(row)
    if data == "unpaired":  # KTOTrainer's KL completions: (x_1, y_n), (x_2, y_1), ...
        for row, previous in zip(rows, rows[-1:] + rows[:-1], strict=True):
            row["KL_completion_ids"] = previous["completion_ids"]
    return rows


def convert(rows: list[dict], kind: str) -> list[dict]:
    if kind == "list":
        return [{k: v.tolist() for k, v in r.items()} for r in rows]
    if kind == "numpy":
        return [{k: v.astype(np.int64) for k, v in r.items()} for r in rows]
    if kind == "torch":
        return [{k: torch.from_numpy(v.astype(np.int64)) for k, v in r.items()} for r in rows]
    if kind == "arrow":
        ds = datasets.Dataset.from_dict({k: [r[k].tolist() for r in rows] for k in rows[0]}).with_format(
            "numpy"
        )
        return [ds[i] for i in range(len(ds))]
    raise ValueError(kind)


def same(a, b) -> bool:
    if type(a) is not type(b) or list(a.keys()) != list(b.keys()):
        return False
    for k in b.keys():  # noqa: SIM118 - BatchEncoding
        x, y = a[k], b[k]
        if isinstance(y, torch.Tensor):
            if not (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def timed(fn: Callable, batch: list) -> tuple[float, float]:
    """One call's (wall time, CPU time of the process), the garbage collector run before and off during the
    call (as timeit does: otherwise a collection of one side's garbage lands on whichever side allocates next).
    CPU time leaves out the time the call spent descheduled, which dominates short calls on a loaded machine."""
    with _common.gc_paused():
        wall, cpu = time.perf_counter(), time.process_time()
        fn(batch)
        return time.perf_counter() - wall, time.process_time() - cpu


def alternate(ref: Callable, ours: Callable, batches: list, calls: int) -> tuple[list, list]:
    """(wall, cpu) pairs of each side, calls alternating on the same batches."""
    ref_t, our_t = [], []
    for i in range(calls):
        b = batches[i % len(batches)]
        ref_t.append(timed(ref, b))
        our_t.append(timed(ours, b))
    return ref_t, our_t


def cases(tok, max_len: int) -> list[tuple[str, str, object, object, str]]:
    """(collator name, input kind, reference collator, ours, data of make_rows)."""
    out = []
    for kind in ("list", "numpy", "arrow", "torch"):
        out.append(
            (
                "DataCollatorWithPadding",
                kind,
                transformers.DataCollatorWithPadding(tok),
                ft.DataCollatorWithPadding(tok),
                "plain",
            )
        )
    for kind in ("list", "numpy"):
        out.append(
            (
                "DataCollatorForLanguageModeling(mlm=False)",
                kind,
                transformers.DataCollatorForLanguageModeling(tok, mlm=False),
                ft.DataCollatorForLanguageModeling(tok, mlm=False),
                "plain",
            )
        )
    for kind in ("list", "numpy"):
        out.append(
            (
                "DataCollatorForSeq2Seq",
                kind,
                transformers.DataCollatorForSeq2Seq(tok),
                ft.DataCollatorForSeq2Seq(tok),
                "labels",
            )
        )
    for kind in ("list", "numpy"):
        out.append(
            (
                "DataCollatorWithFlattening",
                kind,
                transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True),
                ft.DataCollatorWithFlattening(return_flash_attn_kwargs=True),
                "plain",
            )
        )
    return out + trl_cases(max_len)


def trl_cases(max_len: int) -> list[tuple[str, str, object, object, str]]:
    try:
        from trl.trainer import dpo_trainer, kto_trainer, sft_trainer
    except ImportError:
        print("trl is not installed: TRL's collators are not measured", flush=True)
        return []
    from fasttrain.data import trl_collators

    sft = [
        ("TRL SFT DataCollatorForLanguageModeling", dict(pad_token_id=PAD_ID), "sft"),
        (
            "TRL SFT DataCollatorForLanguageModeling(padding_free)",
            dict(pad_token_id=PAD_ID, padding_free=True),
            "sft",
        ),
        (
            "TRL SFT DataCollatorForLanguageModeling(padding_free, packed)",
            dict(pad_token_id=PAD_ID, padding_free=True),
            "packed",
        ),
    ]
    out = [
        (
            name,
            "list",
            sft_trainer.DataCollatorForLanguageModeling(**kw),
            trl_collators.DataCollatorForLanguageModeling(**kw),
            data,
        )
        for name, kw, data in sft
    ]
    kw = dict(pad_token_id=PAD_ID, max_length=max_len // 2)
    out.append(
        (
            f"TRL DPO DataCollatorForPreference(max_length={max_len // 2})",
            "list",
            dpo_trainer.DataCollatorForPreference(**kw),
            trl_collators.DataCollatorForPreference(**kw),
            "preference",
        )
    )
    out.append(
        (
            f"TRL KTO DataCollatorForUnpairedPreference(max_length={max_len // 2})",
            "list",
            kto_trainer.DataCollatorForUnpairedPreference(**kw),
            trl_collators.DataCollatorForUnpairedPreference(**kw),
            "unpaired",
        )
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--calls", type=int, default=30, help="timed calls per collator and case (alternating)")
    p.add_argument("--batches", type=int, default=4, help="distinct batches cycled through")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; results are not written")
    p.add_argument("--only", help="measure only the collators whose name contains this text (e.g. 'TRL KTO')")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.max_len, args.calls, args.batches = 8, 64, 3, 2

    tok = _common.word_level_tokenizer()  # pad id 0 = PAD_ID
    rng = np.random.default_rng(args.seed)
    raw = {
        data: [make_rows(args.batch, args.min_len, args.max_len, rng, data) for _ in range(args.batches)]
        for data in ("plain", "labels", "sft", "packed", "preference", "unpaired")
    }
    results = []
    for name, kind, ref, ours, data in cases(tok, args.max_len):
        if args.only is not None and args.only not in name:
            continue
        batches = [convert(rows, kind) for rows in raw[data]]
        if not same(ours(batches[0]), ref(batches[0])):
            raise SystemExit(f"{name} on {kind} input: outputs differ from the reference")
        ours(batches[0])  # warm-up
        ref(batches[0])
        ref_t, our_t = alternate(ref, ours, batches, args.calls)
        r_med, o_med = (statistics.median(wall for wall, _ in t) for t in (ref_t, our_t))
        r_cpu, o_cpu = (statistics.median(cpu for _, cpu in t) for t in (ref_t, our_t))
        tokens = statistics.mean(
            sum(sum(len(v) for k, v in r.items() if k.endswith("ids")) for r in rows) for rows in raw[data]
        )
        results.append(
            {
                "collator": name,
                "input": kind,
                "reference_ms_per_batch": r_med * 1e3,
                "fasttrain_ms_per_batch": o_med * 1e3,
                "reference_examples_per_s": args.batch / r_med,
                "fasttrain_examples_per_s": args.batch / o_med,
                "speedup": r_med / o_med,
                "reference_cpu_ms_per_batch": r_cpu * 1e3,
                "fasttrain_cpu_ms_per_batch": o_cpu * 1e3,
                "speedup_cpu_time": r_cpu / o_cpu,
                "mean_tokens_per_batch": tokens,
            }
        )
        print(
            f"{name:62s} {kind:6s} reference {r_med * 1e3:8.2f} ms  fasttrain {o_med * 1e3:7.3f} ms  "
            f"x{r_med / o_med:6.1f}  (CPU time x{r_cpu / o_cpu:6.1f})",
            flush=True,
        )

    record = {
        "benchmark": "collators",
        "date_utc": _common.utc_now(),
        "command": _common.command(),
        "machine": {
            "cpu": _common.cpu_model(),
            "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "platform": platform.platform(),
            # The development machines are shared: the load says how busy the cores were.
            "load_average_1_5_15min_at_start": list(os.getloadavg()),
        },
        "versions": _common.versions(
            "fasttrain", "transformers", "trl", "torch", "numpy", "tokenizers", "datasets"
        ),
        "setup": {
            "batch": args.batch,
            "lengths": [args.min_len, args.max_len],
            "timed_calls_per_collator": args.calls,
            "distinct_batches": args.batches,
            "return_tensors": "pt",
            "method": "reference and fasttrain called alternately on the same batches, the garbage collector "
            "run before and off during each call (as timeit does); medians of wall time, and of the process's "
            "CPU time (which leaves out time spent descheduled on a loaded machine)",
        },
        "results": results,
    }
    if args.smoke:
        print("smoke run: results not written")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "collators.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / "collators.md").write_text(markdown(record))
    print(f"wrote {args.out / 'collators.json'} and {args.out / 'collators.md'}")


def markdown(r: dict) -> str:
    m, v, s = r["machine"], r["versions"], r["setup"]
    lines = [
        "# Collators: fasttrain (Rust) vs transformers and TRL",
        "",
        f"- Date (UTC): {r['date_utc']}",
        f"- Machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable), {m['platform']}; "
        f"load average at start {', '.join(f'{x:.1f}' for x in m['load_average_1_5_15min_at_start'])}",
        "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- Command: `{r['command']}`",
        f"- Setup: batch {s['batch']}, lengths uniform in [{s['lengths'][0]}, {s['lengths'][1]}], "
        f"{s['timed_calls_per_collator']} timed calls per collator over {s['distinct_batches']} batches, "
        f"return_tensors='{s['return_tensors']}'; {s['method']}. Outputs checked identical before timing.",
        "",
        "| collator | input | reference ms/batch | fasttrain ms/batch | reference examples/s "
        "| fasttrain examples/s | speedup | CPU ms/batch: reference, fasttrain | speedup (CPU time) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for x in r["results"]:
        lines.append(
            f"| {x['collator']} | {x['input']} | {x['reference_ms_per_batch']:.2f} | "
            f"{x['fasttrain_ms_per_batch']:.3f} | {x['reference_examples_per_s']:,.0f} | "
            f"{x['fasttrain_examples_per_s']:,.0f} | {x['speedup']:.1f}x | "
            f"{x['reference_cpu_ms_per_batch']:.2f}, {x['fasttrain_cpu_ms_per_batch']:.3f} | {x['speedup_cpu_time']:.1f}x |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
