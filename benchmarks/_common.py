"""What the scripts under benchmarks/ share: the provenance each result records (date, machine, versions,
command), a garbage-collector pause for timed calls, and a word-level stand-in tokenizer.

The scripts' own module, imported as ``import _common`` (Python puts a script's folder first on ``sys.path``).
It is not fasttrain's: ``fasttrain.bench`` is the product behind ``fasttrain bench`` and free to change, so
nothing here imports it (tests/test_bench_scripts.py checks that no script does).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import importlib.metadata
import platform
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what ``platform`` knows."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def utc_now() -> str:
    """'2026-12-02T05:00:58+00:00': when a result was measured."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def command() -> str:
    """The command that produced a result, as one would retype it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):  # a script outside the repository keeps its path as given
        script = script.relative_to(ROOT)
    return shlex.join(["python", str(script), *sys.argv[1:]])


def versions(*packages: str) -> dict[str, str | None]:
    """Python's version and each installed package's (None where it is not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The garbage collector run before and off during a timed call, as timeit does: otherwise a collection
    of one side's garbage lands on whichever side allocates next."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def word_level_tokenizer(vocab: int = 100):
    """A ``PreTrainedTokenizerFast`` over the words ``t2 .. t{vocab-1}`` (pad 0, unk 1): what collators need
    (a pad id, a padding side) without a tokenizer download; the benchmarks feed token ids, not text."""
    import tokenizers
    import transformers

    words = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
