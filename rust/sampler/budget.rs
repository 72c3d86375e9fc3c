//! Token-budget batches: cut an index order into batches whose lengths sum to at most a budget, so
//! that a packed row (one row per batch, the examples end to end) keeps a stable size.
//!
//! The cut is greedy in the given order ("next fit"): an example joins the current batch while the
//! batch's tokens stay within the budget, else it starts the next one. The order itself (a random
//! permutation, optionally length-grouped) is decided by the caller, so the batches are as
//! deterministic as that order. An example longer than the budget gets a batch of its own: it is
//! trained on, never dropped or truncated (the collator's truncation, if any, already happened).
//!
//! For data-parallel training every rank must run the same number of batches (a rank that runs out
//! first leaves the others waiting in a collective) and every example must still be seen once:
//! `split_for_ranks` splits the largest batches until the count is a multiple of the world size.

use crate::errors::{DataError, DataResult};

/// Batch boundaries into `order`: batch `b` is `order[offsets[b]..offsets[b + 1]]`. Always starts at
/// 0 and ends at `order.len()`; an empty order has no batch (`[0]`).
pub type Offsets = Vec<usize>;

/// Checks `order` (indices into `lengths`) and `lengths` (non-negative), naming the first bad entry.
fn validate(order: &[i64], lengths: &[i64]) -> DataResult<()> {
    if let Some(i) = lengths.iter().position(|&l| l < 0) {
        return Err(DataError::value(format!(
            "lengths must be non-negative, but lengths[{i}] = {}",
            lengths[i]
        )));
    }
    let n = lengths.len() as u64;
    if let Some(p) = order.iter().position(|&i| i < 0 || i as u64 >= n) {
        return Err(DataError::value(format!(
            "order[{p}] = {} is not an index into {n} lengths",
            order[p]
        )));
    }
    Ok(())
}

/// Greedy next-fit batches of `order` within `max_tokens` tokens each (see the module comment).
pub fn budget_batches(order: &[i64], lengths: &[i64], max_tokens: u64) -> DataResult<Offsets> {
    if max_tokens == 0 {
        return Err(DataError::value(
            "max_tokens_per_batch must be at least 1, got 0",
        ));
    }
    validate(order, lengths)?;
    let mut offsets = vec![0];
    let mut tokens: u64 = 0;
    for (position, &index) in order.iter().enumerate() {
        let length = lengths[index as usize] as u64; // validated: non-negative
                                                     // A batch is never empty: the first example of a batch always joins it, whatever its length.
        if position > *offsets.last().unwrap() && tokens.saturating_add(length) > max_tokens {
            offsets.push(position);
            tokens = 0;
        }
        tokens = tokens.saturating_add(length);
    }
    if !order.is_empty() {
        offsets.push(order.len());
    }
    Ok(offsets)
}

/// Tokens of each batch.
fn batch_tokens(order: &[i64], lengths: &[i64], offsets: &[usize]) -> Vec<u64> {
    offsets
        .windows(2)
        .map(|w| {
            order[w[0]..w[1]]
                .iter()
                .map(|&i| lengths[i as usize] as u64)
                .fold(0u64, u64::saturating_add)
        })
        .collect()
}

/// Makes the number of batches a multiple of `num_replicas` without repeating or dropping an example
/// (unless `drop_last`): the batch with the most tokens among those holding two or more examples
/// (the first such on ties) is split where its first part reaches half its tokens, until the count
/// divides. Each part keeps within the budget, as the whole did. With `drop_last` the trailing
/// batches that do not fill a round of ranks are dropped instead, as `DistributedSampler` drops
/// trailing examples. Too few examples to reach a multiple (one example a batch) is an error.
pub fn split_for_ranks(
    order: &[i64],
    lengths: &[i64],
    offsets: &mut Offsets,
    num_replicas: usize,
    drop_last: bool,
) -> DataResult<()> {
    if num_replicas == 0 {
        return Err(DataError::value("num_replicas must be at least 1, got 0"));
    }
    validate(order, lengths)?;
    let batches = offsets.len().saturating_sub(1);
    let missing = (num_replicas - batches % num_replicas) % num_replicas;
    if missing == 0 {
        return Ok(());
    }
    if drop_last {
        offsets.truncate(batches - batches % num_replicas + 1);
        return Ok(());
    }
    if batches + missing > order.len() {
        // Splitting stops at one example a batch: this many examples cannot fill a round of ranks.
        return Err(DataError::value(format!(
            "{} examples in {batches} token-budget batches cannot be split into a multiple of \
             {num_replicas} batches (one per rank each step); pass drop_last=True to drop the last \
             {} batch(es), or use fewer ranks",
            order.len(),
            batches % num_replicas
        )));
    }
    let mut tokens = batch_tokens(order, lengths, offsets);
    for _ in 0..missing {
        // The first batch of two or more examples with the most tokens. One exists: fewer batches
        // than examples (checked above) means some batch holds two.
        let mut best: Option<usize> = None;
        for b in 0..tokens.len() {
            if offsets[b + 1] - offsets[b] >= 2 && best.is_none_or(|k| tokens[b] > tokens[k]) {
                best = Some(b);
            }
        }
        let Some(b) = best else {
            return Err(DataError::value(
                "no batch of two or more examples left to split",
            ));
        };
        let (start, end) = (offsets[b], offsets[b + 1]);
        // The first cut at which the prefix holds at least half the tokens, kept inside (start, end).
        let half = tokens[b].div_ceil(2);
        let mut prefix = 0u64;
        let mut cut = start + 1;
        for (position, &index) in order.iter().enumerate().take(end - 1).skip(start) {
            prefix = prefix.saturating_add(lengths[index as usize] as u64);
            cut = position + 1;
            if prefix >= half {
                break;
            }
        }
        offsets.insert(b + 1, cut);
        let rest = tokens[b].saturating_sub(prefix);
        tokens[b] = prefix;
        tokens.insert(b + 1, rest);
    }
    Ok(())
}
