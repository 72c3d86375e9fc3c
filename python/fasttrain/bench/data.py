"""Training examples for the bench: the same token ids, in the same order, for every contender
(``build_examples``; docs/method.md, "Data"). Streamed lengths put an end-of-text token between two documents.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable

from . import corpus

DEFAULT = "default"
# --lengths: the data's own lengths, or drawn from a log-normal distribution like instruction data
NATURAL = "natural"
LOGNORMAL = "lognormal"
# every example exactly seq_len tokens of the stream: the length frontier (bench/frontier.py) trains on these
FULL = "full"
LENGTH_KINDS = (NATURAL, LOGNORMAL, FULL)
LOGNORMAL_MEDIAN = 180  # tokens; instruction/chat SFT sets have medians of a few hundred tokens
LOGNORMAL_SIGMA = 0.8  # with median 180: mean ~250, about 1 example in 100 above 1,024 tokens
MIN_TOKENS = 16  # shorter documents (empty lines, stubs) carry no signal and are skipped
_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


class DatasetError(ValueError):
    """A ``--dataset`` that cannot be read; the message is shown to the user as is."""


def check_dataset_spec(spec: str) -> None:
    """Fail early, in the parent process, on a ``--dataset`` that cannot work."""
    if spec == DEFAULT:
        return
    from .models import hub_offline, looks_like_local_path

    path = pathlib.Path(spec).expanduser()
    kind = _LOCAL_FORMATS.get(path.suffix.lower())
    if not (kind or looks_like_local_path(spec)):
        if hub_offline():
            raise DatasetError(
                f"--dataset {spec!r} is a hub dataset but HF_HUB_OFFLINE is set; use a local file"
            )
    elif not path.is_file():
        raise DatasetError(f"--dataset {spec!r}: no such file")
    elif not kind:
        raise DatasetError(
            f"--dataset {spec!r}: unsupported file type {path.suffix!r} (use .json, .jsonl, .parquet or .txt)"
        )
    elif kind != "text":
        # the columns too, before any model is built (a .txt file always gives `text`), without datasets'
        # progress bars (the error must stay one line); datasets caches the load for the workers
        from datasets.utils import logging as datasets_logging

        was_on = datasets_logging.is_progress_bar_enabled()
        datasets_logging.disable_progress_bar()
        try:
            _check_columns(spec, _load_rows(spec).column_names)
        finally:
            if was_on:
                datasets_logging.enable_progress_bar()


def _check_columns(spec: str, columns: list[str]) -> None:
    if "text" not in columns and "input_ids" not in columns:
        raise DatasetError(
            f"--dataset {spec!r} has no 'text' or 'input_ids' column (columns: {', '.join(columns)})"
        )


def _load_rows(spec: str):
    """A ``datasets.Dataset`` for a local file or a hub dataset (train split)."""
    import datasets

    path = pathlib.Path(spec).expanduser()
    try:
        if path.is_file():
            builder = _LOCAL_FORMATS[path.suffix.lower()]
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        return datasets.load_dataset(spec, split="train")
    # datasets raises many types (DatasetNotFoundError, ArrowInvalid, ConnectionError ...)
    except Exception as exc:
        raise DatasetError(f"--dataset {spec!r} could not be loaded: {type(exc).__name__}: {exc}") from None


def _token_blocks(spec: str, tokenizer) -> Iterable[list[list[int]]]:
    """Every document of the data, tokenized whole (no truncation): a stdlib file as its top-level blocks' ids,
    a row of a dataset as one block."""
    if spec == DEFAULT:
        for document in corpus.iter_documents():
            yield tokenizer(corpus.top_level_blocks(document), add_special_tokens=False)["input_ids"]
        return
    rows = _load_rows(spec)
    if "input_ids" in rows.column_names:  # already tokenized: used as is
        yield from ([list(row)] for row in rows["input_ids"])
        return
    _check_columns(spec, rows.column_names)
    for text in rows["text"]:
        if isinstance(text, str) and text.strip():
            yield [tokenizer(text, add_special_tokens=False)["input_ids"]]


def _chunk_blocks(block_ids: list[list[int]], seq_len: int) -> Iterable[list[int]]:
    """Consecutive blocks of one file joined while they fit in ``seq_len``; a longer block is truncated alone."""
    current: list[int] = []
    for ids in block_ids:
        if len(ids) >= seq_len:
            if current:
                yield current
                current = []
            yield ids[:seq_len]
        elif len(current) + len(ids) > seq_len:
            yield current
            current = list(ids)
        else:
            current.extend(ids)
    if current:
        yield current


def _natural_examples(spec: str, tokenizer, seq_len: int, num_examples: int) -> list[list[int]]:
    """Each document truncated to ``seq_len``; a stdlib file's blocks joined while they fit (``_chunk_blocks``)."""
    examples: list[list[int]] = []
    for blocks in _token_blocks(spec, tokenizer):
        examples.extend(ids for ids in _chunk_blocks(blocks, seq_len) if len(ids) >= MIN_TOKENS)
        if len(examples) >= num_examples:
            break
    return examples[:num_examples]


