"""Drop-in ``LengthGroupedSampler`` and ``DistributedLengthGroupedSampler`` (Rust index order).

Same constructor arguments and the same index order as ``transformers.trainer_pt_utils``' classes for
the same generator state: the permutation is ``torch.randperm(n, generator=generator)`` (reproduced
natively from a CPU generator's state, see :func:`randperm`); the megabatch split, the stable
descending sort by length and the longest-first swap run in Rust without the GIL. Lengths of a
``datasets.Dataset`` come from Arrow (see :mod:`fasttrain.data.lengths`) instead of a Python pass over
every row.

Differences from transformers, all where transformers fails: an empty dataset gives an empty order
(transformers raises in ``torch.argmax``); a distributed order shorter than the padding it needs is
repeated cyclically (transformers fails an assertion); bad lengths or sizes raise ValueError up front.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler, Sampler

from .. import _native
from .._logging import log_once
from .lengths import as_length_array, lengths_from_dataset

# Larger batch sizes behave exactly like one megabatch holding everything; clamp so Rust gets a usize.
_MAX_NATIVE_SIZE = 2**62
# torch.randperm shuffles with 32-bit draws for n < UINT32_MAX / 20 (the native copy's range).
_NATIVE_RANDPERM_MAX_N = (2**32 - 1) // 20
# Indices are turned into Python ints this many at a time, as the iteration reaches them.
_INT_CHUNK = 1 << 16


def _python_ints(order: np.ndarray) -> Iterator[int]:
    """Iterate ``order`` as Python ints (like transformers' list) without converting it all up front."""
    chunks = (order[start : start + _INT_CHUNK] for start in range(0, len(order), _INT_CHUNK))
    return itertools.chain.from_iterable(map(np.ndarray.tolist, chunks))


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
        return lengths_from_dataset(dataset, model_input_name)
    array = as_length_array(lengths)
    if dataset is not None and hasattr(dataset, "__len__") and len(dataset) != len(array):
        raise ValueError(f"got {len(array)} lengths for a dataset of {len(dataset)} examples")
    return array


def randperm(n: int, generator: torch.Generator | None = None) -> np.ndarray:
    """``torch.randperm(n, generator=generator).numpy()``, the same permutation and generator state after.

    For a CPU generator the shuffle runs natively from the generator's state (torch's own loop is the
    slowest step of an epoch's order at a million indices); anything else, or a torch whose generator
    does not pass the one-time check against ``torch.randperm``, uses ``torch.randperm`` itself.
    """
    if generator is None:
        generator = torch.default_generator
    if generator.device.type != "cpu" or n >= _NATIVE_RANDPERM_MAX_N or not _native_randperm_agrees():
        return torch.randperm(n, generator=generator).numpy()
    # torch holds the generator's lock for one randperm; here get/set_state bracket the shuffle instead,
    # which differs only if another thread draws from the same generator at the same moment.
    permutation, state = _native.torch_randperm(n, generator.get_state().numpy())
    generator.set_state(torch.from_numpy(state))
    return permutation


@functools.cache
def _native_randperm_agrees() -> bool:
    """Once per process: the native shuffle gives torch.randperm's permutation and generator state."""
    try:
        for seed, draws_before, n in ((0, 0, 0), (1, 0, 1), (2, 3, 2), (3, 700, 1000), (4, 5, 5000)):
            ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            for g in (ours, theirs):
                torch.randint(0, 2**31, (draws_before,), generator=g)  # a state mid-block
            permutation, state = _native.torch_randperm(n, ours.get_state().numpy())
            ours.set_state(torch.from_numpy(state))
            expected = torch.randperm(n, generator=theirs).numpy()
            if not np.array_equal(permutation, expected) or not torch.equal(
                ours.get_state(), theirs.get_state()
            ):
                raise ValueError(f"differs from torch.randperm at seed={seed}, n={n}")
    except (ValueError, RuntimeError) as err:
        log_once(
            "sampler-native-randperm",
            f"fasttrain sampler: using torch.randperm (the native shuffle does not match this torch: {err})",
        )
        return False
    return True


def length_grouped_indices(
    lengths: np.ndarray,
    batch_size: int,
    mega_batch_mult: int | None = None,
    generator: torch.Generator | None = None,
) -> np.ndarray:
    """``transformers.trainer_pt_utils.get_length_grouped_indices`` as an int64 numpy array.

    The permutation is ``torch.randperm(len(lengths), generator=generator)``, as in transformers.
    """
    if not (isinstance(lengths, np.ndarray) and lengths.dtype == np.int64 and lengths.flags.c_contiguous):
        lengths = as_length_array(lengths)
    batch_size = _positive_int(batch_size, "batch_size")
    if mega_batch_mult is not None:
        mega_batch_mult = min(_positive_int(mega_batch_mult, "mega_batch_mult"), _MAX_NATIVE_SIZE)
    permutation = randperm(len(lengths), generator)
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
        return _python_ints(self.indices())


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
        return _native.distributed_rank_indices(order, self.num_replicas, self.rank, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        return _python_ints(self.indices())
