//! Token-budget batches against a plain reference written the obvious way, on random inputs.

use super::budget::{budget_batches, split_for_ranks};
use super::test_rng::Rng;

/// Next fit, as a person would write it: lists of indices.
fn reference(order: &[i64], lengths: &[i64], budget: u64) -> Vec<Vec<i64>> {
    let mut batches: Vec<Vec<i64>> = Vec::new();
    let mut current: Vec<i64> = Vec::new();
    let mut tokens = 0u64;
    for &i in order {
        let l = lengths[i as usize] as u64;
        if !current.is_empty() && tokens + l > budget {
            batches.push(std::mem::take(&mut current));
            tokens = 0;
        }
        current.push(i);
        tokens += l;
    }
    if !current.is_empty() {
        batches.push(current);
    }
    batches
}

fn as_batches(order: &[i64], offsets: &[usize]) -> Vec<Vec<i64>> {
    offsets
        .windows(2)
        .map(|w| order[w[0]..w[1]].to_vec())
        .collect()
}

fn tokens(batch: &[i64], lengths: &[i64]) -> u64 {
    batch.iter().map(|&i| lengths[i as usize] as u64).sum()
}

fn random_case(rng: &mut Rng, case: usize) -> (Vec<i64>, Vec<i64>, u64) {
    let n = match case % 3 {
        0 => rng.below(10) as usize,
        1 => rng.below(200) as usize,
        _ => rng.below(3000) as usize,
    };
    let max_len = [1, 4, 300, 2000][case % 4];
    let lengths: Vec<i64> = (0..n).map(|_| rng.below(max_len + 1) as i64).collect();
    let mut order: Vec<i64> = (0..n as i64).collect();
    for i in (1..n).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let budget = 1 + rng.below(if case % 2 == 0 { 64 } else { 4096 });
    (order, lengths, budget)
}

#[test]
fn matches_reference_on_random_inputs() {
    let mut rng = Rng(3);
    for case in 0..2000 {
        let (order, lengths, budget) = random_case(&mut rng, case);
        let offsets = budget_batches(&order, &lengths, budget).unwrap();
        assert_eq!(
            as_batches(&order, &offsets),
            reference(&order, &lengths, budget),
            "case {case}: n={} budget={budget}",
            order.len()
        );
    }
}

#[test]
fn every_batch_keeps_the_budget_unless_one_example_exceeds_it() {
    let lengths = [5, 1, 9, 2, 2, 2, 0, 7];
    let order: Vec<i64> = (0..8).collect();
    let offsets = budget_batches(&order, &lengths, 6).unwrap();
    assert_eq!(
        as_batches(&order, &offsets),
        vec![vec![0, 1], vec![2], vec![3, 4, 5, 6], vec![7]]
    );
    assert_eq!(budget_batches(&[], &[], 6).unwrap(), vec![0]);
}

#[test]
fn split_for_ranks_keeps_every_example_once_and_divides() {
    let mut rng = Rng(5);
    for case in 0..2000 {
        let (order, lengths, budget) = random_case(&mut rng, case);
        let ranks = 1 + rng.below(9) as usize;
        let mut offsets = budget_batches(&order, &lengths, budget).unwrap();
        let before = as_batches(&order, &offsets);
        let result = split_for_ranks(&order, &lengths, &mut offsets, ranks, false);
        if before.len().next_multiple_of(ranks) > order.len() {
            assert!(result.unwrap_err().to_string().contains("cannot be split"));
            continue;
        }
        result.unwrap();
        let after = as_batches(&order, &offsets);
        assert_eq!(after.len() % ranks, 0, "case {case}");
        assert!(after.len() - before.len() < ranks);
        assert_eq!(
            after.concat(),
            order,
            "the order is only cut, never changed"
        );
        assert!(after.iter().all(|b| !b.is_empty()));
        for batch in &after {
            // within budget, or a single example over it (as before the split)
            assert!(
                batch.len() == 1 || tokens(batch, &lengths) <= budget,
                "case {case}"
            );
        }
    }
}

#[test]
fn split_for_ranks_splits_the_largest_batch_at_half() {
    let lengths = [4, 4, 4, 4, 1, 1];
    let order: Vec<i64> = (0..6).collect();
    let mut offsets = vec![0, 4, 6]; // [0..4] has 16 tokens, [4..6] has 2
    split_for_ranks(&order, &lengths, &mut offsets, 3, false).unwrap();
    assert_eq!(offsets, vec![0, 2, 4, 6]);
    // drop_last drops the trailing batches that do not fill a round
    let mut offsets = vec![0, 4, 5, 6];
    split_for_ranks(&order, &lengths, &mut offsets, 2, true).unwrap();
    assert_eq!(offsets, vec![0, 4, 5]);
    let mut offsets = vec![0, 6];
    split_for_ranks(&order, &lengths, &mut offsets, 2, true).unwrap();
    assert_eq!(offsets, vec![0]);
}

#[test]
fn bad_input_is_an_error_naming_the_culprit() {
    let err = |order: &[i64], lengths: &[i64], budget: u64| {
        budget_batches(order, lengths, budget)
            .unwrap_err()
            .to_string()
    };
    assert!(err(&[0], &[1], 0).contains("max_tokens_per_batch"));
    assert!(err(&[0, 1], &[1, -3], 5).contains("lengths[1] = -3"));
    assert!(err(&[0, 2], &[1, 2], 5).contains("order[1] = 2"));
    assert!(err(&[-1], &[1], 5).contains("order[0] = -1"));
    let mut offsets = vec![0, 1];
    assert!(split_for_ranks(&[0], &[1], &mut offsets, 0, false)
        .unwrap_err()
        .to_string()
        .contains("num_replicas"));
    assert!(split_for_ranks(&[0], &[1], &mut offsets, 2, false)
        .unwrap_err()
        .to_string()
        .contains("1 examples in 1 token-budget batches cannot be split into a multiple of 2"));
}

#[test]
fn huge_lengths_do_not_overflow() {
    let lengths = [i64::MAX, i64::MAX, 1];
    let order = [0, 1, 2];
    let mut offsets = budget_batches(&order, &lengths, u64::MAX).unwrap();
    assert_eq!(offsets, vec![0, 3]);
    split_for_ranks(&order, &lengths, &mut offsets, 3, false).unwrap();
    assert_eq!(offsets, vec![0, 1, 2, 3]);
}
