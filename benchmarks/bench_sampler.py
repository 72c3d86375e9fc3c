"""Length-grouped sampler: transformers' path vs fasttrain's, side by side on one 1M-row datasets.Dataset.

Reference and fasttrain alternate; medians; both sides checked to give the same lengths and order first.
Start-up: the sampler built from a ``datasets.Dataset`` with a list column ``input_ids`` and no ``length`` column
(the Trainer's ``group_by_length``): transformers runs ``len(example["input_ids"])`` over every row, fasttrain reads
the Arrow offsets. One epoch of indices from the same lengths and seed: ``get_length_grouped_indices`` (a list) vs
``length_grouped_indices`` (an int64 array), the whole epoch as Python ints (``list(sampler)``), and the simplest
numpy form of the same grouping. Writes sampler.{json,md}.

``--budget-only``: token-budget batches (``TokenBudgetBatchSampler``, no transformers counterpart): the Rust cut
against the simplest numpy form and a plain Python loop, on log-normal lengths; writes sampler_budget.{json,md}.

    python benchmarks/bench_sampler.py            # 1M rows (about 2 minutes on 2 cores)
    python benchmarks/bench_sampler.py --rows 20000 --repeats 2 --out /tmp   # smoke run
    python benchmarks/bench_sampler.py --budget-only   # token-budget batches, 1M rows (well under a minute)
"""

from __future__ import annotations

import argparse
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


def budget_main(args: argparse.Namespace) -> None:
    """Token-budget batches: Rust against the numpy form and a Python loop (same order, same cut)."""
    result = _common.new_result("sampler_budget", "numpy")
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(np.log(180), 0.8, size=args.rows), 16, 1024).astype(np.int64)
    order = torch.randperm(args.rows, generator=torch.Generator().manual_seed(args.seed)).numpy()
    budget = args.max_tokens
    rust = fasttrain._native.token_budget_offsets(order, lengths, budget)
    assert np.array_equal(numpy_budget_offsets(order, lengths, budget), rust), "the numpy form differs"
    order_list, lengths_list = order.tolist(), lengths.tolist()
    assert python_budget_offsets(order_list, lengths_list, budget) == rust.tolist(), "the Python loop differs"
    # and the public path cuts the same batches
    assert [len(b) for b in token_budget_batches(lengths, budget, order)] == np.diff(rust).tolist()
    ours = lambda _: fasttrain._native.token_budget_offsets(order, lengths, budget)  # noqa: E731
    c = result["config"] = {"rows": args.rows, "max_tokens_per_batch": budget, "mean_length": float(lengths.mean()),
                            "lengths": "log-normal, median 180, sigma 0.8, clipped to 16..1024",
                            "batches": len(rust) - 1, "repeats": args.repeats}  # fmt: skip
    result["numpy_form"] = side_by_side(lambda _: numpy_budget_offsets(order, lengths, budget), ours, args)
    result["python_loop"] = side_by_side(
        lambda _: python_budget_offsets(order_list, lengths_list, budget), ours, args
    )
    print(_common.write(args.out, "sampler_budget", result, "Token-budget batches: the Rust cut against numpy "
        "and plain Python", f"""
{c["rows"]:,} examples with {c["lengths"]} (mean {c["mean_length"]:.1f}), one `torch.randperm` order, cut
into batches of at most {c["max_tokens_per_batch"]:,} tokens ({c["batches"]:,} batches). All three give the same
boundaries (checked before timing). Alternating runs, garbage collector off during each; medians of {c["repeats"]}.

| cut | other | Rust (`_native.token_budget_offsets`) | speed-up |
| --- | --- | --- | --- |
{row("simplest numpy form (one `searchsorted` per batch)", result["numpy_form"], "", 2)}
{row("plain Python loop over the examples", result["python_loop"], "", 2)}
"""))  # fmt: skip


def side_by_side(reference, ours, args, repeats: int | None = None, items: int | None = None) -> dict:
    """Reference and fasttrain alternating; their wall times, medians, items/s and the speed-up."""
    times = _common.alternate(repeats or args.repeats, {"reference": reference, "fasttrain": ours})
    out = {f"{side}_s": [wall for wall, _ in t] for side, t in times.items()}
    for side, t in times.items():
        out[f"{side}_median_s"] = _common.median_s(t)
        out[f"{side}_items_per_s"] = (items or args.rows) / out[f"{side}_median_s"]
    out["speedup"] = out["reference_median_s"] / out["fasttrain_median_s"]
    return out


