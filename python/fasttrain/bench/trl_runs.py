"""``fasttrain bench --trainer sft|dpo|kto|grpo|rloo``: one run of TRL's trainer of that kind, plain or under
``patch()`` (what GRPO and RLOO, which generate, need beside: ``rl_runs``).

Both sides build the same trainer class from the same model, data, seed and arguments; the fasttrain side only
calls ``fasttrain.patch()`` first, as a TRL user would. TRL's own defaults stay (its collators, gradient
checkpointing on), so the comparison is what such a user gets. TRL is imported here, lazily: it is a bench and
test dependency, never one of fasttrain's.

Data, from the bench's token-id examples (same ids, same order on both sides): ``sft_rows``, ``preference_rows``
(DPO), ``unpaired_rows`` (KTO); docs/method.md says what each holds.
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
    rng = random.Random(seed)
    lengths = []
    for ids in examples:
        fraction = rng.uniform(*PROMPT_FRACTION)
        lengths.append(min(max(1, int(len(ids) * fraction)), len(ids) - 1))  # at least one token on each side
    return lengths


def sft_rows(examples: list[list[int]], seed: int) -> dict[str, list[list[int]]]:
    """``input_ids`` and ``completion_mask`` (0 on the prompt, 1 on the completion) for each example."""
    rows: dict[str, list[list[int]]] = {"input_ids": [], "completion_mask": []}
    for ids, prompt in zip(examples, _prompt_lengths(examples, seed), strict=True):
        rows["input_ids"].append(list(ids))
        rows["completion_mask"].append([0] * prompt + [1] * (len(ids) - prompt))
    return rows


def preference_rows(examples: list[list[int]], tokenizer, seq_len: int, seed: int) -> dict[str, list[str]]:
    """``prompt``/``chosen``/``rejected`` text rows; prompt + either completion fits in ``seq_len`` tokens."""
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    prompts = _prompt_lengths(examples, seed)
    for i, (ids, prompt) in enumerate(zip(examples, prompts, strict=True)):
        other = examples[(i + 1) % len(examples)]
        other_prompt = prompts[(i + 1) % len(examples)]
        rejected = other[other_prompt:][: max(1, seq_len - prompt)]
        rows["prompt"].append(tokenizer.decode(ids[:prompt]))
        rows["chosen"].append(tokenizer.decode(ids[prompt:]))
        rows["rejected"].append(tokenizer.decode(rejected))
    return rows


def unpaired_rows(examples: list[list[int]], tokenizer, seq_len: int, seed: int) -> dict[str, list]:
    """``prompt``/``completion``/``label`` rows for KTO: ``preference_rows``' chosen completion on even rows (label
    True), its rejected one on odd rows (False)."""
    paired = preference_rows(examples, tokenizer, seq_len, seed)
    rows: dict[str, list] = {"prompt": paired["prompt"], "completion": [], "label": []}
    for i, (chosen, rejected) in enumerate(zip(paired["chosen"], paired["rejected"], strict=True)):
        rows["completion"].append(chosen if i % 2 == 0 else rejected)
        rows["label"].append(i % 2 == 0)
    return rows


def build_trainer(config: BenchConfig, contender: Contender, model, ref_model, tokenizer, examples: list[list[int]],
                  output_dir: str, callback) -> Any:  # fmt: skip
    """The TRL trainer of ``config.trainer_type`` for ``contender``: plain, or under ``fasttrain.patch()``."""
    import datasets
    import trl

    if contender.trainer == FASTTRAIN:
        import fasttrain

        fasttrain.patch()  # FASTTRAIN_DISABLE (ablation runs) still switches paths off
    kind = config.trainer_type.upper()
    trainer_cls, args_cls = getattr(trl, f"{kind}Trainer"), getattr(trl, f"{kind}Config")
    sizes: dict[str, Any] = {"max_length": config.seq_len}
    extra: dict[str, Any] = {}  # the trainer's own arguments beyond the ones every TRL trainer takes
    if config.trainer_type == "sft":
        sizes.update(packing=False, completion_only_loss=True)
        rows = sft_rows(examples, config.seed)
    elif config.generates:  # GRPO and RLOO: prompts, completions generated at each step (rl_runs)
        sizes = {
            "num_generations": config.num_generations,
            "max_completion_length": config.max_completion_length,
        }
        extra["reward_funcs"] = list(REWARD_FUNCS)
        rows = {"prompt": [tokenizer.decode(ids) for ids in examples]}
    else:  # DPO and KTO: text rows, and a frozen reference model
        make_rows = preference_rows if config.trainer_type == "dpo" else unpaired_rows
        rows = make_rows(examples, tokenizer, config.seq_len, config.seed)
        extra["ref_model"] = ref_model
    args = args_cls(**training_kwargs(config, contender, output_dir, args_cls), **sizes)
    if config.generates:
        rl_runs.prepare_policy(config, model, tokenizer, args.beta, output_dir)
    return trainer_cls(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_dict(rows),
        processing_class=tokenizer,
        callbacks=[callback],
        **extra,
    )
