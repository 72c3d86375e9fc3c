"""LLaMA-Factory's own CLI on CPU on a tiny local model, plain and with fasttrain (tests/test_client_llamafactory.py).

The test process (fasttrain's .venv) writes the datasets and YAML configs; the model and tokenizer are written by
LLaMA-Factory's environment (``python tests/_client_llamafactory.py write-model DIR``), so that they are saved by
the transformers that will load them. Each run is ``llamafactory-cli train cfg.yaml`` in a fresh process with that
environment's ``bin`` on PATH, offline, with its Hugging Face caches in the run's own folder.

fasttrain reaches the unmodified CLI in one of two ways (``fasttrain=``):

- ``"env"``: FASTTRAIN_PATCH=1, which fasttrain's wheel reads at interpreter start (a ``.pth`` file);
- ``"sitecustomize"``: a ``sitecustomize.py`` on PYTHONPATH that calls ``fasttrain.patch()``, for a fasttrain that
  predates the variable. FASTTRAIN_LLAMAFACTORY_VIA=sitecustomize makes it the default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
DEFAULT_PYTHON = REPO / ".ci-envs" / "llamafactory" / "bin" / "python"
PATHS = ("optimizer", "clip", "loss", "collator", "sampler", "packing")  # the status line's fields, in order
STATUS = re.compile(r"fasttrain hot paths: (.*)")

# The ChatML special tokens LLaMA-Factory's `qwen3` template writes (it replaces the EOS with <|im_end|>, its stop
# word), Qwen3's pad token, and the thinking markers its ReasoningTemplate inserts as an empty thought.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")
# Qwen3's chat template without tools or thinking: LLaMA-Factory keeps a tokenizer's template (the `qwen3`
# template does not replace it), it only needs one to be there.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The byte alphabet (256) and the 5 added tokens fit; the rest are never produced, as in real models.
VOCAB = 512


def python() -> Path:
    return Path(os.environ.get("FASTTRAIN_LLAMAFACTORY_PYTHON") or DEFAULT_PYTHON)


# --- the model and tokenizer: run inside LLaMA-Factory's environment -------------------------------------------


def write_model(directory: Path, nudge: bool = False) -> None:
    """A 2-layer Qwen3 (hidden 64, tied embeddings like Qwen3-0.6B) in float32 and a byte-level BPE tokenizer
    with no merges (every byte a token: no training, and any text encodes) plus Qwen3's special tokens.

    ``nudge``: every weight moved by one unit in the last place, up or down at random. A backward-stable
    computation's rounding is what an exact computation on inputs off by a few such units gives, so a run from
    these weights shows how far rounding alone moves each logged value, drift through the steps included."""
    import tokenizers
    import torch
    import transformers

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="right",
        model_max_length=1024,
        chat_template=CHAT_TEMPLATE,
    )
    assert len(fast) <= VOCAB
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if nudge:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                up = torch.rand(p.shape, generator=generator) < 0.5
                p.copy_(torch.nextafter(p, torch.where(up, math.inf, -math.inf)))
    model.save_pretrained(directory)
    fast.save_pretrained(directory)


# --- datasets and configs: written by the test process ---------------------------------------------------------

WORDS = (  # noqa: SIM905 - one string reads better than ruff's list literal of 34 lines
    "red green blue small large quick slow river stone cloud paper glass north south light dark warm cold "
    "open close write read count sort merge split train test model token batch step loss rate"
).split()


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))).capitalize() + "."


def write_data(directory: Path, rows: int = 32, seed: int = 0) -> None:
    """Alpaca-style SFT rows, pairwise (ranking) rows for DPO and KTO rows (a boolean kto_tag, both kinds), in
    ``directory`` with the ``dataset_info.json`` naming them tiny_sft, tiny_dpo and tiny_kto."""
    rng = random.Random(seed)
    sft, dpo, kto = [], [], []
    for i in range(rows):
        instruction, extra = _sentence(rng, 2, 8), _sentence(rng, 0, 6) if i % 3 == 0 else ""
        prompt = {"instruction": instruction, "input": extra}
        sft.append({**prompt, "output": _sentence(rng, 3, 14)})
        dpo.append({**prompt, "chosen": _sentence(rng, 3, 12), "rejected": _sentence(rng, 2, 10)})
        kto.append({**prompt, "output": _sentence(rng, 3, 12), "label": i % 3 != 1})
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in (("sft", sft), ("dpo", dpo), ("kto", kto)):
        (directory / f"{name}.json").write_text(json.dumps(data, indent=1))
    columns = {"prompt": "instruction", "query": "input"}
    info = {
        "tiny_sft": {"file_name": "sft.json", "columns": {**columns, "response": "output"}},
        "tiny_dpo": {
            "file_name": "dpo.json",
            "ranking": True,
            "columns": {**columns, "chosen": "chosen", "rejected": "rejected"},
        },
        "tiny_kto": {
            "file_name": "kto.json",
            "columns": {**columns, "response": "output", "kto_tag": "label"},
        },
    }
    (directory / "dataset_info.json").write_text(json.dumps(info, indent=1))


def config(stage: str, model: Path, data: Path, output: Path, bf16: bool = False) -> dict:
    """The run's LLaMA-Factory configuration: full fine-tuning, 4 optimizer steps of 2 x 2 examples, every step
    logged, fixed seed, no evaluation, no checkpoints."""
    cfg = {
        "model_name_or_path": str(model),
        "stage": stage,
        "do_train": True,
        "finetuning_type": "full",
        "dataset": f"tiny_{stage}",
        "dataset_dir": str(data),
        "template": "qwen3",
        "cutoff_len": 256,
        "overwrite_cache": True,
        "output_dir": str(output),
        "overwrite_output_dir": True,
        "logging_steps": 1,
        "save_strategy": "no",
        "plot_loss": False,
        "report_to": "none",
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "learning_rate": 1.0e-3,
        "lr_scheduler_type": "linear",
        "max_steps": 4,
        "max_grad_norm": 1.0,
        "seed": 0,
        "data_seed": 0,
        "bf16": bf16,
        "use_cpu": True,  # transformers refuses bf16 without a GPU unless told the run is on CPU
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }
    if stage in ("dpo", "kto"):
        cfg["pref_beta"] = 0.1
    if stage == "dpo":
        cfg["pref_loss"] = "sigmoid"
    return cfg


# --- a run ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    # the Trainer's log_history entries of the training steps, in order (trainer_state.json: unrounded floats;
    # trainer_log.jsonl has no grad_norm, and of DPO's and KTO's metrics only rewards/accuracies)
    steps: list[dict]
    # fasttrain's status line as path -> "on" / "off: <why>", and as written; None without fasttrain
    status: dict[str, str] | None
    status_line: str | None
    wall_s: float
    output: str = dataclasses.field(repr=False)  # the CLI's stdout and stderr, interleaved


def parse_status(line: str) -> dict[str, str]:
    """``optimizer=on, clip=on, loss=off: <why>, ...`` as a dict. A reason may hold commas: fields are split only
    where the next known path name starts; notes after ``; `` (other trainers, warnings) are left out."""
    fields = line.split("; ")[0]
    starts = [m.start() for m in re.finditer(rf"(?:^|, )(?:{'|'.join(PATHS)})=", fields)]
    status = {}
    for begin, end in zip(starts, [*starts[1:], len(fields)], strict=True):
        name, _, value = fields[begin:end].removeprefix(", ").partition("=")
        status[name] = value
    return status


def _environment(workdir: Path, fasttrain: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("FASTTRAIN_PATCH", "PYTHONPATH", "FORCE_TORCHRUN", "USE_V1", "CUDA_VISIBLE_DEVICES"):
        env.pop(name, None)
    env.update(
        PATH=f"{python().parent}{os.pathsep}{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(workdir / "hf-home"),  # a fresh datasets cache: every run tokenizes its data itself
        CUDA_VISIBLE_DEVICES="",  # LLaMA-Factory launches torchrun when it sees more than one device
        TOKENIZERS_PARALLELISM="false",
    )
    if fasttrain == "env":
        env["FASTTRAIN_PATCH"] = "1"
    elif fasttrain == "sitecustomize":
        site = workdir / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text("import fasttrain\n\nfasttrain.patch()\n")
        env["PYTHONPATH"] = str(site)
    elif fasttrain is not None:
        raise ValueError(f"fasttrain={fasttrain!r}: use None, 'env' or 'sitecustomize'")
    return env


def default_variant() -> str:
    return os.environ.get("FASTTRAIN_LLAMAFACTORY_VIA", "env")


def train(cfg: dict, workdir: Path, fasttrain: str | None, timeout: float = 900) -> Run:
    """``llamafactory-cli train`` on ``cfg`` in ``workdir`` (its own folder); fails with the CLI's output when it
    does not exit 0. ``fasttrain``: None (plain), "env" or "sitecustomize"."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    start = time.perf_counter()
    done = subprocess.run(
        ["llamafactory-cli", "train", str(path)],
        cwd=workdir,
        env=_environment(workdir, fasttrain),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    wall = time.perf_counter() - start
    (workdir / "output.log").write_text(done.stdout)
    if done.returncode != 0:
        raise RuntimeError(f"llamafactory-cli train exited {done.returncode}:\n{done.stdout[-6000:]}")
    state = json.loads((Path(cfg["output_dir"]) / "trainer_state.json").read_text())
    steps = [entry for entry in state["log_history"] if "loss" in entry]
    lines = STATUS.findall(done.stdout)
    if len(lines) > 1:
        raise AssertionError(
            f"fasttrain's status line was written {len(lines)} times, once expected: {lines}"
        )
    line = lines[0] if lines else None
    record = {"wall_s": wall, "status_line": line, "steps": steps}
    (workdir / "run.json").write_text(json.dumps(record, indent=1))
    return Run(steps, parse_status(line) if line else None, line, wall, done.stdout)


def prepare(workdir: Path) -> dict[str, Path]:
    """The model and its nudged twin (``write_model``), written by LLaMA-Factory's environment, and the
    datasets, under ``workdir``: {"model": ..., "nudged": ..., "data": ...}."""
    paths = {"model": workdir / "model", "nudged": workdir / "nudged", "data": workdir / "data"}
    for name in ("model", "nudged"):
        command = [str(python()), str(HERE), "write-model", str(paths[name])] + (
            ["--nudge"] * (name == "nudged")
        )
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    write_data(paths["data"])
    return paths


if __name__ == "__main__":
    if (
        sys.argv[1:2] != ["write-model"]
        or len(sys.argv) not in (3, 4)
        or sys.argv[3:] not in ([], ["--nudge"])
    ):
        sys.exit("usage: python tests/_client_llamafactory.py write-model DIR [--nudge]")
    write_model(Path(sys.argv[2]), nudge=sys.argv[3:] == ["--nudge"])
