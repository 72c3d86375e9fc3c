"""The inputs of bench_clients.py: data, tokenizer and model, and what runs inside a client's own environment.

Two halves, so that nothing of it needs fasttrain:

- in fasttrain's .venv (bench_clients.py imports this module): the text of ``fasttrain bench``'s default data
  (the Python standard library's sources, example lengths log-normal with median 180 tokens, 16..512) as
  alpaca rows, and a byte-level BPE trained on the same sources (``fasttrain bench``'s 8,192 merges' worth,
  plus the ChatML special tokens both frameworks' templates write). The same numbers as python/fasttrain/bench/
  (corpus.py, tokenizer.py, data.py), copied: the benchmarks do not import the bench command's internals;
- in a client's environment, as a script (``python benchmarks/_clients.py COMMAND ...``), with that
  environment's torch, transformers and datasets: writing the model and tokenizer (so that they are saved by the
  transformers that loads them again), tokenizing LLaMA-Factory's dataset once with its own code, and reading
  back the token counts of a prepared dataset.
"""

from __future__ import annotations

import json
import os
import random
import sys
import sysconfig
from pathlib import Path

# python/fasttrain/bench/data.py: log-normal lengths, like instruction data; tokenizer.py: vocabulary, corpus size
LOGNORMAL_MEDIAN, LOGNORMAL_SIGMA, MIN_TOKENS = 180, 0.8, 16
TOKENIZER_VOCAB, TOKENIZER_TRAIN_BYTES = 8192, 4_000_000
QWEN3_VOCAB = 151_936
# Qwen3's pad token and ChatML markers (LLaMA-Factory's qwen3 template writes them; <|im_end|> is the EOS, as in
# Qwen3's tokenizer), and the empty thought that template puts before each answer (added tokens, not special).
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK = ("<think>", "</think>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# What each framework wraps around a row's instruction and output, to aim each row at its drawn length (the
# prepared dataset's real counts are what the results report). Axolotl: type alpaca (AlpacaPrompter, no input),
# then the EOS; LLaMA-Factory: the qwen3 template with its empty thought.
TEMPLATES = {
    "axolotl": "Below is an instruction that describes a task. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\n\n\n### Response:\n" + IM_END,
    "llamafactory": f"{IM_START}user\n{IM_END}\n{IM_START}assistant\n<think>\n\n</think>\n\n{IM_END}\n",
}
PROMPT_SHARE = 0.2  # of a row's own tokens, in the instruction; the rest is the output
# The model shapes (python/fasttrain/bench/models.py): hidden, layers, attention heads, KV heads, head dim, MLP
SHAPES = {
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072),
    "tiny": (32, 1, 2, 1, 16, 64),
}


# ------------------------------------------------------------------------------------- in fasttrain's .venv


def parameters(shape: str) -> int:
    """Parameters of a Qwen3 of ``shape`` with tied embeddings (bench/models.py's count)."""
    hidden, layers, heads, kv_heads, head_dim, intermediate = SHAPES[shape]
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads) + 2 * head_dim
    return QWEN3_VOCAB * hidden + layers * (attention + 2 * hidden + 3 * hidden * intermediate) + hidden


def stdlib_files() -> list[Path]:
    """Every stdlib ``.py`` file, sorted, then shuffled with seed 0 (bench/corpus.py's order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in {"site-packages", "dist-packages", "__pycache__"}]
        files.extend(Path(directory, name) for name in names if name.endswith(".py"))
    files.sort()
    random.Random(0).shuffle(files)
    return files


def documents():
    for path in stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) >= 64:
            yield text


def train_tokenizer(path: Path) -> None:
    """The byte-level BPE, trained on the corpus's first 4 MB, written to ``path`` (tokenizer.json)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, size = [], 0
    for text in documents():
        texts.append(text)
        size += len(text.encode())
        if size >= TOKENIZER_TRAIN_BYTES:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    tok.save(str(path))


