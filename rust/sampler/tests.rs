//! The sampler core against a line-by-line port of transformers' Python, on random inputs.

use super::grouping::{group_by_length, megabatch_size};
use super::test_rng::Rng;
use crate::errors::DataError;

/// transformers' `get_length_grouped_indices` after `torch.randperm`, written the obvious way.
fn reference(
    permutation: &[i64],
    lengths: &[i64],
    batch_size: usize,
    mult: Option<usize>,
) -> Vec<i64> {
    let n = lengths.len();
    let mult = mult.unwrap_or_else(|| (n / (batch_size * 4)).clamp(1, 50));
    let size = mult * batch_size;
    let mut megabatches: Vec<Vec<i64>> = permutation.chunks(size).map(<[i64]>::to_vec).collect();
    for mb in &mut megabatches {
        mb.sort_by_key(|&i| std::cmp::Reverse(lengths[i as usize])); // stable, like sorted(reverse=True)
    }
    if megabatches.is_empty() {
        return Vec::new();
    }
    let maximums: Vec<i64> = megabatches
        .iter()
        .map(|mb| lengths[mb[0] as usize])
        .collect();
    let max = *maximums.iter().max().unwrap();
    let max_idx = maximums.iter().position(|&m| m == max).unwrap(); // torch.argmax: first maximum
    let (head, tail) = (megabatches[0][0], megabatches[max_idx][0]);
    megabatches[0][0] = tail;
    megabatches[max_idx][0] = head;
    megabatches.concat()
}

fn grouped(
    permutation: &[i64],
    lengths: &[i64],
    batch_size: usize,
    mult: Option<usize>,
) -> Vec<i64> {
    let mut out = permutation.to_vec();
    group_by_length(&mut out, lengths, batch_size, mult).unwrap();
    out
}

#[test]
fn matches_reference_on_random_inputs() {
    let mut rng = Rng(7);
    for case in 0..3000 {
        let n = match case % 4 {
            0 => rng.below(8) as usize,
            1 => rng.below(100) as usize,
            2 => rng.below(2000) as usize,
            _ => rng.below(20_000) as usize,
        };
        let batch_size = 1 + rng.below(if case % 2 == 0 { 8 } else { 300 }) as usize;
        // Few distinct lengths means many ties; large lengths exercise the general (unpacked) path.
        let max_len = match case % 5 {
            0 => 2,
            1 => 5,
            2 => 1000,
            3 => 1 << 40,
            _ => i64::MAX,
        };
        let lengths: Vec<i64> = (0..n)
            .map(|_| (rng.next() % (max_len as u64)) as i64)
            .collect();
        let perm = rng.permutation(n);
        let mult = if case % 7 == 0 {
            Some(1 + rng.below(5) as usize)
        } else {
            None
        };
        assert_eq!(
            grouped(&perm, &lengths, batch_size, mult),
            reference(&perm, &lengths, batch_size, mult),
            "case {case}: n={n} batch_size={batch_size} max_len={max_len} mult={mult:?}"
        );
    }
}

#[test]
fn result_is_a_permutation_with_the_longest_first() {
    let mut rng = Rng(11);
    let lengths: Vec<i64> = (0..5000).map(|_| rng.below(512) as i64).collect();
    let out = grouped(&rng.permutation(5000), &lengths, 16, None);
    let mut sorted = out.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..5000).collect::<Vec<i64>>());
    assert_eq!(lengths[out[0] as usize], *lengths.iter().max().unwrap());
}

#[test]
fn ties_keep_permutation_order_and_the_first_maximal_megabatch_wins() {
    // All equal: every megabatch keeps its order, and the swap is with megabatch 0 itself.
    let perm: Vec<i64> = vec![5, 3, 9, 0, 1, 2, 4, 6, 7, 8];
    assert_eq!(grouped(&perm, &[4; 10], 2, None), perm);
    // Megabatches of 2: [0,1] [2,3] [4,5]; heads after sorting: 1 (len 7), 2 (len 9), 4 (len 9).
    let lengths = [3, 7, 9, 1, 9, 9];
    let out = grouped(&[0, 1, 2, 3, 4, 5], &lengths, 2, None);
    assert_eq!(out, vec![2, 0, 1, 3, 4, 5]);
}

#[test]
fn megabatch_size_follows_transformers() {
    assert_eq!(megabatch_size(0, 4, None), Ok(4)); // mult 0 -> 1
    assert_eq!(megabatch_size(15, 4, None), Ok(4));
    assert_eq!(megabatch_size(16, 4, None), Ok(4));
    assert_eq!(megabatch_size(32, 4, None), Ok(8));
    assert_eq!(megabatch_size(1_000_000, 8, None), Ok(400)); // capped at 50
    assert_eq!(megabatch_size(10, 3, Some(2)), Ok(6));
    assert_eq!(megabatch_size(10, usize::MAX, None), Ok(usize::MAX));
    assert!(matches!(
        megabatch_size(10, 0, None),
        Err(DataError::Value(_))
    ));
    assert!(matches!(
        megabatch_size(10, 2, Some(0)),
        Err(DataError::Value(_))
    ));
}

#[test]
fn edge_sizes_do_not_panic() {
    assert_eq!(grouped(&[], &[], 1, None), Vec::<i64>::new());
    assert_eq!(grouped(&[0], &[3], 1, None), vec![0]);
    assert_eq!(grouped(&[2, 0, 1], &[1, 5, 3], 100, None), vec![1, 2, 0]);
    assert_eq!(
        grouped(&[2, 0, 1], &[1, 5, 3], usize::MAX, None),
        vec![1, 2, 0]
    );
}

#[test]
fn bad_input_is_an_error_naming_the_culprit() {
    let err = |perm: &[i64], lengths: &[i64], bs: usize| {
        let mut p = perm.to_vec();
        group_by_length(&mut p, lengths, bs, None)
            .unwrap_err()
            .to_string()
    };
    assert!(err(&[0, 1], &[1, -4], 1).contains("lengths[1] = -4"));
    assert!(err(&[0, 1], &[1, 2], 0).contains("batch_size"));
    assert!(err(&[0], &[1, 2], 1).contains("1 entries but there are 2 lengths"));
    assert!(err(&[0, 2], &[1, 2], 1).contains("permutation[1] = 2"));
    assert!(err(&[-1, 0], &[1, 2], 1).contains("permutation[0] = -1"));
}
