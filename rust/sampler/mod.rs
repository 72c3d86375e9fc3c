//! The length-grouped sampler's index order (transformers' `get_length_grouped_indices`) and the
//! per-rank split of `DistributedLengthGroupedSampler`.
//!
//! The random permutation is drawn in Python with `torch.randperm` (so the generator state, and
//! hence the order, is exactly the reference's); everything after the permutation is here:
//! megabatch split, stable descending sort by length, longest example to the front, rank slicing.

pub mod distributed;
pub mod grouping;
pub mod python;

#[cfg(test)]
mod tests;
