//! Padding-free batches, as transformers' `DataCollatorWithFlattening` builds them: every
//! example concatenated into one row, labels separated by `separator_id`, positions restarting
//! per example, and the FlashAttention boundaries (`cu_seq_lens_*`, `max_length_*`).

use crate::errors::{DataError, DataResult};

use super::ragged::Ragged;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlattenSpec {
    pub separator_id: i64,
    pub position_ids_start: i64,
    pub position_ids: bool,
    pub seq_idx: bool,
    pub flash_attn_kwargs: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flattened {
    pub input_ids: Vec<i64>,
    pub labels: Vec<i64>,
    pub position_ids: Option<Vec<i64>>,
    /// int32, as transformers returns it.
    pub seq_idx: Option<Vec<i32>>,
    /// int32 cumulative lengths, starting at 0.
    pub cu_seq_lens: Option<Vec<i32>>,
    pub max_length: usize,
}

/// `input_ids` holds the non-empty examples only (transformers drops empty ones first);
/// `example_index[i]` is the caller's index of row `i`, for error messages. `labels`, when given,
/// has one row per `input_ids` row: its first token is replaced by the separator.
pub fn flatten(
    input_ids: &Ragged,
    labels: Option<&Ragged>,
    example_index: &[usize],
    spec: &FlattenSpec,
) -> DataResult<Flattened> {
    let n = input_ids.rows();
    if n == 0 {
        return Err(DataError::value(
            "DataCollatorWithFlattening received a batch where every example is empty.",
        ));
    }
    let total = input_ids.total_len();
    let index = |i: usize| example_index.get(i).copied().unwrap_or(i);

    let mut ids = Vec::with_capacity(total);
    let mut out_labels = Vec::with_capacity(total);
    for i in 0..n {
        let row = input_ids.row(i);
        ids.extend_from_slice(row);
        out_labels.push(spec.separator_id);
        let tail = match labels {
            Some(l) if i < l.rows() => {
                let lab = l.row(i);
                // transformers writes [sep] + labels[1:]: the row lengths must then agree.
                if lab.len().max(1) != row.len() {
                    return Err(DataError::value(format!(
                        "example {}: 'labels' has length {} but 'input_ids' has length {}",
                        index(i),
                        lab.len(),
                        row.len()
                    )));
                }
                lab.get(1..).unwrap_or(&[])
            }
            Some(_) => return Err(DataError::key(format!("example {}: no 'labels'", index(i)))),
            None => &row[1..],
        };
        out_labels.extend_from_slice(tail);
    }

    let position_ids = if spec.position_ids {
        let mut pos = Vec::with_capacity(total);
        for i in 0..n {
            let len = input_ids.row_len(i) as i64;
            let last = spec
                .position_ids_start
                .checked_add(len - 1)
                .ok_or_else(|| {
                    DataError::value(format!(
                        "position_ids_start {} overflows int64",
                        spec.position_ids_start
                    ))
                })?;
            pos.extend(spec.position_ids_start..=last);
        }
        Some(pos)
    } else {
        None
    };

    let seq_idx = if spec.seq_idx {
        let mut idx = Vec::with_capacity(total);
        for i in 0..n {
            idx.extend(std::iter::repeat_n(i as i32, input_ids.row_len(i)));
        }
        Some(idx)
    } else {
        None
    };

    let max_length = (0..n).map(|i| input_ids.row_len(i)).max().unwrap_or(0);
    let cu_seq_lens = if spec.flash_attn_kwargs {
        if total > i32::MAX as usize {
            return Err(DataError::value(format!(
                "the flattened batch has {total} tokens; cu_seq_lens are int32 and hold at most {}",
                i32::MAX
            )));
        }
        let mut cu = Vec::with_capacity(n + 1);
        cu.push(0i32);
        let mut acc = 0i32;
        for i in 0..n {
            acc += input_ids.row_len(i) as i32;
            cu.push(acc);
        }
        Some(cu)
    } else {
        None
    };

    Ok(Flattened {
        input_ids: ids,
        labels: out_labels,
        position_ids,
        seq_idx,
        cu_seq_lens,
        max_length,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> FlattenSpec {
        FlattenSpec {
            separator_id: -100,
            position_ids_start: 0,
            position_ids: true,
            seq_idx: true,
            flash_attn_kwargs: true,
        }
    }

    #[test]
    fn flattens_without_labels() {
        let ids = Ragged::from_rows(&[vec![1, 2, 3], vec![4, 5]]);
        let f = flatten(&ids, None, &[0, 1], &spec()).unwrap();
        assert_eq!(f.input_ids, vec![1, 2, 3, 4, 5]);
        assert_eq!(f.labels, vec![-100, 2, 3, -100, 5]);
        assert_eq!(f.position_ids.unwrap(), vec![0, 1, 2, 0, 1]);
        assert_eq!(f.seq_idx.unwrap(), vec![0, 0, 0, 1, 1]);
        assert_eq!(f.cu_seq_lens.unwrap(), vec![0, 3, 5]);
        assert_eq!(f.max_length, 3);
    }

    #[test]
    fn flattens_with_labels_and_start() {
        let ids = Ragged::from_rows(&[vec![1, 2], vec![4]]);
        let labels = Ragged::from_rows(&[vec![9, 8], vec![]]);
        let s = FlattenSpec {
            separator_id: 7,
            position_ids_start: 2,
            seq_idx: false,
            flash_attn_kwargs: false,
            ..spec()
        };
        let f = flatten(&ids, Some(&labels), &[0, 3], &s).unwrap();
        assert_eq!(f.labels, vec![7, 8, 7]);
        assert_eq!(f.position_ids.unwrap(), vec![2, 3, 2]);
        assert!(f.seq_idx.is_none() && f.cu_seq_lens.is_none());
    }

    #[test]
    fn label_length_mismatch_names_the_example() {
        let ids = Ragged::from_rows(&[vec![1, 2], vec![4, 5]]);
        let labels = Ragged::from_rows(&[vec![1, 2], vec![4]]);
        let err = flatten(&ids, Some(&labels), &[0, 5], &spec()).unwrap_err();
        assert!(err.message().starts_with("example 5"), "{err}");
    }

    #[test]
    fn empty_batch_is_an_error() {
        assert!(matches!(
            flatten(&Ragged::new(), None, &[], &spec()),
            Err(DataError::Value(_))
        ));
    }
}
