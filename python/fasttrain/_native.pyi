"""Type stub for the native module ``fasttrain._native`` (Rust, PyO3)."""

__version__: str

# --- sampler --- (rust/sampler/python.rs)
import numpy as np
import numpy.typing as npt

def length_grouped_indices(
    permutation: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    batch_size: int,
    mega_batch_mult: int | None = None,
) -> npt.NDArray[np.int64]:
    """transformers' get_length_grouped_indices given the permutation torch.randperm(len(lengths))."""

def distributed_rank_indices(
    indices: npt.NDArray[np.int64], num_replicas: int, rank: int, drop_last: bool
) -> npt.NDArray[np.int64]:
    """The indices of `rank` out of one epoch's order (DistributedLengthGroupedSampler)."""

def torch_randperm(n: int, state: npt.NDArray[np.uint8]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
    """torch.randperm(n, generator=g) from g.get_state(): the permutation and the state for g.set_state()."""

# --- end sampler ---
