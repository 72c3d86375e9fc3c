"""What bench_clients.py runs inside a client's own environment (Axolotl's, LLaMA-Factory's), as a script:

    python benchmarks/_clients.py COMMAND ...

with that environment's torch, transformers and datasets, and nothing of fasttrain's: writing the model and
tokenizer (saved by the transformers that loads them again), tokenizing LLaMA-Factory's dataset once with its own
code, reading back the token counts of a prepared dataset, and the environment's package versions.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
import sys
from pathlib import Path


def write_model(directory: Path, tokenizer_json: Path, config_json: str, seed: int) -> None:
    """A Qwen3 of the given config at random initialisation (seed), fp32, and the tokenizer, both saved by this
    environment's transformers. The config's ``chat_template``, ``eos_token`` and ``pad_token`` go to the
    tokenizer."""
    import torch
    import transformers

    config = json.loads(config_json)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_json),
        eos_token=config.pop("eos_token"),
        pad_token=config.pop("pad_token"),
        padding_side="right",
        model_max_length=4096,
        chat_template=config.pop("chat_template"),
    )
    qwen3 = transformers.Qwen3Config(**config, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(qwen3, dtype=torch.float32).save_pretrained(directory)
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
    tokenized_path), in order: its tokens."""
    import datasets

    found = sorted(p.parent for p in directory.rglob("state.json"))
    if len(found) != 1:
        raise SystemExit(f"expected one saved dataset under {directory}, found {found}")
    rows = datasets.load_from_disk(str(found[0]))
    rows = rows["train"] if isinstance(rows, datasets.DatasetDict) else rows
    return [{"tokens": len(ids)} for ids in rows["input_ids"]]


def versions(packages: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or [""]
    if command == "write-model" and len(rest) == 4:
        write_model(Path(rest[0]), Path(rest[1]), rest[2], int(rest[3]))
    elif command == "llamafactory-tokenize" and len(rest) == 1:
        llamafactory_tokenize(Path(rest[0]))
    elif command == "token-counts" and len(rest) == 1:
        print(json.dumps(token_counts(Path(rest[0]))))
    elif command == "versions":
        print(json.dumps(versions(rest)))
    elif command == "fasttrain-dir" and not rest:  # where the installed fasttrain is, without importing it
        print(importlib.util.find_spec("fasttrain").submodule_search_locations[0])
    else:
        sys.exit(
            "usage: python benchmarks/_clients.py write-model DIR TOKENIZER_JSON CONFIG_JSON SEED | "
            "llamafactory-tokenize CONFIG | token-counts DIR | versions PACKAGE... | fasttrain-dir"
        )
