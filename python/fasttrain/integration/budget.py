"""Token-budget batches (``fasttrain.Trainer(..., max_tokens_per_batch=N)``): the training loader, built like the
Trainer's own.

The loader has the Trainer's collator, its unused columns removed, its worker settings, and is prepared by
Accelerate, with a :class:`~fasttrain.data.sampler.TokenBudgetBatchSampler` as the ``batch_sampler``. That sampler
is rank-aware (whole batches, the same number per rank, every example once), so the ``BatchSamplerShard``
Accelerate wraps it in is made a pass-through, as transformers does for its own rank-aware
``BatchRebalanceSampler``. ``per_device_train_batch_size`` does not apply: the budget decides how many examples a
batch holds. Column removal goes through two private Trainer methods, checked before use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from .trainer_api import groups_by_length, model_input_name, override, private_hook_problem

_PRIVATE_HOOKS = {
    "_remove_unused_columns": ("dataset", "description"),
    "_get_collator_with_removed_columns": ("data_collator", "description"),
}


def arm(trainer: Any, max_tokens_per_batch: int) -> None:
    """Train ``trainer`` on token-budget batches (refused here, at construction, where it cannot be done)."""
    for name, parameters in _PRIVATE_HOOKS.items():
        problem = private_hook_problem(trainer, name, parameters)
        if problem is not None and not problem.endswith(f"overrides {name}"):
            raise ValueError(f"max_tokens_per_batch cannot build the training loader here: {problem}")

    def loader(trainer: Any, original: Callable[..., Any]) -> DataLoader:
        return token_budget_loader(trainer, max_tokens_per_batch)

    override(trainer, "get_train_dataloader", loader, replaces=True)


def token_budget_loader(trainer: Any, max_tokens_per_batch: int) -> DataLoader:
    """The training loader of ``trainer`` with batches of at most ``max_tokens_per_batch`` tokens."""
    from ..data.lengths import is_hf_dataset, lengths_from_dataset
    from ..data.sampler import TokenBudgetBatchSampler

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
    lengths = lengths_from_dataset(dataset, model_input_name(trainer))
    collator = trainer.data_collator
    if is_hf_dataset(dataset):
        dataset = trainer._remove_unused_columns(dataset, description="training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="training")
    sampler = TokenBudgetBatchSampler(
        max_tokens_per_batch,
        lengths=lengths,
        group_by_length=groups_by_length(args),
        seed=args.data_seed if args.data_seed is not None else args.seed,
        num_replicas=max(1, int(args.world_size)),
        rank=int(args.process_index),
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
