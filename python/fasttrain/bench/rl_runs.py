"""``fasttrain bench --trainer grpo|rloo``: what a GRPOTrainer or RLOOTrainer run adds to ``trl_runs``' (which
builds every TRL trainer alike, here from one text ``prompt`` per example; rewards: ``bench/rewards.py``). TRL's
defaults, the sizes and the completions (sampled or ``synthetic_generate``): docs/method.md, "TRL's trainers".
"""

from __future__ import annotations

import os

from .config import BenchConfig

SYNTHETIC = "synthetic"
# extra ids that end a built-in model's completion: its one end-of-text id alone (a chance of about 1 in 151,936 a
# token at random init) would never end one before the limit (docs/method.md, "TRL's trainers")
STOP_IDS = 600


def stop_ids(model, tokenizer) -> list[int]:
    """The end-of-completion ids of a built-in model: its tokenizer's end-of-text id and the last ``STOP_IDS`` ids of
    the vocabulary (ids the bench's tokenizer never produces, so they decode to nothing)."""
    vocab = model.config.vocab_size
    extra = [i for i in range(vocab - STOP_IDS, vocab) if i >= len(tokenizer)]
    return [tokenizer.eos_token_id, *extra]


def synthetic_generate(config: BenchConfig, tokenizer, pad_id: int):
    """A stand-in for ``model.generate``: after each prompt, random tokens of the tokenizer's vocabulary (no
    end-of-text or pad id among them) of a log-normal length clipped to ``1..max_completion_length``, an end-of-text
    id at the end of those shorter than the limit, pad after. Call ``n`` draws from seed ``(config.seed, n)``:
    the same completions on both sides."""
    import torch

    from .data import lognormal_lengths

    limit = config.max_completion_length
    eos = tokenizer.eos_token_id
    allowed = torch.tensor([i for i in range(len(tokenizer)) if i not in (eos, pad_id)])
    calls = [0]

    def generate(input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        rows = input_ids.shape[0]
        lengths = lognormal_lengths(rows, limit, (config.seed, calls[0]), lower=1)
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + calls[0])
        calls[0] += 1
        width = max(lengths)
        tokens = allowed[torch.randint(len(allowed), (rows, width), generator=generator)]
        for row, length in enumerate(lengths):
            if length < limit:  # ended by the model; a completion at the limit was cut off there
                tokens[row, length - 1] = eos
            tokens[row, length:] = pad_id
        return torch.cat([input_ids, tokens.to(input_ids.device)], dim=1)

    return generate


def prepare_policy(config: BenchConfig, model, tokenizer, beta: float, output_dir: str) -> None:
    """Before the trainer is built: the completions ``config.completions`` asks for and, where TRL will load a
    reference model from the policy's name (RLOO, GRPO with ``beta`` > 0), a name to load it from: a built-in
    model has none, so it is saved under ``output_dir`` (identical weights, the policy's dtype)."""
    from . import models

    if config.completions == SYNTHETIC:
        model.generate = synthetic_generate(config, tokenizer, tokenizer.pad_token_id)
    elif config.model in models.BUILTIN_SHAPES:
        model.generation_config.eos_token_id = stop_ids(model, tokenizer)
    name = getattr(model.config, "_name_or_path", "")
    local = name and os.path.exists(os.path.join(os.path.expanduser(name), "config.json"))
    hub_id = name and "/" in name and not name.startswith((".", "/", "~"))  # TRL loads it as a user's script
    if beta != 0.0 and not (local or hub_id):
        path = os.path.join(output_dir, "reference-model")
        model.save_pretrained(path)
        model.config._name_or_path = path
