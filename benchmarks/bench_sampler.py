"""Length-grouped sampler: transformers' path vs fasttrain's, side by side on one 1M-row datasets.Dataset.

Writes sampler.{json,md}. How it measures (start-up, one epoch): docs/method.md, "Length-grouped sampler".

    python benchmarks/bench_sampler.py            # 1M rows (about 2 minutes on 2 cores)
    python benchmarks/bench_sampler.py --rows 20000 --repeats 2 --out /tmp   # smoke run
"""

from __future__ import annotations

import statistics

import datasets
import numpy as np
import pyarrow as pa
import torch
from transformers.trainer_pt_utils import LengthGroupedSampler as RefSampler
from transformers.trainer_pt_utils import get_length_grouped_indices

import _common
from fasttrain.data.sampler import LengthGroupedSampler, length_grouped_indices


def build_dataset(rows: int, min_length: int, max_length: int, seed: int) -> datasets.Dataset:
    """A datasets.Dataset with one list<int32> column `input_ids` of random lengths, built from offsets."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_length, max_length + 1, size=rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    # Token values do not matter to either side; tile a random block instead of drawing ~10^8 numbers.
    values = np.resize(rng.integers(0, 32_000, size=1 << 20, dtype=np.int32), int(offsets[-1]))
    small = offsets[-1] < 2**31  # list<int32> has int32 offsets; a longer column needs large_list
    kind, offsets = (pa.ListArray, offsets.astype(np.int32)) if small else (pa.LargeListArray, offsets)
    column = kind.from_arrays(pa.array(offsets), pa.array(values))
    return datasets.Dataset(pa.table({"input_ids": column}))


def side_by_side(reference, ours, args, repeats: int | None = None) -> dict:
    """Reference and fasttrain alternating; their wall times, medians, items/s and the speed-up."""
    times = _common.alternate(repeats or args.repeats, {"reference": reference, "fasttrain": ours})
    out = {f"{side}_s": [wall for wall, _ in t] for side, t in times.items()}
    for side in times:
        out[f"{side}_median_s"] = statistics.median(out[f"{side}_s"])
        out[f"{side}_items_per_s"] = args.rows / out[f"{side}_median_s"]
    out["speedup"] = out["reference_median_s"] / out["fasttrain_median_s"]
    return out


def row(name: str, d: dict, unit: str) -> str:
    def cell(side: str, digits: int) -> str:
        return f"{d[f'{side}_median_s'] * 1e3:,.{digits}f} ms ({d[f'{side}_items_per_s']:,.0f} {unit}/s)"

    return f"| {name} | {cell('reference', 1)} | {cell('fasttrain', 2)} | {d['speedup']:,.1f}x |"


def main() -> None:
    parser = _common.parser(__doc__)
    _common.int_options(parser, rows=1_000_000, batch_size=8, min_length=16, max_length=512, seed=0)
    parser.add_argument("--repeats", type=int, default=7, help="repetitions of the indices measurements")
    parser.add_argument("--startup-repeats", type=int, default=3, help="repetitions of the start-up timing")
    args = parser.parse_args()
    result = _common.new_result("sampler", "pyarrow", "numpy")
    ds = build_dataset(args.rows, args.min_length, args.max_length, args.seed)
    bs = args.batch_size

    assert LengthGroupedSampler(bs, dataset=ds).lengths.tolist() == list(RefSampler(bs, dataset=ds).lengths)
    ours_startup = lambda _: LengthGroupedSampler(bs, dataset=ds)  # noqa: E731
    startup = side_by_side(lambda _: RefSampler(bs, dataset=ds), ours_startup, args, args.startup_repeats)
    ours = LengthGroupedSampler(bs, dataset=ds, generator=torch.Generator().manual_seed(args.seed))
    ref_lengths = ours.lengths.tolist()  # what transformers' sampler holds: a list of Python ints
    ref = RefSampler(bs, lengths=ref_lengths, generator=torch.Generator().manual_seed(args.seed))
    assert list(ours) == list(ref), "orders differ"
    g_ref, g_ours = (torch.Generator().manual_seed(1) for _ in range(2))
    indices = side_by_side(
        lambda _: get_length_grouped_indices(ref_lengths, bs, generator=g_ref),
        lambda _: length_grouped_indices(ours.lengths, bs, generator=g_ours),
        args,
    )
    epoch = side_by_side(lambda _: list(ref), lambda _: list(ours), args)

    c = result["config"] = {"rows": args.rows, "batch_size": bs,
                            "length_range": [args.min_length, args.max_length], "mean_length": float(ours.lengths.mean()),
                            "repeats": args.repeats, "startup_repeats": args.startup_repeats,
                            "torch_threads": torch.get_num_threads()}  # fmt: skip
    result.update(startup=startup, indices=indices, epoch_as_python_ints=epoch)
    print(_common.write(args.out, "sampler", result, "Length-grouped sampler: transformers vs fasttrain", f"""
A `datasets.Dataset` of {c["rows"]:,} rows, list column `input_ids` with lengths uniform in
[{c["length_range"][0]}, {c["length_range"][1]}] (mean {c["mean_length"]:.1f}), no `length` column; batch size {c["batch_size"]}.
Reference and fasttrain alternate (garbage collector run before and off during each timed call); medians of {c["startup_repeats"]} (start-up) and {c["repeats"]} (indices) runs.
Both sides give the same lengths and the same index order (checked before timing).

| measurement | transformers | fasttrain | speed-up |
| --- | --- | --- | --- |
{row("start-up: sampler from the dataset (lengths)", startup, "rows")}
{row("one epoch of indices (list vs int64 array)", indices, "indices")}
{row("one epoch as Python ints (`list(sampler)`)", epoch, "indices")}

- Start-up: transformers runs `len(example["input_ids"])` over every row (what the Trainer does without a
  `length` column); fasttrain reads the list lengths from the Arrow offsets.
- Indices: the order is fixed by `torch.randperm(n, generator)`, drawn by torch on both sides; fasttrain
  groups the permutation in Rust (one thread, radix sort).
- The machine is shared: see the load average above; each figure is a median of alternating runs.
"""))  # fmt: skip


if __name__ == "__main__":
    main()
