"""Example lengths for the length-grouped sampler, without a Python pass over the rows when possible.

For a ``datasets.Dataset`` the lengths come straight from Arrow: a precomputed ``length`` column is read
as a column, otherwise the list lengths of the model-input column come from its list offsets
(``pyarrow.compute.list_value_length``). Any other dataset falls back to transformers' per-row pass
``len(example[model_input_name])``, and says so once in the log.

The Trainer removes unused columns (``length`` included) before it builds its sampler, so to use a
precomputed ``length`` column call :func:`lengths_from_dataset` on the original dataset and pass the
result as ``lengths=``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._logging import log_once

DEFAULT_MODEL_INPUT_NAME = "input_ids"
DEFAULT_LENGTH_COLUMN = "length"

_INT64_MAX = np.iinfo(np.int64).max


def lengths_from_dataset(
    dataset: Any,
    model_input_name: str | None = None,
    length_column: str | None = DEFAULT_LENGTH_COLUMN,
) -> np.ndarray:
    """One int64 length per example of ``dataset``.

    ``datasets.Dataset``: the ``length_column`` if the dataset has it (pass ``None`` to ignore it), else the
    list lengths of ``model_input_name`` (default ``"input_ids"``) from the Arrow offsets; an indices mapping
    (after ``select``/``shuffle``/``filter``) is followed. Anything else: ``len(example[model_input_name])``
    for each example, as transformers' ``LengthGroupedSampler`` does.

    Raises ValueError for a missing column, a null list, a non-integer or negative length.
    """
    name = model_input_name if model_input_name is not None else DEFAULT_MODEL_INPUT_NAME
    if is_hf_dataset(dataset):
        if length_column is not None and length_column in dataset.column_names:
            return _arrow_length_column(dataset, length_column)
        lengths = _arrow_list_lengths(dataset, name)
        if lengths is not None:
            return lengths
    return _per_row_lengths(dataset, name)


def lengths_from_column(column: Any) -> np.ndarray | None:
    """Lengths held in a ``datasets`` ``Column`` (what ``dataset["length"]`` returns), read as Arrow.

    Returns None when ``column`` is not a top-level column of a ``datasets.Dataset`` (the caller then
    converts it as any other sequence).
    """
    try:
        from datasets.arrow_dataset import Column
    except ImportError:  # pragma: no cover - datasets is a dependency
        return None
    if not isinstance(column, Column) or not is_hf_dataset(column.source):
        return None
    if column.source._format_type == "custom":  # a transform may rewrite values: read them as formatted
        return None
    return _arrow_length_column(column.source, column.column_name)


def as_length_array(lengths: Any, what: str = "lengths") -> np.ndarray:
    """``lengths`` (list, numpy array, torch tensor, Arrow array, datasets Column) as a contiguous int64 array.

    Raises ValueError for anything that is not a 1-D sequence of non-negative integers (bools and floats
    included: a length is a count), naming the first bad entry.
    """
    from_column = lengths_from_column(lengths)
    if from_column is not None:
        return from_column
    if _is_torch_tensor(lengths):
        lengths = lengths.detach().cpu().numpy()
    elif hasattr(lengths, "to_numpy") and _is_arrow(lengths):
        lengths = _arrow_to_int64(lengths, what)
    try:
        array = np.asarray(lengths)
    except (ValueError, TypeError, OverflowError) as err:
        raise ValueError(f"{what} must be a 1-D sequence of integers: {err}") from None
    if array.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {array.shape}")
    if array.dtype.kind == "u":
        if array.size and array.max() > _INT64_MAX:
            bad = int(np.argmax(array > _INT64_MAX))
            raise ValueError(f"{what}[{bad}] = {array[bad]} does not fit in int64")
    elif array.dtype.kind != "i":
        if array.size == 0:
            return np.zeros(0, dtype=np.int64)
        raise ValueError(_non_integer_message(lengths, array, what))
    array = np.ascontiguousarray(array, dtype=np.int64)
    if array.size and array.min() < 0:
        bad = int(np.argmax(array < 0))
        raise ValueError(f"{what} must be non-negative, but {what}[{bad}] = {array[bad]}")
    return array


def _non_integer_message(original: Any, array: np.ndarray, what: str) -> str:
    # Only on the error path: find the first entry that is not an integer, to name it.
    values = original if isinstance(original, Sequence) else array.tolist()
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            return f"{what} must be integers, but {what}[{i}] = {value!r} ({type(value).__name__})"
        if not -(2**63) <= value <= _INT64_MAX:
            return f"{what}[{i}] = {value} does not fit in int64"
    return f"{what} must be integers, got an array of dtype {array.dtype}"


def is_hf_dataset(obj: Any) -> bool:
    """Whether ``obj`` is a ``datasets.Dataset`` (Arrow-backed: its lengths are read from the offsets)."""
    try:
        from datasets import Dataset
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False
    return isinstance(obj, Dataset)


def _is_torch_tensor(obj: Any) -> bool:
    torch = __import__("sys").modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_arrow(obj: Any) -> bool:
    import pyarrow as pa

    return isinstance(obj, (pa.Array, pa.ChunkedArray))


def _column(dataset: Any, name: str):
    """The Arrow column ``name`` of a ``datasets.Dataset``, in table order (see ``_in_row_order``)."""
    if name not in dataset.column_names:
        raise ValueError(
            "Can only automatically infer lengths for datasets whose items are dictionaries with an "
            f"'{name}' key; the dataset's columns are {dataset.column_names}"
        )
    return dataset.data.column(name)


def _in_row_order(dataset: Any, values: Any):
    """``values`` (one per table row) in dataset row order: after ``select``/``shuffle``/``filter`` a
    dataset reads its table through an indices mapping."""
    import pyarrow.compute as pc

    indices = dataset._indices
    return values if indices is None else pc.take(values, indices.column(0))


def _arrow_length_column(dataset: Any, name: str) -> np.ndarray:
    return _arrow_to_int64(_in_row_order(dataset, _column(dataset, name)), f"column '{name}'")


def _arrow_to_int64(values: Any, what: str) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_integer(values.type):
        raise ValueError(f"{what} must hold integer lengths, got Arrow type {values.type}")
    _raise_on_null(values, what)
    if pa.types.is_uint64(values.type) and len(values) and pc.max(values).as_py() > _INT64_MAX:
        raise ValueError(f"{what} holds a length that does not fit in int64")
    array = np.ascontiguousarray(_to_numpy(values.cast(pa.int64())), dtype=np.int64)
    if array.size and array.min() < 0:
        bad = int(np.argmax(array < 0))
        raise ValueError(f"{what} must hold non-negative lengths, but row {bad} has {array[bad]}")
    return array


def _arrow_list_lengths(dataset: Any, name: str) -> np.ndarray | None:
    """List lengths of column ``name`` from its offsets; None if the column is not an Arrow list."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if dataset._format_type == "custom":
        return None  # a formatting transform may change what len(example[name]) is
    if name in dataset.column_names:
        kind = dataset.data.column(name).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
            return None
    # Lengths first, then the row order: taking the lengths moves 8 bytes a row, not the lists.
    lengths = _in_row_order(dataset, pc.list_value_length(_column(dataset, name)))
    _raise_on_null(lengths, f"column '{name}'")  # a null list has a null length
    return np.ascontiguousarray(_to_numpy(lengths.cast(pa.int64())), dtype=np.int64)


