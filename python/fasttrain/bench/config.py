"""The settings of one bench, shared by the parent and every child it starts."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# The three Trainer kinds a contender can run; ablations are "fasttrain" runs named "fasttrain-no-<path>".
REFERENCE = "reference"
FASTTRAIN = "fasttrain"
LIGER = "liger"
# --trainer kinds whose step generates completions (model.generate) before training on them
GENERATING_TRAINERS = ("grpo", "rloo")
GENERATION_FIELDS = ("num_generations", "max_completion_length", "completions")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    model: str
    dataset: str
    device: str
    steps: int
    seq_len: int
    batch_size: int
    grad_accum: int
    bf16: bool
    seed: int
    threads: int
    learning_rate: float
    warmup_steps: int
    group_by_length: bool
    trainer_type: str = "transformers"  # --trainer: "transformers" or TRL's sft, dpo, kto, grpo, rloo
    lengths: str = "natural"  # --lengths (bench/data.py)
    # GRPO and RLOO (bench/rl_runs.py): completions per prompt, their length limit, and where they come from:
    # "sampled" (TRL's model.generate) or "synthetic" (random tokens, no generation: the training phase alone)
    num_generations: int = 8
    max_completion_length: int = 512
    completions: str = "sampled"
    # the length frontier (bench/frontier.py): the Trainer's gradient_checkpointing, a user's best memory setting
    gradient_checkpointing: bool = False
    # the length frontier on cuda: bytes this process may allocate (torch's per-process memory fraction); on cpu
    # the parent watches the child's resident memory instead (runner.run_one)
    memory_budget: int | None = None
    # the Trainer's max_grad_norm where a contender needs another (the optimizer step inside backward needs 0)
    max_grad_norm: float | None = None
    # --profile: this run profiles its last optimizer step (bench/profile.py); its timings are not reported
    profile: bool = False

    @property
    def generates(self) -> bool:
        """GRPO and RLOO: each step generates completions before it trains on them."""
        return self.trainer_type in GENERATING_TRAINERS

    @property
    def examples_needed(self) -> int:
        """Examples one run consumes; for GRPO and RLOO, prompts (``batch_size`` counts completions there, as in
        TRL, and each prompt has ``num_generations`` of them)."""
        completions = self.steps * self.batch_size * self.grad_accum
        return completions // self.num_generations if self.generates else completions

    def to_json(self) -> dict[str, Any]:
        """The settings; GRPO's and RLOO's only where the run generates (elsewhere they would mean nothing)."""
        out = dataclasses.asdict(self)
        return out if self.generates else {k: v for k, v in out.items() if k not in GENERATION_FIELDS}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchConfig:
        return cls(**data)


# The optimizers a contender may name (Contender.optim) that need a package the environment may lack
OPTIM_PACKAGES = {"adamw_bnb_8bit": "bitsandbytes"}


@dataclasses.dataclass(frozen=True)
class Contender:
    """One side of the comparison: which Trainer, and which hot paths are switched off (ablations)."""

    name: str
    trainer: str  # "reference" | "fasttrain" | "liger"
    disable: str | None = None  # FASTTRAIN_DISABLE for the child
    # FASTTRAIN_OPTIM_ARGS for the child: FusedAdamW's options (optim/options.py)
    optim_args: str | None = None
    optim: str | None = None  # TrainingArguments.optim, where not the Trainer's default (OPTIM_PACKAGES)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def dump(path, payload: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2)
        handle.write("\n")


def training_kwargs(config: BenchConfig, contender: Contender, output_dir: str, args_cls) -> dict[str, Any]:
    """The arguments every contender shares, for ``args_cls`` (TrainingArguments or a TRL config subclass)."""
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        max_steps=config.steps,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.grad_accum,
        learning_rate=config.learning_rate,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        seed=config.seed,
        bf16=config.bf16,
        use_cpu=config.device == "cpu",
        disable_tqdm=True,
        # No include_num_input_tokens_seen: the worker counts real tokens itself, at the model's input, the
        # same way for padded and packed batches (the Trainer's count would keep fasttrain's packing off).
    )
    if config.max_grad_norm is not None:
        kwargs["max_grad_norm"] = config.max_grad_norm
    if config.gradient_checkpointing:
        kwargs["gradient_checkpointing"] = True
    if config.group_by_length:
        # transformers 5.x names it train_sampling_strategy; older releases (the GPU machine's 5.17 may) group_by_length
        new = any(f.name == "train_sampling_strategy" for f in dataclasses.fields(args_cls))
        kwargs.update({"train_sampling_strategy": "group_by_length"} if new else {"group_by_length": True})
    if contender.trainer == LIGER:
        kwargs["use_liger_kernel"] = True
    if contender.optim:
        kwargs["optim"] = contender.optim
    return kwargs
