"""Models for the bench: built-in Qwen3 shapes at random init, or a local checkpoint / hub id.

Every built-in keeps Qwen3's 151,936-token vocabulary and tied embeddings, because the vocabulary is
what makes the causal-LM loss a hot path: the ``[tokens, vocab]`` logits dominate memory in small models.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

QWEN3_VOCAB = 151_936


class ModelError(ValueError):
    """A ``--model`` that cannot be built or loaded; the message is shown to the user as is."""


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    description: str


# The real Qwen3 shapes are taken from their published configs; the small ones exist for CPU runs.
BUILTIN_SHAPES: dict[str, Shape] = {
    "tiny": Shape(32, 1, 2, 1, 16, 64, "test-sized: 1 layer, hidden 32"),
    "qwen3-cpu": Shape(128, 2, 4, 2, 32, 384, "CPU bench default: 2 layers, hidden 128"),
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 128, 3072, "Qwen3-0.6B shape: 28 layers, hidden 1024"),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 128, 6144, "Qwen3-1.7B shape: 28 layers, hidden 2048"),
}


def builtin_config(name: str, max_position_embeddings: int):
    from transformers import Qwen3Config

    shape = BUILTIN_SHAPES[name]
    return Qwen3Config(
        vocab_size=QWEN3_VOCAB,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=max(max_position_embeddings, 4096),
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=1,
    )


def looks_like_local_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or os.path.exists(os.path.expanduser(spec))


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes"}


def check_model_spec(spec: str) -> None:
    """Fail early, in the parent process, on a ``--model`` that cannot work (before any child starts)."""
    if spec in BUILTIN_SHAPES:
        return
    if looks_like_local_path(spec):
        path = pathlib.Path(spec).expanduser()
        if not path.is_dir():
            raise ModelError(
                f"--model {spec!r}: no such directory (built-in shapes: {', '.join(BUILTIN_SHAPES)})"
            )
        if not (path / "config.json").is_file():
            raise ModelError(f"--model {spec!r}: the directory has no config.json")
        return
    if spec.count("/") != 1 or any(not part for part in spec.split("/")):
        raise ModelError(
            f"--model {spec!r} is neither a built-in shape ({', '.join(BUILTIN_SHAPES)}), "
            "a local directory, nor a hub id of the form owner/name"
        )
    if hub_offline():
        raise ModelError(
            f"--model {spec!r} is a hub id but HF_HUB_OFFLINE is set; use a built-in or a local path"
        )


def build_model(spec: str, seq_len: int, seed: int, device: str, dtype):
    """The model at ``seed`` on ``device`` in ``dtype``; identical weights in every process for a built-in."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    if spec in BUILTIN_SHAPES:
        torch.manual_seed(seed)
        # Initialise directly on the device: a 0.6B model in fp32 on the host first would cost seconds and GBs.
        with torch.device(device):
            model = Qwen3ForCausalLM(builtin_config(spec, seq_len))
        return model.to(dtype=dtype)
    local = looks_like_local_path(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.expanduser(spec) if local else spec, dtype=dtype, local_files_only=local or hub_offline()
        )
    except OSError as exc:  # missing weights, no network, unknown hub id
        raise ModelError(f"--model {spec!r} could not be loaded: {exc}") from None
    return model.to(device)
