"""What bench_clients.py runs inside a client's own environment (LLaMA-Factory's), as a script, with
that environment's torch, transformers and datasets and nothing of fasttrain's; each command prints its answer
as JSON (null for write-model, which only writes):

    python benchmarks/_clients.py write-model DIR TOKENIZER_JSON CONFIG_JSON SEED
    python benchmarks/_clients.py token-counts DIR
    python benchmarks/_clients.py installed PACKAGE...
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
import sys
from pathlib import Path


def write_model(directory: str, tokenizer_json: str, config_json: str, seed: str) -> None:
    """A Qwen3 of the given config at random initialisation (seed), fp32, and the tokenizer, both saved by this
    environment's transformers (the one that loads them again). The config's ``chat_template``, ``eos_token``
    and ``pad_token`` go to the tokenizer."""
    import torch
    import transformers

    config = json.loads(config_json)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=tokenizer_json,
        eos_token=config.pop("eos_token"),
        pad_token=config.pop("pad_token"),
        padding_side="right",
        model_max_length=4096,
        chat_template=config.pop("chat_template"),
    )
    qwen3 = transformers.Qwen3Config(**config, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(int(seed))
    transformers.AutoModelForCausalLM.from_config(qwen3, dtype=torch.float32).save_pretrained(directory)
    tok.save_pretrained(directory)


def token_counts(directory: str) -> list[dict]:
    """Each row of the dataset the framework prepared under ``directory`` (LLaMA-Factory's tokenized_path), in
    order: its tokens."""
    import datasets

    found = sorted(p.parent for p in Path(directory).rglob("state.json"))
    if len(found) != 1:
        raise SystemExit(f"expected one saved dataset under {directory}, found {found}")
    rows = datasets.load_from_disk(str(found[0]))
    rows = rows["train"] if isinstance(rows, datasets.DatasetDict) else rows
    return [{"tokens": len(ids)} for ids in rows["input_ids"]]


def installed(*packages: str) -> dict:
    """Python's and the packages' versions (None where not installed), and where fasttrain is (found, not
    imported)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    fasttrain_dir = importlib.util.find_spec("fasttrain").submodule_search_locations[0]
    return {"versions": versions, "fasttrain_dir": fasttrain_dir}


COMMANDS = {"write-model": write_model, "token-counts": token_counts, "installed": installed}

if __name__ == "__main__":
    command, *args = sys.argv[1:] or [""]
    if command not in COMMANDS:
        sys.exit(__doc__)
    print(json.dumps(COMMANDS[command](*args)))
