"""The training DataLoader of ``fasttrain.Trainer(..., max_tokens_per_batch=N)``: token-budget batches.

Built like the Trainer's own loader (its collator, unused columns removed, its worker settings, prepared by
Accelerate) with a :class:`~fasttrain.data.sampler.TokenBudgetBatchSampler` as the ``batch_sampler``. The
sampler is rank-aware (whole batches, the same number per rank, every example once), so the
``BatchSamplerShard`` Accelerate wraps it in is made a pass-through, as transformers does for its own
rank-aware ``BatchRebalanceSampler``. ``per_device_train_batch_size`` does not apply: the budget decides how
many examples a batch holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from .lengths import lengths_from_dataset
from .sampler import TokenBudgetBatchSampler


def token_budget_loader(trainer: Any, max_tokens_per_batch: int) -> DataLoader:
    """The training loader of ``trainer`` with batches of at most ``max_tokens_per_batch`` tokens."""
    args = trainer.args
    dataset = trainer.train_dataset
    if dataset is None:
        raise ValueError("Trainer: training requires a train_dataset.")
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            "max_tokens_per_batch needs a dataset with a length (it reads every example's length up front); "
            f"got a {type(dataset).__name__}"
        )
    # Lengths first: the Trainer's column removal drops a precomputed `length` column.
    lengths = lengths_from_dataset(dataset, _model_input_name(trainer))
    collator = trainer.data_collator
    if _is_hf_dataset(dataset):
        dataset = trainer._remove_unused_columns(dataset, description="training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="training")
    world, rank = max(1, int(args.world_size)), int(args.process_index)
    sampler = TokenBudgetBatchSampler(
        max_tokens_per_batch,
        lengths=lengths,
        group_by_length=getattr(args, "train_sampling_strategy", None) == "group_by_length"
        or bool(getattr(args, "group_by_length", False)),
        seed=args.data_seed if args.data_seed is not None else args.seed,
        num_replicas=world,
        rank=rank,
        drop_last=args.dataloader_drop_last,
    )
    params: dict[str, Any] = {
        "batch_sampler": sampler,
        "collate_fn": collator,
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
        "persistent_workers": args.dataloader_persistent_workers,
    }
    if args.dataloader_num_workers > 0:
        params["prefetch_factor"] = args.dataloader_prefetch_factor
    loader = trainer.accelerator.prepare(DataLoader(dataset, **params))
    # Accelerate shards a batch sampler over the ranks itself (BatchSamplerShard); ours already did.
    shard = getattr(loader, "batch_sampler", None)
    if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
        shard.num_processes = 1
        shard.process_index = 0
    return loader


def _model_input_name(trainer: Any) -> str | None:
    processing = getattr(trainer, "processing_class", None)
    names = getattr(processing, "model_input_names", None)
    return names[0] if names else None


def _is_hf_dataset(obj: Any) -> bool:
    try:
        from datasets import Dataset
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False
    return isinstance(obj, Dataset)
