//! The length-grouped sampler's index order after the permutation (transformers'
//! `get_length_grouped_indices`): megabatch split, stable descending sort by length, longest
//! example to the front. The permutation itself is `torch.randperm(n, generator)`, drawn in Python
//! exactly as transformers draws it, so the order is the reference's for the same generator state.
//! `budget` cuts an order into token-budget batches (for packed rows) and splits them evenly over ranks.

pub mod budget;
pub mod grouping;
pub mod python;

#[cfg(test)]
mod test_rng;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_budget;