def describe_lognormal(upper: int | str, lower: int = MIN_TOKENS) -> str:
    """The lengths ``lognormal_lengths`` draws, said from its parameters. Clipping keeps order, so the clipped
    lengths' median is the clipped median: a limit below ``LOGNORMAL_MEDIAN`` moves it (``upper`` may be a name)."""
    drawn = f"median {LOGNORMAL_MEDIAN}, sigma {LOGNORMAL_SIGMA}"
    if isinstance(upper, str):
        return f"log-normal lengths ({drawn}, clipped to {lower}..{upper})"
    median = min(max(LOGNORMAL_MEDIAN, lower), upper)
    if median == LOGNORMAL_MEDIAN:
        return f"log-normal lengths ({drawn}, {lower}..{upper} tokens)"
    return f"log-normal lengths (median {median}: {drawn}, clipped to {lower}..{upper} tokens)"


def lognormal_lengths(count: int, seq_len: int, seed, lower: int = MIN_TOKENS) -> list[int]:
    """``count`` lengths from the log-normal distribution of ``--lengths lognormal``, in ``lower..seq_len``;
    ``seed`` is anything ``numpy.random.default_rng`` takes."""
    import numpy as np

    drawn = np.random.default_rng(seed).lognormal(np.log(LOGNORMAL_MEDIAN), LOGNORMAL_SIGMA, size=count)
    return np.clip(np.rint(drawn), lower, max(seq_len, lower)).astype(np.int64).tolist()


def _stream_examples(spec: str, tokenizer, lengths: list[int]) -> list[list[int]]:
    """Examples of the given lengths, cut one after another from the data read as one token stream."""
    num_examples = len(lengths)
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    examples: list[list[int]] = []
    stream: list[int] = []
    for blocks in _token_blocks(spec, tokenizer):
        stream.extend([token for ids in blocks for token in ids] + separator)
        start = 0
        while len(examples) < num_examples and len(stream) - start >= lengths[len(examples)]:
            end = start + lengths[len(examples)]
            examples.append(stream[start:end])
            start = end
        stream = stream[start:]
        if len(examples) == num_examples:
            break
    return examples


def build_examples(
    spec: str, tokenizer, seq_len: int, num_examples: int, lengths: str = NATURAL, seed: int = 0
) -> list[list[int]]:
    """``num_examples`` token-id lists of ``MIN_TOKENS..seq_len`` tokens (fewer only if the data runs out);
    ``lengths`` is ``"natural"`` (each document truncated), ``"lognormal"`` (drawn lengths, ``seed``) or ``"full"``
    (every example ``seq_len`` tokens)."""
    if lengths == LOGNORMAL:
        return _stream_examples(spec, tokenizer, lognormal_lengths(num_examples, seq_len, seed))
    if lengths == FULL:
        return _stream_examples(spec, tokenizer, [seq_len] * num_examples)
    if lengths != NATURAL:
        raise DatasetError(f"--lengths must be one of {', '.join(LENGTH_KINDS)}, got {lengths!r}")
    return _natural_examples(spec, tokenizer, seq_len, num_examples)
