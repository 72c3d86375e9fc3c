"""Drop-in ``LengthGroupedSampler`` and ``DistributedLengthGroupedSampler`` (grouping in Rust).

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
