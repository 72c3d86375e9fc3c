"""Type stub for the native module ``fasttrain._native`` (Rust, PyO3)."""

import numpy as np
import numpy.typing as npt

__version__: str

# --- collate --- (rust/collate/python.rs)

def read_rows(
    rows: list[object], key: str, indices: list[int] | None = None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(values, lengths) of token sequences (lists, tuples, integer numpy arrays, torch tensors), both int64.

    TypeError/ValueError name example `indices[i]` (default `i`) and `key`.
    """

def pad_rows(
    values: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    *,
    width: int,
    pad_value: int,
    side: str,
    key: str,
) -> npt.NDArray[np.int64]:
    """The rows (values, lengths) padded to int64 [len(lengths), width] with `pad_value` on `side`.

    ValueError for a row longer than `width` (naming the example and `key`); MemoryError when the output
    cannot be allocated.
    """

def pack_padded(
    input_ids: npt.NDArray[np.int64],
    labels: npt.NDArray[np.int64],
    attention_mask: npt.NDArray[np.int64] | None = None,
) -> tuple[
    npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], str | None
]:
    """A padded causal-LM batch (int64 [rows, width] each) packed into one padding-free row: (input_ids, labels
    with each example's first token -100, position_ids restarting at each example, per-example lengths, None),
    or four empty arrays and why the batch must stay padded (a label that padding predicts or holds, a mask
    that is not one block of ones). ValueError for shapes that disagree (naming the key).
    """

# --- end collate ---

# --- sampler --- (rust/sampler/python.rs)

def length_grouped_indices(
    permutation: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    batch_size: int,
    mega_batch_mult: int | None = None,
) -> npt.NDArray[np.int64]:
    """transformers' get_length_grouped_indices given the permutation torch.randperm(len(lengths))."""

def token_budget_offsets(
    order: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    max_tokens: int,
    num_replicas: int = 1,
    drop_last: bool = False,
) -> npt.NDArray[np.int64]:
    """Boundaries of greedy token-budget batches of order (batch b is order[offsets[b]:offsets[b + 1]]),
    their count made a multiple of num_replicas by splitting the largest batches (or, with drop_last,
    by dropping trailing ones). ValueError for a zero budget or rank count, a negative length, an index
    out of range, or (without drop_last) too few examples to reach a multiple of num_replicas."""

# --- end sampler ---
