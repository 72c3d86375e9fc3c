"""``fasttrain bench --trainer grpo|rloo``: one run of TRL's GRPOTrainer or RLOOTrainer, plain or under ``patch()``.

Both sides build the same trainer from the same model, prompts, seed and arguments; the fasttrain side only calls
``fasttrain.patch()`` first. TRL's defaults stay (loss type, ``beta``: 0 for GRPO, 0.05 for RLOO, whose reference
model TRL loads from the policy's name; temperature 1, no top-k/top-p; gradient checkpointing on), except the
sizes the bench sets: ``num_generations`` completions per prompt of at most ``max_completion_length`` tokens, and
``--batch-size`` completions per micro-batch (TRL's ``per_device_train_batch_size``), so each optimizer step
trains on ``batch_size x grad_accum / num_generations`` prompts, all generated at the step's start.

Prompts are the bench's token-id examples decoded to text; rewards are ``bench/rewards.py``.
- Completions, ``--completions sampled`` (the default): TRL's ``model.generate``, sampling seeded by ``--seed``
  (both sides alike). A built-in model at random initialisation would never stop before the limit (its one
  end-of-text id has a chance of about 1 in 151,936 per token), so the bench gives it ``STOP_IDS`` more ids that end
  a completion (``generation_config.eos_token_id``, which TRL reads for both generation and masking): a completion
  then ends with a chance of about ``(STOP_IDS + 1) / 151,936`` per token, so lengths are roughly geometric, median
  about 175 tokens, about 1 in 8 reaching a 512-token limit. A checkpoint keeps its own end-of-text ids.
- ``--completions synthetic``: ``model.generate`` replaced on the instance (``synthetic_generate``).
"""

from __future__ import annotations

import os
from typing import Any

from .config import BenchConfig, Contender, training_kwargs
from .rewards import REWARD_FUNCS

SAMPLED = "sampled"
SYNTHETIC = "synthetic"
STOP_IDS = 600  # extra ids that end a built-in model's completion (see the module's docstring)


def prompt_rows(examples: list[list[int]], tokenizer) -> dict[str, list[str]]:
    """One ``prompt`` (text) per example."""
    return {"prompt": [tokenizer.decode(ids) for ids in examples]}


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


def _reference_by_name(model, output_dir: str) -> None:
    """RLOO (and GRPO with ``beta`` > 0) load their reference model from the policy's name: a built-in model has
    none, so it is saved under ``output_dir`` and named after that folder (identical weights, the policy's dtype)."""
    name = getattr(model.config, "_name_or_path", "")
    if name and os.path.exists(os.path.join(os.path.expanduser(name), "config.json")):
        return
    if name and "/" in name and not name.startswith((".", "/", "~")):
        return  # a hub id: TRL loads it as the user's script would
    path = os.path.join(output_dir, "reference-model")
    model.save_pretrained(path)
    model.config._name_or_path = path


def build_trainer(config: BenchConfig, contender: Contender, model, tokenizer, examples: list[list[int]],
                  output_dir: str, callback) -> Any:  # fmt: skip
    """TRL's GRPOTrainer or RLOOTrainer (``config.trainer_type``) for ``contender``, plain or under ``patch()``."""
    import datasets
    import trl

    from . import models

    # under fasttrain.patch() already for the fasttrain side (trl_runs.build_trainer)
    kind = config.trainer_type.upper()
    trainer_cls, args_cls = getattr(trl, f"{kind}Trainer"), getattr(trl, f"{kind}Config")
    args = args_cls(
        **training_kwargs(config, contender, output_dir, args_cls),
        num_generations=config.num_generations,
        max_completion_length=config.max_completion_length,
    )
    if config.completions == SYNTHETIC:
        model.generate = synthetic_generate(config, tokenizer, tokenizer.pad_token_id)
    elif config.model in models.BUILTIN_SHAPES:
        model.generation_config.eos_token_id = stop_ids(model, tokenizer)
    if args.beta != 0.0:
        _reference_by_name(model, output_dir)
    return trainer_cls(
        model=model,
        reward_funcs=list(REWARD_FUNCS),
        args=args,
        train_dataset=datasets.Dataset.from_dict(prompt_rows(examples, tokenizer)),
        processing_class=tokenizer,
        callbacks=[callback],
    )
