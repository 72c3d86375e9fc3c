//! `DistributedLengthGroupedSampler`'s split of one epoch's indices between ranks.

use crate::errors::{DataError, DataResult};

/// Indices per rank and indices over all ranks, as `DistributedLengthGroupedSampler` computes them.
///
/// Without `drop_last` (or when `n` divides evenly) every rank gets `ceil(n / replicas)` and the
/// order is padded by repeating its head; with `drop_last` the tail is dropped instead:
/// transformers' `ceil((n - replicas) / replicas)` is `n / replicas` rounded down when `n` does
/// not divide evenly (and 0 when `n < replicas`).
pub fn samples_per_rank(
    n: usize,
    num_replicas: usize,
    drop_last: bool,
) -> DataResult<(usize, usize)> {
    if num_replicas == 0 {
        return Err(DataError::value("num_replicas must be at least 1, got 0"));
    }
    let num_samples = if drop_last {
        n / num_replicas
    } else {
        n / num_replicas + usize::from(n % num_replicas != 0)
    };
    let total = num_samples
        .checked_mul(num_replicas)
        .ok_or_else(|| DataError::value(format!("num_replicas={num_replicas} is too large")))?;
    Ok((num_samples, total))
}

/// The indices of one rank: position `rank + k * num_replicas` of the padded (or truncated) order.
///
/// Padding repeats the order from its start. transformers pads with `indices[:total - n]`, which is
/// the same as long as the padding is no longer than the order; past that (fewer indices than
/// ranks) it fails an assertion, and here the order is repeated cyclically, as
/// `torch.utils.data.DistributedSampler` does.
pub fn rank_indices(
    indices: &[i64],
    num_replicas: usize,
    rank: usize,
    drop_last: bool,
) -> DataResult<Vec<i64>> {
    let (num_samples, _) = samples_per_rank(indices.len(), num_replicas, drop_last)?;
    if rank >= num_replicas {
        return Err(DataError::value(format!(
            "rank must be in [0, {num_replicas}) for num_replicas={num_replicas}, got {rank}"
        )));
    }
    if indices.is_empty() {
        return Ok(Vec::new());
    }
    Ok((0..num_samples)
        .map(|k| indices[(rank + k * num_replicas) % indices.len()])
        .collect())
}
