"""``fasttrain.Trainer(..., max_tokens_per_batch=N)``: token-budget batches through the Trainer's own loop."""

from __future__ import annotations

import types

import pytest
import transformers

import _tiny
import fasttrain
from fasttrain.integration.budget import token_budget_loader

pytestmark = pytest.mark.gpu_versions


class BatchLog:
    """Which rows, and how many real tokens, each training forward received (padded or packed)."""

    def __init__(self, model):
        self.batches: list[tuple[list[int], int]] = []
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        if not module.training:
            return
        self.batches.append(_tiny.batch_rows(kwargs))


def _train(tmp_path, budget: int, n: int = 30, epochs: int = 2, **overrides):
    model = _tiny.model("llama")
    log = BatchLog(model)
    args = _tiny.training_args(
        str(tmp_path), max_steps=-1, num_train_epochs=epochs, gradient_accumulation_steps=1, **overrides
    )
    trainer = fasttrain.Trainer(
        model=model,
        args=args,
        train_dataset=_tiny.dataset(n=n),
        data_collator=transformers.DataCollatorForSeq2Seq(_tiny.tokenizer()),
        max_tokens_per_batch=budget,
    )
    trainer.train()
    return trainer, log


def test_every_example_once_per_epoch_within_the_budget(tmp_path):
    lengths = [len(x) for x in _tiny.dataset(n=30)["input_ids"]]
    # Padded or packed (the packing path decides per batch), a batch reaches the model with exactly its
    # examples' real tokens; BatchLog reads either form.
    trainer, log = _train(tmp_path, budget=96)
    steps_per_epoch = len(log.batches) // 2
    assert trainer.state.global_step == 2 * steps_per_epoch
    epochs = [log.batches[:steps_per_epoch], log.batches[steps_per_epoch:]]
    for batches in epochs:
        assert sorted(row for rows, _ in batches for row in rows) == list(range(30))
        for rows, tokens in batches:
            assert tokens == sum(lengths[r] for r in rows), "a batch holds exactly its examples' tokens"
            assert tokens <= 96
        assert max(len(rows) for rows, _ in batches) > 4  # more than per_device_train_batch_size examples
    assert [rows for rows, _ in epochs[0]] != [rows for rows, _ in epochs[1]], "each epoch its own order"


def test_the_same_seed_gives_the_same_batches(tmp_path):
    _, first = _train(tmp_path / "a", budget=64, epochs=1)
    _, again = _train(tmp_path / "b", budget=64, epochs=1)
    assert [rows for rows, _ in first.batches] == [rows for rows, _ in again.batches]


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_a_bad_budget_fails_before_any_setup(tmp_path, bad):
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        fasttrain.Trainer(
            model=_tiny.model("llama"),
            args=_tiny.training_args(str(tmp_path)),
            train_dataset=_tiny.dataset(n=4),
            max_tokens_per_batch=bad,
        )


def test_without_a_budget_the_trainer_batches_as_transformers_does(tmp_path):
    trainer = fasttrain.Trainer(
        model=_tiny.model("llama"),
        args=_tiny.training_args(str(tmp_path)),
        train_dataset=_tiny.dataset(n=8),
        data_collator=transformers.DataCollatorForSeq2Seq(_tiny.tokenizer()),
    )
    assert len(trainer.get_train_dataloader()) == 2  # 8 examples, 4 a batch


def test_ranks_get_whole_batches_the_same_number_each_through_accelerate(tmp_path):
    """Accelerate would shard the batch sampler again over the ranks (BatchSamplerShard); the loader makes
    that wrapper a pass-through, since the sampler already gave each rank its own batches."""
    from accelerate.data_loader import prepare_data_loader

    dataset = _tiny.dataset(n=23)
    base = _tiny.training_args(str(tmp_path))
    per_rank = []
    for rank in range(2):
        trainer = types.SimpleNamespace(
            args=types.SimpleNamespace(
                world_size=2,
                process_index=rank,
                seed=base.seed,
                data_seed=None,
                train_sampling_strategy="random",
                dataloader_drop_last=False,
                dataloader_num_workers=0,
                dataloader_pin_memory=False,
                dataloader_persistent_workers=False,
            ),
            train_dataset=dataset,
            data_collator=lambda features: [f["input_ids"][:2] for f in features],
            processing_class=None,
            _remove_unused_columns=lambda ds, description: ds,
            accelerator=types.SimpleNamespace(
                prepare=lambda loader, rank=rank: prepare_data_loader(
                    loader, num_processes=2, process_index=rank, put_on_device=False
                )
            ),
        )
        loader = token_budget_loader(trainer, 64)
        assert type(loader.batch_sampler).__name__ == "BatchSamplerShard"
        batches = [[(a - 2) * 200 + (b - 2) for a, b in batch] for batch in loader]
        assert len(batches) == len(loader)
        per_rank.append(batches)
    assert len(per_rank[0]) == len(per_rank[1])
    rows = [row for batches in per_rank for batch in batches for row in batch]
    assert sorted(rows) == list(range(23)), "each example once across the ranks"
