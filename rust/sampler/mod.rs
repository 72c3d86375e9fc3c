//! The length-grouped sampler's index order (transformers' `get_length_grouped_indices`) and the
//! per-rank split of `DistributedLengthGroupedSampler`.
//!
//! The random permutation is `torch.randperm(n, generator)`, so the order is exactly the reference's:
//! either torch draws it, or `torch_rng` reproduces it from the generator's state (checked against
//! torch at run time). Everything after the permutation is here too: megabatch split, stable
//! descending sort by length, longest example to the front, rank slicing.

pub mod distributed;
pub mod grouping;
mod prefetch;
pub mod python;
pub mod torch_rng;

#[cfg(test)]
mod tests;
