"""What the scripts under benchmarks/ share, imported as ``import _common`` (a script's folder is first on
``sys.path``): writing a result (JSON + Markdown opening with ``fasttrain.bench.provenance``'s record), timing
contenders in turn, a tiny Qwen3 and an LM head's inputs, a torchrun launch on CPU, stand-in tokenizers and an
optimizer's state bytes. Of ``fasttrain.bench`` the scripts use only ``provenance``, ``roofline`` and ``corpus``
(tests/test_bench_scripts.py keeps it so): the rest is the ``fasttrain bench`` command's and free to change.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fasttrain.bench import corpus, provenance

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def new_result(benchmark: str, *packages: str) -> dict[str, Any]:
    """A result's opening: its name and the provenance (date, command, commit, machine, load, versions)."""
    return {"benchmark": benchmark, "provenance": provenance.record(*packages)}


def write(out: Path, stem: str, result: dict, title: str, body: str | list[str]) -> str:
    """``out/stem.json`` and ``out/stem.md`` (the title, the provenance's lines, then ``body``); the Markdown."""
    body = "\n".join(body) if isinstance(body, list) else body
    text = f"# {title}\n\n{provenance.markdown(result['provenance'])}\n\n{body.strip()}\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(text)
    print(f"wrote {out / stem}.json and .md", flush=True)
    return text


def alternate(rounds: int, contenders: dict[str, Callable[[int], Any]]) -> dict[str, list[tuple]]:
    """Each contender called in turn (round ``i`` passes ``i``), so that all see the same machine load; per call
    (wall seconds, the process's CPU seconds), the collector paused. CPU time leaves out the time a call spent
    descheduled, which dominates short calls on a loaded machine."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for i in range(rounds):
        for name, fn in contenders.items():
            with provenance.gc_paused():
                wall, cpu = time.perf_counter(), time.process_time()
                fn(i)
                times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def parser(doc: str, device: bool = False) -> argparse.ArgumentParser:
    """A script's options: its docstring for ``--help``, ``--out`` (the results' folder) and, asked for,
    ``--device``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS, help="the folder for the result files")
    if device:
        p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    return p


def int_options(parser, **defaults: int) -> list[str]:
    """``--name`` options of type int with their defaults; their names, for ``forwarded``."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default, metavar="N")
    return list(defaults)


def forwarded(args, names: list[str]) -> list[str]:
    """The command-line options that give a worker process the same ``names`` values."""
    return [item for name in names for item in ("--" + name.replace("_", "-"), str(getattr(args, name)))]


def time_collators(collators: dict, batches: list, calls: int, copy_rows: bool = False) -> dict:
    """Each collator's median (wall, CPU) seconds per call: one warm-up call each (first calls pay for imports and
    allocations), then ``calls`` calls in turn (``alternate``) cycling through ``batches``. ``copy_rows``: each call
    gets fresh shallow copies of its rows, made outside the timed call (LLaMA-Factory's collator pops keys)."""

    def rows(i: int) -> list[dict]:
        batch = batches[i % len(batches)]
        return [dict(row) for row in batch] if copy_rows else batch

    for collate in collators.values():
        collate(rows(0))
    inputs = {name: [rows(i) for i in range(calls)] for name in collators}
    contenders = {name: (lambda i, f=f, b=inputs[name]: f(b[i])) for name, f in collators.items()}
    times = alternate(calls, contenders)
    return {name: tuple(statistics.median(x) for x in zip(*t, strict=True)) for name, t in times.items()}


def batch_difference(a, b) -> str | None:
    """None when two collators' batches are the same (type, keys in order, dtypes, shapes, values), else how not."""
    import torch

    if type(a) is not type(b) or list(a.keys()) != list(b.keys()):
        return f"{type(a).__name__} {list(a.keys())} vs {type(b).__name__} {list(b.keys())}"
    for k in a.keys():  # noqa: SIM118 - BatchEncoding
        x, y = a[k], b[k]
        if isinstance(y, torch.Tensor) and (x.dtype, x.shape) != (y.dtype, y.shape):
            return f"{k}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}"
        if not (torch.equal(x, y) if isinstance(y, torch.Tensor) else x == y):
            return f"{k}: values differ"
    return None


def state_bytes(optimizer) -> int:
    """Bytes of an optimizer's state, step counters left out: a tensor subclass (torchao's) unpacked into its
    plain tensors, a tensor shared by several parameters counted once."""
    import torch

    def tensors(v) -> list:
        if type(v) is not torch.Tensor and hasattr(v, "__tensor_flatten__"):
            return [t for name in v.__tensor_flatten__()[0] for t in tensors(getattr(v, name))]
        return [v] if isinstance(v, torch.Tensor) else []

    held = [
        t for state in optimizer.state.values() for k, v in state.items() if k != "step" for t in tensors(v)
    ]
    return sum({(t.data_ptr(), t.numel()): t.numel() * t.element_size() for t in held}.values())


def tiny_qwen3(vocab: int, hidden: int, layers: int, seed: int = 0, **config: Any):
    """A Qwen3 at random initialisation (``seed``): 4 attention heads, 2 KV heads, MLP 3 x hidden unless
    ``config`` says otherwise."""
    import torch
    import transformers

    shape = dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, intermediate_size=3 * hidden
    )
    attn = config.pop("attn_implementation", None)
    qwen3 = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, pad_token_id=0,
                                     **{**shape, **config})  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(qwen3, attn_implementation=attn)