def row(name: str, d: dict, unit: str, digits: int = 1) -> str:
    def cell(side: str, digits: int) -> str:
        rate = f" ({d[f'{side}_items_per_s']:,.0f} {unit}/s)" if unit else ""
        return f"{d[f'{side}_median_s'] * 1e3:,.{digits}f} ms{rate}"

    return f"| {name} | {cell('reference', digits)} | {cell('fasttrain', 2)} | {d['speedup']:,.1f}x |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.int_options(parser, rows=1_000_000, batch_size=8, min_length=16, max_length=512, seed=0)
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
    parser.add_argument("--out", type=Path, default=_common.RESULTS)
    parser.add_argument("--budget-only", action="store_true", help="only the token-budget batches")
    parser.add_argument("--max-tokens", type=int, default=4096, help="token budget of --budget-only")
    args = parser.parse_args()
    if args.budget_only:
        budget_main(args)
        return
    result = _common.new_result("sampler", "pyarrow", "numpy")
    ds = build_dataset(args.rows, args.min_length, args.max_length, args.seed)
    bs = args.batch_size

    # --- start-up: lengths from the dataset ---
    startup_ds = ds if args.startup_rows is None else ds.select(range(args.startup_rows))
    startup_rows = len(startup_ds)
    ours = LengthGroupedSampler(bs, dataset=startup_ds)
    assert ours.lengths.tolist() == list(RefSampler(bs, dataset=startup_ds).lengths), "lengths differ"
    startup = side_by_side(
        lambda _: RefSampler(bs, dataset=startup_ds),
        lambda _: LengthGroupedSampler(bs, dataset=startup_ds),
        args,
        args.startup_repeats,
        startup_rows,
    )
    # fasttrain's start-up on all rows too (it is what a user pays), when the reference ran on a subset.
    our_full_startup = _common.alternate(
        args.repeats, {"all": lambda _: LengthGroupedSampler(bs, dataset=ds)}
    )

    # --- one epoch of indices, same lengths and seed on both sides ---
    ours = LengthGroupedSampler(bs, dataset=ds, generator=torch.Generator().manual_seed(args.seed))
    ref_lengths = ours.lengths.tolist()  # what transformers' sampler holds: a list of Python ints
    ref = RefSampler(bs, lengths=ref_lengths, generator=torch.Generator().manual_seed(args.seed))
    assert list(ours) == list(ref), "orders differ"
    g_ref, g_ours, g_numpy = (torch.Generator().manual_seed(seed) for seed in (1, 1, 2))
    ours_indices = lambda _: length_grouped_indices(ours.lengths, bs, generator=g_ours)  # noqa: E731
    indices = side_by_side(
        lambda _: get_length_grouped_indices(ref_lengths, bs, generator=g_ref), ours_indices, args
    )
    epoch = side_by_side(lambda _: list(ref), lambda _: list(ours), args)
    g_ours.manual_seed(2)
    assert np.array_equal(numpy_grouped_indices(ours.lengths, bs, g_numpy), ours_indices(0)), (
        "numpy form differs"
    )
    numpy_form = side_by_side(lambda _: numpy_grouped_indices(ours.lengths, bs, g_numpy), ours_indices, args)

    c = result["config"] = {"rows": args.rows, "startup_rows": startup_rows, "batch_size": bs,
                            "length_range": [args.min_length, args.max_length], "mean_length": float(ours.lengths.mean()),
                            "repeats": args.repeats, "startup_repeats": args.startup_repeats,
                            "torch_threads": torch.get_num_threads()}  # fmt: skip
    result.update(
        startup=startup,
        startup_fasttrain_all_rows_median_s=_common.median_s(our_full_startup["all"]),
        indices=indices,
        epoch_as_python_ints=epoch,
        numpy_form=numpy_form,
    )
    subset = (
        ""
        if c["startup_rows"] == c["rows"]
        else f" The reference start-up was timed on the first {c['startup_rows']:,} rows only."
    )
    print(_common.write(args.out, "sampler", result, "Length-grouped sampler: transformers vs fasttrain", f"""
A `datasets.Dataset` of {c["rows"]:,} rows, list column `input_ids` with lengths uniform in
[{c["length_range"][0]}, {c["length_range"][1]}] (mean {c["mean_length"]:.1f}), no `length` column; batch size {c["batch_size"]}.
Reference and fasttrain alternate (garbage collector run before and off during each timed call); medians of {c["startup_repeats"]} (start-up) and {c["repeats"]} (indices) runs.
Both sides give the same lengths and the same index order (checked before timing).{subset}

| measurement | transformers | fasttrain | speed-up |
| --- | --- | --- | --- |
{row("start-up: sampler from the dataset (lengths)", startup, "rows")}
{row("one epoch of indices (list vs int64 array)", indices, "indices")}
{row("one epoch as Python ints (`list(sampler)`)", epoch, "indices")}
{row("one epoch of indices: the simplest numpy form (stable argsort) vs Rust", numpy_form, "indices")}

- Start-up: transformers runs `len(example["input_ids"])` over every row (what the Trainer does without a
  `length` column); fasttrain reads the list lengths from the Arrow offsets. fasttrain on all {c["rows"]:,} rows:
  {result["startup_fasttrain_all_rows_median_s"] * 1e3:.2f} ms.
- Indices: the order is fixed by `torch.randperm(n, generator)`, drawn by torch on both sides; fasttrain
  groups the permutation in Rust (one thread, radix sort). The last row puts the simplest numpy form of the
  same grouping (one stable `argsort`, "transformers" column) beside the Rust one.
- The machine is shared: see the load average above; each figure is a median of alternating runs.
"""))  # fmt: skip


if __name__ == "__main__":
    main()
