"""What every native collator shares: token rows read and padded in Rust, widths by the reference's arithmetic.

A batch of one key is ``Rows``: all values flat (int64) and one length per example, read from Python lists,
tuples, integer numpy arrays or torch tensors by ``_native.read_rows`` (errors name the example and the key).
Widths follow the arithmetic of the class being replaced, computed here with Python integers exactly as it
computes them (so negative, zero and huge settings behave as there); the padded output is sized by a user's
number, so it is checked against the machine's memory first (a MemoryError naming the settings, as the
reference's own Python lists would raise) and Rust allocates it fallibly (never an abort).
"""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import _native
from .._logging import log_once

_INT64 = (-(2**63), 2**63 - 1)


class HandOver(Exception):
    """This batch needs the reference class's own code (the message says why)."""


def hand_over(collator: object, why: HandOver) -> None:
    """Log once that ``collator`` hands this kind of batch to the class it replaces."""
    name = type(collator).__name__
    log_once(
        f"collate-handover:{type(collator).__module__}.{name}:{why}",
        f"fasttrain.{name}: {why}; this case runs through the reference {name} (logged once)",
    )


def native_or_reference(
    collator: object,
    native: Callable[..., Any],
    reference: Callable[..., Any],
    *args: Any,
    refusal: Callable[[Any], str | None] | None = None,
) -> Any:
    """``native(*args)``, the batch made in Rust, unless ``refusal(collator)`` (the agreement probe) says the class
    replaced must make every batch, or the native path hands this batch over (logged once): then
    ``reference(*args)``, the replaced class's own method."""
    if refusal is not None and refusal(collator) is not None:
        return reference(*args)
    try:
        return native(*args)
    except HandOver as why:
        hand_over(collator, why)
        return reference(*args)


class Rows(NamedTuple):
    values: np.ndarray  # int64 [sum(lengths)]
    lengths: np.ndarray  # int64 [examples]

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.lengths) - self.lengths


def read(values: list, key: str, indices: Sequence[int] | None = None) -> Rows:
    """One example's sequence per entry of ``values``; errors name example ``indices[i]`` (default ``i``)."""
    return Rows(*_native.read_rows(values, key, None if indices is None else list(indices)))


def column(features: Sequence[Any], key: str, indices: Sequence[int] | None = None) -> list:
    """``[f[key] for f in features]`` with a KeyError (or TypeError) that names the example."""
    try:
        return [f[key] for f in features]
    except (KeyError, TypeError, IndexError) as err:
        failure = err
    for i, f in enumerate(features):
        where = i if indices is None else indices[i]
        if not isinstance(f, Mapping):
            raise TypeError(f"example {where} is a {type(f).__name__}, expected a mapping (dict) of features")
        if key not in f:
            raise KeyError(f"example {where} has no key '{key}'")
    raise failure  # a mapping that has the key and still failed to give it: its own error


def as_example_list(features: Any) -> list:
    if isinstance(features, list):
        return features
    if isinstance(features, tuple):
        return list(features)
    raise HandOver(f"features is a {type(features).__name__}, not a list of examples")


def example_mappings(features: Any) -> list:
    """The batch as a non-empty list of mappings: an empty batch is an error (as in the classes replaced),
    anything else (a tuple is fine) is handed over to them."""
    features = as_example_list(features)
    if not features:
        raise ValueError("cannot collate an empty batch (no examples)")
    if not isinstance(features[0], Mapping):
        raise HandOver(f"examples are {type(features[0]).__name__}, not mappings")
    return features


def round_up(length: int, multiple: Any, setting: str = "pad_to_multiple_of") -> int:
    """``length`` raised to a multiple of ``multiple``, as ``tokenizer._pad`` and TRL's ``pad`` compute it
    (``length + multiple - length % multiple`` when not aligned, with Python's floor arithmetic: a negative
    multiple gives a smaller length, which pads nothing)."""
    if multiple is None:
        return length
    if multiple == 0:
        raise ValueError(f"{setting} must not be 0 (the reference divides by it)")
    remainder = length % multiple
    return length if remainder == 0 else length + multiple - remainder


def uniform_width(lengths: np.ndarray, target: int | None) -> int | None:
    """The batch width when every row padded up to ``target`` (None: not padded; padding never truncates)
    has the same length, else None."""
    widths = {n if target is None or n >= target else target for n in lengths.tolist()}
    return widths.pop() if len(widths) == 1 else None


def ragged_error(lengths: np.ndarray, target: int | None, key: str) -> ValueError:
    """The error for a batch whose padded rows cannot form one tensor, naming the first culprit."""
    values = lengths.tolist()
    if target is None:
        i = next(i for i, n in enumerate(values) if n != values[0])
        return ValueError(
            f"example {i}: '{key}' has length {values[i]} but example 0 has length {values[0]}; "
            "with padding disabled every example must have the same length"
        )
    i = next(i for i, n in enumerate(values) if n > target)
    return ValueError(
        f"example {i}: '{key}' has length {values[i]}, longer than the padding length {target}; "
        "padding does not truncate (truncate when tokenizing or raise max_length)"
    )


def check_same_lengths(main: Rows, main_key: str, other: Rows, other_key: str) -> None:
    if not np.array_equal(main.lengths, other.lengths):
        i = int(np.flatnonzero(main.lengths != other.lengths)[0])
        raise ValueError(
            f"example {i}: '{other_key}' has length {other.lengths[i]} but '{main_key}' has length "
            f"{main.lengths[i]}"
        )


def int64_setting(value: Any, setting: str) -> int:
    """A token id from a setting (a pad id, a separator), checked to fit the int64 output."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{setting} must be an integer, got {value!r} ({type(value).__name__})") from None
    if not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{setting}={value} does not fit in int64")
    return value


@functools.cache
def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # pragma: no cover - not Linux/macOS: Rust's check remains
        return None


def pad(rows: Rows, width: int, value: int, side: str, key: str, settings: str) -> np.ndarray:
    """``rows`` padded to ``[examples, width]`` with ``value`` on ``side``. ``settings`` (e.g.
    ``"max_length=..., pad_to_multiple_of=..."``) names what chose the width, in a MemoryError.

    When no row needs padding the result is ``rows.values`` itself, reshaped: pad each ``Rows`` once.
    """
    if (rows.lengths == width).all():
        return rows.values.reshape(len(rows.lengths), width)
    need = len(rows.lengths) * width * 8
    memory = _physical_memory()
    if memory is not None and need > memory:
        raise MemoryError(
            f"padding '{key}' to {len(rows.lengths)} x {width} ({settings}) needs {need:,} bytes, more than "
            f"this machine's {memory:,} bytes of memory"
        )
    try:
        return _native.pad_rows(rows.values, rows.lengths, width=width, pad_value=value, side=side, key=key)
    except MemoryError as err:
        raise MemoryError(f"{err} ({settings})") from None


def mask(lengths: np.ndarray, width: int, side: str = "right") -> np.ndarray:
    """int64 ``[examples, width]``: 1 on each row's tokens, 0 on its padding (an attention mask).
    ``width`` was checked by ``pad`` for the same batch."""
    columns = np.arange(width)
    if side == "left":
        return (columns >= (width - lengths)[:, None]).astype(np.int64)
    return (columns < lengths[:, None]).astype(np.int64)


def positions(rows: Rows, start: int = 0) -> np.ndarray:
    """``start, start + 1, ...`` restarting at every row (flat, int64; only the lengths are used)."""
    total = int(rows.lengths.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(rows.starts, rows.lengths) + start