def lognormal_lengths(count: int, seq_len: int, seed: int) -> list[int]:
    """bench/data.py's ``lognormal_lengths``: the same draws for the same seed."""
    import numpy as np

    drawn = np.random.default_rng(seed).lognormal(np.log(LOGNORMAL_MEDIAN), LOGNORMAL_SIGMA, size=count)
    return np.clip(np.rint(drawn), MIN_TOKENS, seq_len).astype(np.int64).tolist()


def alpaca_rows(tokenizer_json: Path, client: str, lengths: list[int]) -> list[dict]:
    """One alpaca row (instruction, output) per drawn length: the corpus read as one token stream (as
    ``--lengths lognormal`` does), each row the next ``length - template`` tokens, decoded, its first fifth the
    instruction. Decoding and re-tokenizing moves a row's length by a token or two at the cut."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    overhead = len(tok.encode(TEMPLATES[client]).ids)
    wanted = [max(length - overhead, 2) for length in lengths]
    stream: list[int] = []
    for text in documents():
        stream += tok.encode(text).ids
        if len(stream) >= sum(wanted):
            break
    rows, start = [], 0
    for n in wanted:
        ids = stream[start : start + n]
        start += n
        cut = max(1, round(n * PROMPT_SHARE))
        rows.append({"instruction": tok.decode(ids[:cut]), "input": "", "output": tok.decode(ids[cut:])})
    return rows


# ------------------------------------------------------------------------------ in a client's environment


def write_model(directory: Path, tokenizer_json: Path, shape: str, seed: int) -> None:
    """A Qwen3 of ``shape`` at random initialisation (seed), fp32, tied embeddings, Qwen3's vocabulary, and the
    tokenizer, both saved by this environment's transformers."""
    import torch
    import transformers

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_json),
        eos_token=IM_END,
        pad_token=PAD,
        padding_side="right",
        model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )
    hidden, layers, heads, kv_heads, head_dim, intermediate = SHAPES[shape]
    config = transformers.Qwen3Config(
        vocab_size=QWEN3_VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        max_position_embeddings=40_960,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)


def llamafactory_tokenize(config_path: Path) -> None:
    """LLaMA-Factory's own preprocessing of the run's dataset, saved at the config's ``tokenized_path`` (what
    ``llamafactory-cli train`` does before training; every run then loads the same tokens)."""
    import yaml
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    model_args, data_args, training_args, _, _ = get_train_args(yaml.safe_load(config_path.read_text()))
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)


def token_counts(directory: Path) -> list[dict]:
    """Each row of the prepared dataset under ``directory`` (Axolotl's dataset_prepared_path, LLaMA-Factory's
    tokenized_path), in order: its tokens and its scored (label) tokens."""
    import datasets

    found = sorted(p.parent for p in directory.rglob("state.json"))
    if len(found) != 1:
        raise SystemExit(f"expected one saved dataset under {directory}, found {found}")
    rows = datasets.load_from_disk(str(found[0]))
    if isinstance(rows, datasets.DatasetDict):
        rows = rows["train"]
    return [
        {"tokens": len(ids), "scored": sum(label != -100 for label in labels)}
        for ids, labels in zip(rows["input_ids"], rows["labels"], strict=True)
    ]


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or [""]
    if command == "write-model" and len(rest) == 4:
        write_model(Path(rest[0]), Path(rest[1]), rest[2], int(rest[3]))
    elif command == "llamafactory-tokenize" and len(rest) == 1:
        llamafactory_tokenize(Path(rest[0]))
    elif command == "token-counts" and len(rest) == 1:
        print(json.dumps(token_counts(Path(rest[0]))))
    elif command == "fasttrain-dir" and not rest:  # where the installed fasttrain is, without importing it
        import importlib.util

        print(importlib.util.find_spec("fasttrain").submodule_search_locations[0])
    else:
        sys.exit(
            "usage: python benchmarks/_clients.py write-model DIR TOKENIZER_JSON SHAPE SEED | "
            "llamafactory-tokenize CONFIG | token-counts DIR | fasttrain-dir"
        )
