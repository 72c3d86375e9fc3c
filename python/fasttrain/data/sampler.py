"""Drop-in ``LengthGroupedSampler`` and ``DistributedLengthGroupedSampler`` (grouping in Rust), and
``TokenBudgetBatchSampler`` (batches within a token budget, for packed rows; no transformers counterpart).

Same constructor arguments and the same index order as ``transformers.trainer_pt_utils``' classes for
the same generator state: the permutation is ``torch.randperm(n, generator=generator)``, drawn exactly as
transformers draws it; the megabatch split, the stable descending sort by length and the longest-first
swap run in Rust without the GIL. Lengths of a ``datasets.Dataset`` come from Arrow (see
:mod:`fasttrain.data.lengths`) instead of a Python pass over every row.

An empty dataset raises IndexError where transformers' samplers raise it: at construction when the lengths
are to be read from the dataset (transformers reads ``dataset[0]``), on iteration when given as ``lengths=[]``
(``torch.argmax`` of nothing); a distributed order too short to pad raises where transformers fails an assertion. Bad
lengths or sizes raise ValueError up front. Each sampler counts its epochs in ``iterations_started``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler, Sampler

from .. import _native
from .lengths import as_length_array, lengths_from_dataset

# Larger batch sizes behave exactly like one megabatch holding everything; clamp so Rust gets a usize.
_MAX_NATIVE_SIZE = 2**62


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{what} must be a positive integer, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value}")
    return int(value)


def _resolve_lengths(dataset: Any, lengths: Any, model_input_name: str | None) -> np.ndarray:
    if dataset is None and lengths is None:
        raise ValueError("One of dataset and lengths must be provided.")
    if lengths is None:
        if hasattr(dataset, "__len__") and len(dataset) == 0:
            # transformers reads dataset[0] first, which raises IndexError for an empty dataset.
            raise IndexError(
                "cannot infer lengths from an empty dataset (transformers' sampler raises this too)"
            )
        return lengths_from_dataset(dataset, model_input_name)
    array = as_length_array(lengths)
    if dataset is not None and hasattr(dataset, "__len__") and len(dataset) != len(array):
        raise ValueError(f"got {len(array)} lengths for a dataset of {len(dataset)} examples")
    return array


def length_grouped_indices(
    lengths: Any,
    batch_size: int,
    mega_batch_mult: int | None = None,
    generator: torch.Generator | None = None,
) -> np.ndarray:
    """``transformers.trainer_pt_utils.get_length_grouped_indices`` as an int64 numpy array.

    The permutation is ``torch.randperm(len(lengths), generator=generator)``, as in transformers, so the
    generator advances identically.
    """
    if not (isinstance(lengths, np.ndarray) and lengths.dtype == np.int64 and lengths.flags.c_contiguous):
        lengths = as_length_array(lengths)
    batch_size = _positive_int(batch_size, "batch_size")
    if mega_batch_mult is not None:
        mega_batch_mult = min(_positive_int(mega_batch_mult, "mega_batch_mult"), _MAX_NATIVE_SIZE)
    permutation = torch.randperm(len(lengths), generator=generator).cpu().numpy()
    if len(lengths) == 0:
        raise IndexError(
            "a length-grouped sampler over an empty dataset has nothing to sample "
            "(transformers' sampler raises this IndexError too, from torch.argmax)"
        )
    return _native.length_grouped_indices(
        permutation, lengths, min(batch_size, _MAX_NATIVE_SIZE), mega_batch_mult
    )


class LengthGroupedSampler(Sampler):
    r"""Samples indices so that examples of similar length are batched together, with some randomness.

    Same arguments and index order as ``transformers.trainer_pt_utils.LengthGroupedSampler``.
    """

    def __init__(
        self,
        batch_size: int,
        dataset: Any = None,
        lengths: Any = None,
        model_input_name: str | None = None,
        generator: torch.Generator | None = None,
    ):
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.lengths = _resolve_lengths(dataset, lengths, model_input_name)
        self.generator = generator
        self.iterations_started = 0  # evidence for fasttrain's status that this sampler ran

    def __len__(self) -> int:
        return len(self.lengths)

    def indices(self) -> np.ndarray:
        """One epoch's order as an int64 array (advances the generator like one ``iter()``)."""
        return length_grouped_indices(self.lengths, self.batch_size, generator=self.generator)

    def __iter__(self) -> Iterator[int]:
        self.iterations_started += 1
        return iter(self.indices().tolist())


