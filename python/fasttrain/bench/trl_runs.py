"""``fasttrain bench --trainer sft|dpo|kto|grpo|rloo``: one run of TRL's trainer of that kind, plain or under
``patch()`` (what GRPO and RLOO, which generate, need beside: ``rl_runs``); ``build_trainer`` builds
``--trainer transformers``' Trainers too.

The sides and their rows: docs/method.md, "The sides" and "TRL's trainers". TRL is imported lazily: a bench
and test dependency, never one of fasttrain's.
"""

from __future__ import annotations

import random
from typing import Any

from . import rl_runs
from .config import FASTTRAIN, BenchConfig, Contender, training_kwargs
from .rewards import REWARD_FUNCS

# fraction of each example that is prompt, drawn per example from this range with the bench's seed
PROMPT_FRACTION = (0.1, 0.6)


def _prompt_lengths(examples: list[list[int]], seed: int) -> list[int]:
    rng = random.Random(seed)  # at least one token on each side
    return [min(max(1, int(len(ids) * rng.uniform(*PROMPT_FRACTION))), len(ids) - 1) for ids in examples]


def sft_rows(examples: list[list[int]], seed: int) -> dict[str, list[list[int]]]:
    """``input_ids`` and ``completion_mask`` (0 on the prompt, 1 on the completion) for each example."""
    prompts = _prompt_lengths(examples, seed)
    masks = [[0] * prompt + [1] * (len(ids) - prompt) for ids, prompt in zip(examples, prompts, strict=True)]
    return {"input_ids": [list(ids) for ids in examples], "completion_mask": masks}


def preference_rows(examples: list[list[int]], tokenizer, seq_len: int, seed: int) -> dict[str, list[str]]:
    """``prompt``/``chosen``/``rejected`` text rows; prompt + either completion fits in ``seq_len`` tokens."""
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    prompts = _prompt_lengths(examples, seed)
    for i, (ids, prompt) in enumerate(zip(examples, prompts, strict=True)):
        j = (i + 1) % len(examples)  # the next example's completion, cut to fit
        rejected = examples[j][prompts[j] :][: max(1, seq_len - prompt)]
        rows["prompt"].append(tokenizer.decode(ids[:prompt]))
        rows["chosen"].append(tokenizer.decode(ids[prompt:]))
        rows["rejected"].append(tokenizer.decode(rejected))
    return rows


def unpaired_rows(examples: list[list[int]], tokenizer, seq_len: int, seed: int) -> dict[str, list]:
    """``prompt``/``completion``/``label`` rows for KTO: ``preference_rows``' chosen completion on even rows (label
    True), its rejected one on odd rows (False)."""
    paired = preference_rows(examples, tokenizer, seq_len, seed)
    pairs = zip(paired["chosen"], paired["rejected"], strict=True)
    completion = [pair[i % 2] for i, pair in enumerate(pairs)]  # chosen on even rows, rejected on odd
    labels = [i % 2 == 0 for i in range(len(completion))]
    return {"prompt": paired["prompt"], "completion": completion, "label": labels}


def build_trainer(config: BenchConfig, contender: Contender, model, ref_model, tokenizer, examples: list[list[int]],
                  output_dir: str, callback) -> Any:  # fmt: skip
    """The trainer of ``config.trainer_type`` for ``contender``: "transformers", transformers.Trainer or
    fasttrain.Trainer on the examples as they are; else TRL's trainer of that name, plain or under
    ``fasttrain.patch()``."""
    import datasets
    import transformers

    import fasttrain

    sizes: dict[str, Any] = {"max_length": config.seq_len}
    # the trainer's own arguments beyond the ones every trainer takes
    extra: dict[str, Any] = {"processing_class": tokenizer}
    if config.trainer_type == "transformers":
        trainer_cls = fasttrain.Trainer if contender.trainer == FASTTRAIN else transformers.Trainer
        args_cls, sizes, rows = transformers.TrainingArguments, {}, {"input_ids": examples}
        extra = {"data_collator": transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)}
    else:
        import trl

        if contender.trainer == FASTTRAIN:
            fasttrain.patch()  # FASTTRAIN_DISABLE (ablation runs) still switches paths off
        kind = config.trainer_type.upper()
        trainer_cls, args_cls = getattr(trl, f"{kind}Trainer"), getattr(trl, f"{kind}Config")
    if config.trainer_type == "sft":
        sizes.update(packing=False, completion_only_loss=True)
        rows = sft_rows(examples, config.seed)
    elif config.generates:  # GRPO and RLOO: prompts, completions generated at each step (rl_runs)
        sizes = {key: getattr(config, key) for key in ("num_generations", "max_completion_length")}
        extra["reward_funcs"] = list(REWARD_FUNCS)
        rows = {"prompt": [tokenizer.decode(ids) for ids in examples]}
    elif config.trainer_type != "transformers":  # DPO and KTO: text rows, and a frozen reference model
        make_rows = preference_rows if config.trainer_type == "dpo" else unpaired_rows
        rows = make_rows(examples, tokenizer, config.seq_len, config.seed)
        extra["ref_model"] = ref_model
    args = args_cls(**training_kwargs(config, contender, output_dir, args_cls), **sizes)
    if config.generates:
        rl_runs.prepare_policy(config, model, tokenizer, args.beta, output_dir)
    dataset = datasets.Dataset.from_dict(rows)
    return trainer_cls(model=model, args=args, train_dataset=dataset, callbacks=[callback], **extra)
