"""Length-grouped sampler: transformers' path vs fasttrain's, side by side on one 1M-row datasets.Dataset.

Two measurements, reference and fasttrain alternating, medians of several repetitions:

- start-up: building the sampler from a ``datasets.Dataset`` with a list column ``input_ids`` and no
  ``length`` column, which is what the Trainer does for ``train_sampling_strategy="group_by_length"``:
  transformers' ``LengthGroupedSampler(bs, dataset=ds)`` runs ``len(example["input_ids"])`` over every row;
  fasttrain reads the list lengths from the Arrow offsets.
- one epoch of indices, from the same lengths and generator seed: transformers'
  ``get_length_grouped_indices`` (a list) vs fasttrain's ``length_grouped_indices`` (an int64 array, what
  ``LengthGroupedSampler.indices()`` returns), the permutation drawn inside both;
  and the whole epoch as Python ints (``list(sampler)``) for both samplers.

Both sides are checked to give the same lengths and the same order before anything is timed.
Writes benchmarks/results/sampler.json and sampler.md.

``--budget-only``: token-budget batches (``TokenBudgetBatchSampler``, which has no transformers counterpart),
the Rust cut against the simplest numpy form of the same greedy cut (one ``searchsorted`` per batch) and a
plain Python loop, on log-normal lengths (median 180, 16..1024); writes sampler_budget.json and .md.

    python benchmarks/bench_sampler.py            # 1M rows (about 2 minutes on 2 cores)
    python benchmarks/bench_sampler.py --rows 20000 --repeats 2 --out /tmp   # smoke run
    python benchmarks/bench_sampler.py --budget-only   # token-budget batches, 1M rows (well under a minute)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch
from transformers.trainer_pt_utils import LengthGroupedSampler as RefSampler
from transformers.trainer_pt_utils import get_length_grouped_indices

import _common
import fasttrain
from fasttrain.data.sampler import LengthGroupedSampler, length_grouped_indices, token_budget_batches

RESULTS = Path(__file__).resolve().parent / "results"


def build_dataset(rows: int, min_length: int, max_length: int, seed: int) -> datasets.Dataset:
    """A datasets.Dataset with one list<int32> column `input_ids` of random lengths, built from offsets."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_length, max_length + 1, size=rows)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    # Token values do not matter to either side; tile a random block instead of drawing ~10^8 numbers.
    values = np.resize(rng.integers(0, 32_000, size=1 << 20, dtype=np.int32), int(offsets[-1]))
    offsets_type = np.int32 if offsets[-1] < 2**31 else np.int64
    array_type = pa.ListArray if offsets_type is np.int32 else pa.LargeListArray
    column = array_type.from_arrays(pa.array(offsets.astype(offsets_type)), pa.array(values))
    return datasets.Dataset(pa.table({"input_ids": column}))


