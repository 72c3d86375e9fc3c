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


# The real Qwen3 shapes are taken from their published configs; the small ones exist for CPU runs.
BUILTIN_SHAPES: dict[str, Shape] = {
    "tiny": Shape(32, 1, 2, 1, 16, 64),
    "qwen3-cpu": Shape(128, 2, 4, 2, 32, 384),
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 128, 3072),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 128, 6144),
    "qwen3-4b": Shape(2560, 36, 32, 8, 128, 9728),
}


def builtin_parameters(name: str) -> int:
    """Parameters of a built-in shape, counted from Qwen3's layout (no model is built: qwen3-1.7b in fp32 would
    cost 7 GB). Per layer: q/k/v/o projections, q/k norms, two RMSNorms, a gated MLP; the embedding is tied to
    the LM head, so it counts once; plus the final norm."""
    s = BUILTIN_SHAPES[name]
    h, d = s.hidden_size, s.head_dim
    attention = h * d * (2 * s.num_attention_heads + 2 * s.num_key_value_heads) + 2 * d
    layer = attention + 2 * h + 3 * h * s.intermediate_size
    return QWEN3_VOCAB * h + s.num_hidden_layers * layer + h


def shape_summary(hidden: int, layers: int, vocab: int, parameters: int, tied: bool) -> dict:
    """What the report says about a model's size. The LM head's share is of the matmul FLOPs a token costs
    (every weight matrix once; attention scores aside, they grow with the context): a tied embedding is the
    head itself, an untied one is a free lookup and left out."""
    matmul = parameters - (0 if tied else vocab * hidden)
    share = vocab * hidden / matmul if matmul > 0 else None
    return dict(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab, parameters=parameters,
                lm_head_matmul_share=share)  # fmt: skip


def builtin_summary(name: str) -> dict:
    s = BUILTIN_SHAPES[name]
    return shape_summary(s.hidden_size, s.num_hidden_layers, QWEN3_VOCAB, builtin_parameters(name), tied=True)


def model_summary(model) -> dict | None:
    """``shape_summary`` of a built model, read from its output head (any causal LM); None without one."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None or head.weight.dim() != 2:
        return None
    vocab, hidden = head.weight.shape
    embedding = model.get_input_embeddings()
    tied = embedding is not None and embedding.weight is head.weight
    layers = getattr(model.config, "num_hidden_layers", None)
    return shape_summary(hidden, layers, vocab, model.num_parameters(), tied)


def describe_summary(summary: dict) -> str:
    """'hidden 32, 1 layer, vocab 151,936, 4.9M parameters, LM head 99.8% of the matmul FLOPs'."""
    layers = summary.get("num_hidden_layers")
    parts = [f"hidden {summary['hidden_size']:,}"]
    if layers is not None:
        parts.append(f"{layers} layer{'' if layers == 1 else 's'}")
    parts += [f"vocab {summary['vocab_size']:,}", f"{_millions(summary['parameters'])} parameters"]
    share = summary.get("lm_head_matmul_share")
    if share is not None:  # one decimal near 100%: "100%" would say the layers cost nothing
        parts.append(f"LM head {share:.{1 if share > 0.99 else 0}%} of the matmul FLOPs")
    return ", ".join(parts)


def _millions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.{0 if count >= 1e8 else 1}f}M"


def builtin_config(name: str, max_position_embeddings: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        **dataclasses.asdict(BUILTIN_SHAPES[name]),
        vocab_size=QWEN3_VOCAB,
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
        # Initialise directly on the device and in the dtype: a 0.6B model in fp32 on the host first would cost
        # seconds and GBs, a 4B one in fp32 before its cast to bf16 twice the bf16 model's memory. The weights are
        # the ones an fp32 init cast to the dtype would give (the initialisers draw in fp32 and round).
        with torch.device(device):
            return Qwen3ForCausalLM._from_config(builtin_config(spec, seq_len), dtype=dtype)
    local = looks_like_local_path(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.expanduser(spec) if local else spec, dtype=dtype, local_files_only=local or hub_offline()
        )
    except OSError as exc:  # missing weights, no network, unknown hub id
        raise ModelError(f"--model {spec!r} could not be loaded: {exc}") from None
    return model.to(device)
