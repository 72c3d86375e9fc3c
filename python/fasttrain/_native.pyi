"""Type stub for the native module ``fasttrain._native`` (Rust, PyO3)."""

import numpy as np
import numpy.typing as npt

__version__: str

# --- collate --- (rust/collate/python.rs)

def pad_features(
    features: list[object],
    keys: list[tuple[str, int]],
    *,
    padding: str,
    max_length: int | None,
    pad_to_multiple_of: int | None,
    padding_side: str,
    attention_mask: bool,
) -> list[npt.NDArray[np.int64]]:
    """Pad `keys` (name, pad value) of a list of feature mappings to one width (tokenizer.pad rules).

    `padding` is "longest", "max_length" or "do_not_pad". The first key decides the width; the
    others must have its lengths. One int64 [batch, width] array per key, then the attention mask
    when `attention_mask` is true. ValueError/TypeError/KeyError name the example and the key.
    """

def causal_lm_labels(input_ids: npt.NDArray[np.int64], pad_token_id: int | None) -> npt.NDArray[np.int64]:
    """A copy of 2-d `input_ids` with values equal to `pad_token_id` set to -100."""

def flatten_features(
    features: list[object],
    *,
    separator_id: int,
    position_ids_start: int,
    position_ids: bool,
    seq_idx: bool,
    flash_attn_kwargs: bool,
) -> tuple[
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64] | None,
    npt.NDArray[np.int32] | None,
    npt.NDArray[np.int32] | None,
    int,
]:
    """DataCollatorWithFlattening's batch: (input_ids, labels, position_ids, seq_idx, cu_seq_lens, max_length)."""
# --- end collate ---

# --- sampler --- (rust/sampler/python.rs)

def length_grouped_indices(
    permutation: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    batch_size: int,
    mega_batch_mult: int | None = None,
) -> npt.NDArray[np.int64]:
    """transformers' get_length_grouped_indices given the permutation torch.randperm(len(lengths))."""

# --- end sampler ---
