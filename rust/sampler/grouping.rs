//! `get_length_grouped_indices` after the permutation: split the permutation into megabatches,
//! sort each by length (descending, stable), and move the globally longest example to the front.

use crate::errors::{DataError, DataResult};

/// Upper bound of the default megabatch multiplier (transformers: `min(n // (4 * bs), 50)`).
const MAX_MEGA_BATCH_MULT: usize = 50;

/// Number of indices per megabatch, as transformers computes it.
///
/// Default multiplier: `min(n // (4 * batch_size), 50)`, raised to 1 for tiny datasets. An
/// explicit `mega_batch_mult` is used as given (it must be at least 1).
pub fn megabatch_size(
    n: usize,
    batch_size: usize,
    mega_batch_mult: Option<usize>,
) -> DataResult<usize> {
    if batch_size == 0 {
        return Err(DataError::value("batch_size must be at least 1, got 0"));
    }
    let mult = match mega_batch_mult {
        Some(0) => {
            return Err(DataError::value(
                "mega_batch_mult must be at least 1, got 0",
            ))
        }
        Some(m) => m,
        // n / bs / 4 == n / (4 * bs) for positive integers, without the overflow of 4 * bs.
        None => (n / batch_size / 4).clamp(1, MAX_MEGA_BATCH_MULT),
    };
    // Saturating: a megabatch larger than n is simply one megabatch.
    Ok(mult.saturating_mul(batch_size))
}

/// Checks that every length is non-negative; the error names the first bad one.
pub fn validate_lengths(lengths: &[i64]) -> DataResult<()> {
    match lengths.iter().position(|&l| l < 0) {
        None => Ok(()),
        Some(i) => Err(DataError::value(format!(
            "lengths must be non-negative, but lengths[{i}] = {}",
            lengths[i]
        ))),
    }
}

/// Checks that `permutation` has one entry per length and only valid indices (it comes from
/// `torch.randperm`, but a wrong one must give an error, never an out-of-bounds access).
fn validate_permutation(permutation: &[i64], n: usize) -> DataResult<()> {
    if permutation.len() != n {
        return Err(DataError::value(format!(
            "the permutation has {} entries but there are {n} lengths",
            permutation.len()
        )));
    }
    match permutation
        .iter()
        .position(|&i| i < 0 || i as u64 >= n as u64)
    {
        None => Ok(()),
        Some(p) => Err(DataError::value(format!(
            "permutation[{p}] = {} is not an index into {n} lengths",
            permutation[p]
        ))),
    }
}

/// Reorders `permutation` in place into transformers' length-grouped order.
///
/// `permutation` is `torch.randperm(len(lengths))`; the result is the concatenation of its
/// megabatches, each sorted by descending length with ties kept in permutation order (Python's
/// `sorted(..., reverse=True)` is stable), after swapping the first element of the first megabatch
/// with the first element of the first megabatch holding the maximum length (`torch.argmax`
/// returns the first maximum).
pub fn group_by_length(
    permutation: &mut [i64],
    lengths: &[i64],
    batch_size: usize,
    mega_batch_mult: Option<usize>,
) -> DataResult<()> {
    let n = lengths.len();
    let size = megabatch_size(n, batch_size, mega_batch_mult)?;
    validate_lengths(lengths)?;
    validate_permutation(permutation, n)?;
    if n == 0 {
        return Ok(());
    }

    let max_len = lengths.iter().copied().max().unwrap_or(0);
    let packed = max_len <= i64::from(u32::MAX) && size <= u32::MAX as usize;
    let sort = |part: &mut [i64]| {
        if packed {
            sort_megabatches_packed(part, lengths, size);
        } else {
            sort_megabatches_general(part, lengths, size);
        }
    };
    // Megabatches are independent: large orders are split between threads at megabatch boundaries.
    let threads = worker_count(n);
    if threads > 1 {
        let megabatches_per_thread = n.div_ceil(size).div_ceil(threads);
        std::thread::scope(|scope| {
            for part in permutation.chunks_mut(megabatches_per_thread.saturating_mul(size)) {
                scope.spawn(|| sort(part));
            }
        });
    } else {
        sort(permutation);
    }
    longest_to_front(permutation, lengths, size);
    Ok(())
}

/// Below this many indices a thread costs more than it saves.
const MIN_INDICES_PER_THREAD: usize = 1 << 17;

fn worker_count(n: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    cores.min(n / MIN_INDICES_PER_THREAD).max(1)
}

/// The common case: lengths and in-megabatch positions both fit 32 bits, so one u64 key
/// `(u32::MAX - length) << 32 | position` sorts ascending into "longest first, ties in original
/// order" — a stable descending sort done as a fast unstable sort of distinct keys.
fn sort_megabatches_packed(permutation: &mut [i64], lengths: &[i64], size: usize) {
    let mut keys: Vec<u64> = Vec::with_capacity(size.min(permutation.len()));
    let mut original: Vec<i64> = Vec::with_capacity(keys.capacity());
    for megabatch in permutation.chunks_mut(size) {
        keys.clear();
        keys.extend(megabatch.iter().enumerate().map(|(pos, &index)| {
            let inverted = u64::from(u32::MAX) - lengths[index as usize] as u64;
            (inverted << 32) | pos as u64
        }));
        keys.sort_unstable();
        original.clear();
        original.extend_from_slice(megabatch);
        for (slot, key) in megabatch.iter_mut().zip(&keys) {
            *slot = original[(key & u64::from(u32::MAX)) as usize];
        }
    }
}

/// Any lengths: a stable sort by descending length on (length, index) pairs.
fn sort_megabatches_general(permutation: &mut [i64], lengths: &[i64], size: usize) {
    let mut pairs: Vec<(i64, i64)> = Vec::with_capacity(size.min(permutation.len()));
    for megabatch in permutation.chunks_mut(size) {
        pairs.clear();
        pairs.extend(
            megabatch
                .iter()
                .map(|&index| (lengths[index as usize], index)),
        );
        pairs.sort_by_key(|pair| std::cmp::Reverse(pair.0)); // stable
        for (slot, &(_, index)) in megabatch.iter_mut().zip(&pairs) {
            *slot = index;
        }
    }
}

/// Swaps the head of the first megabatch with the head of the first megabatch whose head (its
/// longest example) is the overall maximum.
fn longest_to_front(permutation: &mut [i64], lengths: &[i64], size: usize) {
    let mut best_start = 0;
    let mut best_len = lengths[permutation[0] as usize];
    for start in (0..permutation.len()).step_by(size).skip(1) {
        let head_len = lengths[permutation[start] as usize];
        if head_len > best_len {
            best_len = head_len;
            best_start = start;
        }
    }
    permutation.swap(0, best_start);
}