def _raise_on_null(values: Any, what: str) -> None:
    import pyarrow.compute as pc

    if values.null_count:
        row = pc.index(pc.is_null(values), True).as_py()
        raise ValueError(f"{what} is null at row {row}: cannot take its length")


def _to_numpy(values: Any) -> np.ndarray:
    import pyarrow as pa

    if isinstance(values, pa.ChunkedArray):
        if values.num_chunks == 0:
            return np.zeros(0, dtype=np.int64)
        values = values.combine_chunks()
    return values.to_numpy(zero_copy_only=False)


def _per_row_lengths(dataset: Any, name: str) -> np.ndarray:
    """transformers' own pass: ``len(example[name])`` for every example (slow: Python per row)."""
    first = dataset[0] if len(dataset) else None
    if first is not None and (not isinstance(first, Mapping) or name not in first):
        raise ValueError(
            "Can only automatically infer lengths for datasets whose items are dictionaries with an "
            f"'{name}' key."
        )
    log_once(
        f"sampler-per-row-lengths-{type(dataset).__name__}",
        f"fasttrain sampler: reading lengths with a per-row Python pass over a {type(dataset).__name__} "
        "(only a datasets.Dataset with a list column or a length column is read from Arrow directly)",
    )
    return as_length_array([len(example[name]) for example in dataset], f"lengths of '{name}'")
