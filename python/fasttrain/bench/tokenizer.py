"""The built-in tokenizer: a byte-level BPE trained locally on the stdlib corpus in a few seconds, cached under
``~/.cache/fasttrain/tokenizers/<key>/`` (``FASTTRAIN_CACHE`` overrides the root; the key: ``_cache_key``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from . import corpus

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
DEFAULT_VOCAB_SIZE = 8192
# About 4 MB of source: enough for merges that look like real code, small enough to train in seconds.
DEFAULT_TRAIN_BYTES = 4_000_000


def _cache_key(files: list[pathlib.Path], vocab_size: int) -> str:
    """Hash of the settings and of each training file's path, size and mtime (cheap: no file is read)."""
    digest = hashlib.sha256()
    settings = dict(vocab_size=vocab_size, tokenizers=tokenizers.__version__, eos=EOS_TOKEN, pad=PAD_TOKEN)
    digest.update(json.dumps(settings, sort_keys=True).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:16]


def load_or_train(
    vocab_size: int = DEFAULT_VOCAB_SIZE, train_bytes: int = DEFAULT_TRAIN_BYTES
) -> tuple[pathlib.Path, bool]:
    """Path of the cached ``tokenizer.json`` (trained now if absent) and whether it came from the cache."""
    files = corpus.leading_files(train_bytes)
    root = pathlib.Path(os.environ.get("FASTTRAIN_CACHE") or pathlib.Path.home() / ".cache" / "fasttrain")
    directory = root / "tokenizers" / _cache_key(files, vocab_size)
    path = directory / "tokenizer.json"
    if path.is_file():
        return path, True
    texts = corpus.read_texts(files)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    directory.mkdir(parents=True, exist_ok=True)
    # Write then rename: two processes training at once each leave a whole file, never half of one.
    partial = directory / f"tokenizer.json.{os.getpid()}.partial"
    tok.save(str(partial))
    partial.replace(path)
    return path, False


def as_transformers_tokenizer(path: pathlib.Path):
    """The cached tokenizer wrapped as a ``PreTrainedTokenizerFast`` (what transformers collators expect)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, padding_side="right"
    )
