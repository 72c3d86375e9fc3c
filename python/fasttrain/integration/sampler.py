"""The sampler path: the Rust length-grouped sampler where the Trainer would build transformers' one.

The Trainer builds its training sampler in the private ``_get_train_sampler`` (hooked after a signature check),
from ``train_sampling_strategy="group_by_length"`` (4.x: ``group_by_length``), over the dataset after it removed the
unused columns (the ``length`` column too). The lengths come from the Arrow offsets, or from the ``length`` column of
the dataset the trainer was given when it holds the same rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .ledger import NOT_RUN, Seam, seam_of
from .trainer_api import groups_by_length, model_input_name, override, private_hook_problem


def arm(trainer: Any, seam: Seam) -> None:
    if not groups_by_length(trainer.args):
        seam.off("sampler", "group_by_length is not set", fallback=False)
        return
    problem = private_hook_problem(trainer, "_get_train_sampler", ("train_dataset",))
    if problem is not None:
        seam.off("sampler", problem)
        return
    override(trainer, "_get_train_sampler", _train_sampler, replaces=True)


def _train_sampler(trainer: Any, original: Callable[..., Any], train_dataset: Any = None) -> Any:
    from transformers.trainer_utils import has_length

    seam = seam_of(trainer)
    dataset = trainer.train_dataset if train_dataset is None else train_dataset
    if not groups_by_length(trainer.args) or dataset is None or not has_length(dataset):
        return original(train_dataset)
    from ..data.lengths import lengths_from_dataset
    from ..data.sampler import LengthGroupedSampler

    input_name = model_input_name(trainer)
    column = trainer.args.length_column_name
    given = trainer.train_dataset
    # An empty dataset takes transformers' own decision on the dataset it sees, so that it fails where
    # transformers' sampler fails (IndexError at construction when that dataset has no length column).
    source = (
        given if column in getattr(given, "column_names", ()) and len(given) == len(dataset) > 0 else dataset
    )
    if len(source) == 0 and column not in getattr(source, "column_names", ()):
        lengths = None  # the sampler then raises IndexError at construction, as transformers' does
    else:
        lengths = lengths_from_dataset(source, input_name or "input_ids", length_column=column)
    seam.sampler = LengthGroupedSampler(
        trainer.args.train_batch_size * trainer.args.gradient_accumulation_steps,
        dataset=dataset,
        lengths=lengths,
        model_input_name=input_name,
    )
    return seam.sampler


def verdict(seam: Seam, trainer: Any, optimizer: Any) -> None:
    if seam.status["sampler"] != NOT_RUN:
        return
    if seam.sampler is not None and seam.sampler.iterations_started:
        seam.status["sampler"] = "on"
    else:
        seam.off("sampler", "the Trainer built no length-grouped sampler")