def lm_head_inputs(tokens: int, width: int, vocab: int, device: str = "cpu", dtype: str = "float32"):
    """Hidden states (tokens x width) and an LM head's weight (vocab x width, scaled by 0.02), both random and
    requiring a gradient, and random labels; from torch's global generator (seed it first)."""
    import torch

    dtype = getattr(torch, dtype)
    hidden = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, width, device=device, dtype=dtype).mul_(0.02).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, (tokens,), device=device)


def launcher_options(parser, engines: tuple[str, ...], *worker_names: str, **sizes: int) -> None:
    """A torchrun launcher's options: ``--engines`` (a comma list of ``engines``, checked), its int ``sizes``
    (their names in ``args.sizes``, for ``forwarded``) and, hidden, what its workers get besides:
    ``--worker``, ``--out-file`` and ``worker_names``."""

    def known(text: str) -> str:
        if unknown := set(text.split(",")) - set(engines):
            raise argparse.ArgumentTypeError(
                f"unknown engines {sorted(unknown)}; choose from {','.join(engines)}"
            )
        return text

    parser.add_argument("--engines", type=known, default=",".join(engines))
    parser.set_defaults(sizes=int_options(parser, **sizes))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--out-file", *worker_names):
        parser.add_argument(name, help=argparse.SUPPRESS)


def torchrun(script: str, world: int, args: list[Any], threads: int, timeout: float | None = None):
    """``script --worker ARGS --out-file FILE`` in ``world`` gloo processes (torchrun, a free port, ``threads``
    OpenMP threads each, DeepSpeed on its CPU accelerator, the CPU paths rather than the Triton interpreter):
    the JSON the workers wrote to FILE (None if none) and None, or why the launch failed."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-torchrun-"))  # also the workers' scratch (Trainer output)
    args = ["--worker", *args, "--out-file", scratch / "out.json"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu")
    env.pop("TRITON_INTERPRET", None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", port,
           script, *map(str, args)]  # fmt: skip
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        failure = done.returncode and f"exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    except subprocess.TimeoutExpired:
        failure = f"launch timed out after {timeout} s"
    written = json.loads((scratch / "out.json").read_text()) if (scratch / "out.json").exists() else None
    shutil.rmtree(scratch, ignore_errors=True)
    return written, failure or None


def worker_done(rank: int, out_file: str, written: Any) -> None:
    """A torchrun worker's end: rank 0 writes the JSON ``torchrun`` hands back; the ranks leave the group."""
    import torch.distributed as dist

    if rank == 0:
        Path(out_file).write_text(json.dumps(written))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def stdlib_bpe(vocab: int, train_bytes: int, special_tokens: list[str]):
    """A byte-level BPE of ``vocab`` tokens (``tokenizers.Tokenizer``) trained on the first ``train_bytes`` of
    ``fasttrain bench``'s corpus: its kind of tokenizer, trained here in seconds, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, size = [], 0
    for text in corpus.iter_documents():
        texts.append(text)
        size += len(text.encode())
        if size >= train_bytes:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=special_tokens, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def word_level_tokenizer(vocab: int = 100):
    """A ``PreTrainedTokenizerFast`` over the words ``t2 .. t{vocab-1}`` (pad 0, unk 1): what collators need
    (a pad id, a padding side) without a tokenizer download; the benchmarks feed token ids, not text."""
    import tokenizers
    import transformers

    words = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