class DistributedLengthGroupedSampler(DistributedSampler):
    r"""Length-grouped sampling for distributed training: each rank gets its slice of one shared order.

    Same arguments, ``set_epoch`` and index order as
    ``transformers.trainer_pt_utils.DistributedLengthGroupedSampler``: the order of an epoch depends on
    ``seed + epoch`` only; it is padded by repeating its head (or cut, with ``drop_last``) to a multiple
    of ``num_replicas``, and rank ``r`` takes positions ``r, r + num_replicas, ...``.
    """

    # Like transformers, this does not call DistributedSampler.__init__ (which needs a dataset);
    # subclassing keeps isinstance checks in Accelerate and user code working.
    def __init__(
        self,
        batch_size: int,
        dataset: Any = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        lengths: Any = None,
        model_input_name: str | None = None,
    ):
        if dataset is None and lengths is None:
            raise ValueError("One of dataset and lengths must be provided.")
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            if not dist.is_available():
                raise RuntimeError("Requires distributed package to be available")
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.num_replicas = _positive_int(num_replicas, "num_replicas")
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be an integer in [0, {num_replicas}), got {rank!r}")
        self.rank = int(rank)
        self.epoch = 0
        self.drop_last = bool(drop_last)
        self.seed = seed
        self.lengths = _resolve_lengths(dataset, lengths, model_input_name)
        self.iterations_started = 0  # evidence for fasttrain's status that this sampler ran

        n = len(self.lengths)
        if self.drop_last and n % self.num_replicas != 0:
            self.num_samples = math.ceil((n - self.num_replicas) / self.num_replicas)
        else:
            self.num_samples = math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` (seeded with ``seed + epoch``) from the next ``iter()`` on."""
        self.epoch = epoch

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch, as an int64 array."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = length_grouped_indices(self.lengths, self.batch_size, generator=generator)
        if self.drop_last:
            order = order[: self.total_size]
        else:  # pad by repeating the head, as transformers does (once: it asserts the result is long enough)
            order = np.concatenate([order, order[: self.total_size - len(order)]])
        if len(order) != self.total_size:
            raise ValueError(
                f"{len(self.lengths)} examples are too few to pad the order to {self.total_size} for "
                f"{self.num_replicas} replicas (transformers' sampler fails an assertion here)"
            )
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        self.iterations_started += 1
        return iter(self.indices().tolist())


def check_max_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(
            f"max_tokens_per_batch must be a positive integer, got {value!r} ({type(value).__name__})"
        )
    if value < 1:
        raise ValueError(f"max_tokens_per_batch must be at least 1, got {value}")
    return min(int(value), 2**64 - 1)


def token_budget_batches(
    lengths: Any,
    max_tokens_per_batch: int,
    order: Any = None,
    num_replicas: int = 1,
    drop_last: bool = False,
) -> list[np.ndarray]:
    """``order`` (default ``0..n-1``) cut into batches of at most ``max_tokens_per_batch`` tokens each.

    Greedy in order: an example joins the current batch while the batch's summed lengths stay within the
    budget, else it starts the next batch; an example longer than the budget is a batch of its own (trained
    on, not dropped). The number of batches is then made a multiple of ``num_replicas`` by splitting the
    batch with the most tokens (of those with two or more examples) at half its tokens, so that every
    example is still in exactly one batch; with ``drop_last`` the trailing batches that do not fill a round
    of ranks are dropped instead. Raises ValueError for a budget below 1, bad lengths, an order that is not
    made of indices into ``lengths``, or too few examples to give every rank a batch.
    """
    budget = check_max_tokens(max_tokens_per_batch)
    lengths = as_length_array(lengths)
    if order is None:
        order = np.arange(len(lengths), dtype=np.int64)
    else:
        order = as_length_array(order, "order") if not _is_int64_array(order) else order
    num_replicas = _positive_int(num_replicas, "num_replicas")
    offsets = _native.token_budget_offsets(order, lengths, budget, num_replicas, bool(drop_last))
    return [order[start:end] for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]


def _is_int64_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == np.int64 and value.flags.c_contiguous


def _world() -> tuple[int, int]:
    """(world size, rank) of the initialized default process group, else (1, 0)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class TokenBudgetBatchSampler(Sampler[list[int]]):
    r"""Batches of whole examples holding at most ``max_tokens_per_batch`` tokens each, for packed rows.

    With padding-free (packed) batches a batch is one row of its examples end to end, so a fixed number of
    examples per batch gives rows of very different sizes (and memory peaks) on real, long-tailed lengths; a
    token budget keeps the row size stable. Use it as a DataLoader's ``batch_sampler``::

        sampler = fasttrain.TokenBudgetBatchSampler(4096, dataset=train_dataset, seed=args.seed)
        loader = DataLoader(train_dataset, batch_sampler=sampler, collate_fn=collator)

    Each epoch every example is in exactly one batch. The order is a random permutation
    (``torch.randperm`` from ``generator``, else from a generator seeded with ``seed + epoch``; call
    ``set_epoch`` each epoch as with ``DistributedSampler``), or transformers' length-grouped order with
    ``group_by_length=True`` (megabatches sized for the typical batch, ``max_tokens_per_batch`` over the mean
    length), or the dataset order with ``shuffle=False``; the order is cut greedily (see
    :func:`token_budget_batches`). An example longer than the budget gets a batch of its own: truncation is
    the tokenizer's or the collator's decision, not the sampler's.

    Data parallel: with ``num_replicas`` ranks (default: the initialized process group's size and rank,
    else 1 and 0) every rank draws the same order from ``seed + epoch`` (``generator`` is refused: ranks
    must agree), the batches are split until their number is a multiple of ``num_replicas``, and rank ``r``
    takes batches ``r, r + num_replicas, ...``: whole batches, the same number on every rank (none waits for
    another in a collective), each example once across ranks. ``drop_last=True`` drops the trailing batches
    that do not fill a round instead.

    ``len()`` is the number of batches of the epoch the next ``iter()`` runs (it varies a little with the
    order); with a ``generator`` that epoch's order is drawn when ``len()`` or ``iter()`` first needs it.
    """

    def __init__(
        self,
        max_tokens_per_batch: int,
        dataset: Any = None,
        lengths: Any = None,
        model_input_name: str | None = None,
        *,
        shuffle: bool = True,
        group_by_length: bool = False,
        generator: torch.Generator | None = None,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        drop_last: bool = False,
    ):
        self.max_tokens_per_batch = check_max_tokens(max_tokens_per_batch)
        self.lengths = _resolve_lengths(dataset, lengths, model_input_name)
        if num_replicas is None or rank is None:
            world, own = _world()
            num_replicas = world if num_replicas is None else num_replicas
            rank = own if rank is None else rank
        self.num_replicas = _positive_int(num_replicas, "num_replicas")
        if (
            isinstance(rank, bool)
            or not isinstance(rank, numbers.Integral)
            or not 0 <= rank < self.num_replicas
        ):
            raise ValueError(f"rank must be an integer in [0, {self.num_replicas}), got {rank!r}")
        if generator is not None and self.num_replicas > 1:
            raise ValueError(
                "TokenBudgetBatchSampler with num_replicas > 1 draws its order from seed + epoch so that every "
                "rank cuts the same batches: pass seed=..., not generator="
            )
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.group_by_length = bool(group_by_length)
        self.generator = generator
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.iterations_started = 0  # evidence for fasttrain's status that this sampler ran
        self._planned: tuple[int, list[np.ndarray]] | None = None  # (epoch, this rank's batches)

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` (seeded with ``seed + epoch`` when no generator was given)."""
        self.epoch = epoch

    def _order(self) -> np.ndarray:
        n = len(self.lengths)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        generator = self.generator
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
        if self.group_by_length and n:
            typical = max(1, self.max_tokens_per_batch // max(1, round(float(self.lengths.mean()))))
            return length_grouped_indices(self.lengths, min(typical, _MAX_NATIVE_SIZE), generator=generator)
        return torch.randperm(n, generator=generator).numpy()

    def batches(self) -> list[np.ndarray]:
        """This rank's batches for the epoch the next ``iter()`` runs, as int64 arrays."""
        if self._planned is None or self._planned[0] != self.epoch:
            every = token_budget_batches(
                self.lengths, self.max_tokens_per_batch, self._order(), self.num_replicas, self.drop_last
            )
            self._planned = (self.epoch, every[self.rank :: self.num_replicas])
        return self._planned[1]

    def __len__(self) -> int:
        return len(self.batches())

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.batches()
        self._planned = None  # the next epoch draws its own order
        self.iterations_started += 1
        return iter([batch.tolist() for batch in batches])