def numpy_grouped_indices(lengths: np.ndarray, batch_size: int, generator: torch.Generator) -> np.ndarray:
    """The simplest numpy form of the same order (what the Rust grouping has to beat): one stable argsort
    of (megabatch, descending length) keys after the same torch.randperm."""
    n = len(lengths)
    size = max(min(n // (batch_size * 4), 50), 1) * batch_size
    permutation = torch.randperm(n, generator=generator).numpy()
    permuted = lengths[permutation]
    top = int(permuted.max())
    order = permutation[np.argsort((np.arange(n) // size) * (top + 1) + (top - permuted), kind="stable")]
    longest = int(np.argmax(lengths[order[::size]])) * size
    order[0], order[longest] = order[longest], order[0]
    return order


def numpy_budget_offsets(order: np.ndarray, lengths: np.ndarray, budget: int) -> np.ndarray:
    """The simplest numpy form of the greedy token-budget cut (what the Rust cut has to beat): over the
    prefix sums, each batch ends where the next ``budget`` tokens run out (one ``searchsorted`` per batch;
    a batch takes at least one example)."""
    prefix = np.concatenate([[0], np.cumsum(lengths[order])])
    n = len(order)
    offsets = [0]
    start = 0
    while start < n:
        end = int(np.searchsorted(prefix, prefix[start] + budget, side="right")) - 1
        start = max(end, start + 1)
        offsets.append(start)
    return np.asarray(offsets, dtype=np.int64)


def python_budget_offsets(order: list[int], lengths: list[int], budget: int) -> list[int]:
    """The same cut as a plain Python loop over the examples."""
    offsets, tokens = [0], 0
    for position, index in enumerate(order):
        if position > offsets[-1] and tokens + lengths[index] > budget:
            offsets.append(position)
            tokens = 0
        tokens += lengths[index]
    if order:
        offsets.append(len(order))
    return offsets


def rust_budget_offsets(order: np.ndarray, lengths: np.ndarray, budget: int) -> np.ndarray:
    return fasttrain._native.token_budget_offsets(order, lengths, budget)


def budget_main(args: argparse.Namespace, command: str) -> None:
    """Token-budget batches: Rust against the numpy form and a Python loop (same order, same cut)."""
    load_before = os.getloadavg()
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(np.log(180), 0.8, size=args.rows), 16, 1024).astype(np.int64)
    order = torch.randperm(args.rows, generator=torch.Generator().manual_seed(args.seed)).numpy()
    budget = args.max_tokens
    rust = rust_budget_offsets(order, lengths, budget)
    assert np.array_equal(numpy_budget_offsets(order, lengths, budget), rust), "the numpy form differs"
    order_list, lengths_list = order.tolist(), lengths.tolist()
    assert python_budget_offsets(order_list, lengths_list, budget) == rust.tolist(), "the Python loop differs"
    # and the public path cuts the same batches
    assert [len(b) for b in token_budget_batches(lengths, budget, order)] == np.diff(rust).tolist()
    numpy_times, rust_times = alternate(
        lambda: numpy_budget_offsets(order, lengths, budget),
        lambda: rust_budget_offsets(order, lengths, budget),
        args.repeats,
    )
    python_times, rust_again = alternate(
        lambda: python_budget_offsets(order_list, lengths_list, budget),
        lambda: rust_budget_offsets(order, lengths, budget),
        args.repeats,
    )
    results = {
        "benchmark": "sampler_budget",
        "date_utc": _common.utc_now(),
        "command": command,
        "machine": {
            "cpu": _common.cpu_model(),
            "cores": os.cpu_count(),
            "load_average_at_start": load_before,
        },
        "versions": _common.versions("torch", "numpy", "fasttrain"),
        "config": {
            "rows": args.rows,
            "max_tokens_per_batch": budget,
            "lengths": "log-normal, median 180, sigma 0.8, clipped to 16..1024",
            "mean_length": float(lengths.mean()),
            "batches": len(rust) - 1,
            "repeats": args.repeats,
        },
        "numpy_form": summary(numpy_times, rust_times, args.rows),
        "python_loop": summary(python_times, rust_again, args.rows),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampler_budget.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "sampler_budget.md").write_text(budget_markdown(results))
    print(budget_markdown(results))


def budget_markdown(r: dict) -> str:
    c, m, v = r["config"], r["machine"], r["versions"]

    def row(name: str, d: dict) -> str:
        return (
            f"| {name} | {d['reference_median_s'] * 1e3:,.2f} ms | {d['fasttrain_median_s'] * 1e3:,.2f} ms "
            f"| {d['speedup']:,.1f}x |"
        )

    return f"""# Token-budget batches: the Rust cut against numpy and plain Python

{r["date_utc"]} · {m["cpu"]}, {m["cores"]} cores (load average at start {m["load_average_at_start"][0]:.2f};
a machine shared with other work) · Python {v["python"]}, torch {v["torch"]}, numpy {v["numpy"]},
fasttrain {v["fasttrain"]}

Command: `{r["command"]}`

{c["rows"]:,} examples with {c["lengths"]} (mean {c["mean_length"]:.1f}), one `torch.randperm` order, cut
into batches of at most {c["max_tokens_per_batch"]:,} tokens ({c["batches"]:,} batches). All three give the same
boundaries (checked before timing). Alternating runs, garbage collector off during each; medians of {c["repeats"]}.

| cut | other | Rust (`_native.token_budget_offsets`) | speed-up |
| --- | --- | --- | --- |
{row("simplest numpy form (one `searchsorted` per batch)", r["numpy_form"])}
{row("plain Python loop over the examples", r["python_loop"])}
"""


def timed(fn):
    """Wall time of one call, the garbage collector run before and off during it (as timeit does)."""
    with _common.gc_paused():
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result


def alternate(reference, ours, repeats: int) -> tuple[list[float], list[float]]:
    ref_times, our_times = [], []
    for _ in range(repeats):
        ref_times.append(timed(reference)[0])
        our_times.append(timed(ours)[0])
    return ref_times, our_times


def summary(ref_times: list[float], our_times: list[float], items: int) -> dict:
    ref, ours = statistics.median(ref_times), statistics.median(our_times)
    return {
        "reference_s": ref_times,
        "fasttrain_s": our_times,
        "reference_median_s": ref,
        "fasttrain_median_s": ours,
        "reference_items_per_s": items / ref,
        "fasttrain_items_per_s": items / ours,
        "speedup": ref / ours,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--min-length", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7, help="repetitions of the indices measurements")
    parser.add_argument(
        "--startup-repeats", type=int, default=3, help="repetitions of the start-up measurement"
    )
    parser.add_argument(
        "--startup-rows",
        type=int,
        default=None,
        help="time the reference's per-row pass on the first N rows only (default: all rows)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--budget-only", action="store_true", help="only the token-budget batches")
    parser.add_argument("--max-tokens", type=int, default=4096, help="token budget of --budget-only")
    args = parser.parse_args()
    command = _common.command()
    if args.budget_only:
        budget_main(args, command)
        return
    load_before = os.getloadavg()

    ds = build_dataset(args.rows, args.min_length, args.max_length, args.seed)
    bs = args.batch_size

    # --- start-up: lengths from the dataset ---
    startup_ds = ds if args.startup_rows is None else ds.select(range(args.startup_rows))
    startup_rows = len(startup_ds)
    ref_sampler = RefSampler(bs, dataset=startup_ds)
    our_sampler = LengthGroupedSampler(bs, dataset=startup_ds)
    assert our_sampler.lengths.tolist() == list(ref_sampler.lengths), "lengths differ"
    ref_startup, our_startup = alternate(
        lambda: RefSampler(bs, dataset=startup_ds),
        lambda: LengthGroupedSampler(bs, dataset=startup_ds),
        args.startup_repeats,
    )
    # fasttrain's start-up on all rows too (it is what a user pays), when the reference ran on a subset.
    our_full_startup = [timed(lambda: LengthGroupedSampler(bs, dataset=ds))[0] for _ in range(args.repeats)]

    # --- one epoch of indices, same lengths and seed on both sides ---
    ours = LengthGroupedSampler(bs, dataset=ds, generator=torch.Generator().manual_seed(args.seed))
    ref_lengths = ours.lengths.tolist()  # what transformers' sampler holds: a list of Python ints
    ref = RefSampler(bs, lengths=ref_lengths, generator=torch.Generator().manual_seed(args.seed))
    assert list(ours) == list(ref), "orders differ"
    n = len(ref_lengths)
    g_ref, g_ours = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    ref_indices, our_indices = alternate(
        lambda: get_length_grouped_indices(ref_lengths, bs, generator=g_ref),
        lambda: length_grouped_indices(ours.lengths, bs, generator=g_ours),
        args.repeats,
    )
    ref_epoch, our_epoch = alternate(lambda: list(ref), lambda: list(ours), args.repeats)
    g_numpy, g_ours = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    assert np.array_equal(
        numpy_grouped_indices(ours.lengths, bs, g_numpy),
        length_grouped_indices(ours.lengths, bs, generator=g_ours),
    ), "the numpy form differs"
    numpy_indices, our_indices_again = alternate(
        lambda: numpy_grouped_indices(ours.lengths, bs, g_numpy),
        lambda: length_grouped_indices(ours.lengths, bs, generator=g_ours),
        args.repeats,
    )

    results = {
        "benchmark": "sampler",
        "date_utc": _common.utc_now(),
        "command": command,
        "machine": {
            "cpu": _common.cpu_model(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_at_start": load_before,
        },
        "versions": _common.versions("torch", "transformers", "datasets", "pyarrow", "numpy", "fasttrain"),
        "config": {
            "rows": args.rows,
            "startup_rows": startup_rows,
            "batch_size": bs,
            "length_range": [args.min_length, args.max_length],
            "mean_length": float(ours.lengths.mean()),
            "repeats": args.repeats,
            "startup_repeats": args.startup_repeats,
        },
        "startup": summary(ref_startup, our_startup, startup_rows),
        "startup_fasttrain_all_rows_median_s": statistics.median(our_full_startup),
        "indices": summary(ref_indices, our_indices, n),
        "epoch_as_python_ints": summary(ref_epoch, our_epoch, n),
        "numpy_form": summary(numpy_indices, our_indices_again, n),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sampler.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "sampler.md").write_text(markdown(results))
    print(markdown(results))


def markdown(r: dict) -> str:
    c, m, v = r["config"], r["machine"], r["versions"]
    s, i, e = r["startup"], r["indices"], r["epoch_as_python_ints"]

    def row(name: str, d: dict, unit: str) -> str:
        return (
            f"| {name} | {d['reference_median_s'] * 1e3:,.1f} ms ({d['reference_items_per_s']:,.0f} {unit}/s) "
            f"| {d['fasttrain_median_s'] * 1e3:,.2f} ms ({d['fasttrain_items_per_s']:,.0f} {unit}/s) "
            f"| {d['speedup']:,.1f}x |"
        )

    subset = (
        ""
        if c["startup_rows"] == c["rows"]
        else f" The reference start-up was timed on the first {c['startup_rows']:,} rows only."
    )
    return f"""# Length-grouped sampler: transformers vs fasttrain

{r["date_utc"]} · {m["cpu"]}, {m["cores"]} cores (load average at start {m["load_average_at_start"][0]:.2f}) ·
Python {v["python"]}, torch {v["torch"]}, transformers {v["transformers"]}, datasets {v["datasets"]},
pyarrow {v["pyarrow"]}, numpy {v["numpy"]}, fasttrain {v["fasttrain"]}

Command: `{r["command"]}`

A `datasets.Dataset` of {c["rows"]:,} rows, list column `input_ids` with lengths uniform in
[{c["length_range"][0]}, {c["length_range"][1]}] (mean {c["mean_length"]:.1f}), no `length` column; batch size {c["batch_size"]}.
Reference and fasttrain alternate (garbage collector run before and off during each timed call); medians of {c["startup_repeats"]} (start-up) and {c["repeats"]} (indices) runs.
Both sides give the same lengths and the same index order (checked before timing).{subset}

| measurement | transformers | fasttrain | speed-up |
| --- | --- | --- | --- |
{row("start-up: sampler from the dataset (lengths)", s, "rows")}
{row("one epoch of indices (list vs int64 array)", i, "indices")}
{row("one epoch as Python ints (`list(sampler)`)", e, "indices")}
{row("one epoch of indices: the simplest numpy form (stable argsort) vs Rust", r["numpy_form"], "indices")}

- Start-up: transformers runs `len(example["input_ids"])` over every row (what the Trainer does without a
  `length` column); fasttrain reads the list lengths from the Arrow offsets. fasttrain on all {c["rows"]:,} rows:
  {r["startup_fasttrain_all_rows_median_s"] * 1e3:.2f} ms.
- Indices: the order is fixed by `torch.randperm(n, generator)`, drawn by torch on both sides; fasttrain
  groups the permutation in Rust (one thread, radix sort). The last row puts the simplest numpy form of the
  same grouping (one stable `argsort`, "transformers" column) beside the Rust one.
- The machine is shared: see the load average above; each figure is a median of alternating runs.
"""


if __name__ == "__main__":
    main()
