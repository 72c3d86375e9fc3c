//! Padding a batch to one width, with the semantics of transformers' `tokenizer.pad` (and the
//! label padding of `DataCollatorForSeq2Seq`, which follows the same rules).
//!
//! transformers never truncates while padding: a row longer than the target keeps its length,
//! and the batch then cannot become one tensor. We report that case (and ragged batches when
//! padding is off) as an error naming the example, where transformers would fail later with a
//! generic "Unable to create tensor" or, with a single example, return mismatched shapes.

use crate::errors::{DataError, DataResult};

use super::ragged::Ragged;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Left,
    Right,
}

/// transformers' `PaddingStrategy`, once `max_length` has been resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PadTo {
    /// Pad to the longest row of the batch.
    Longest,
    /// Pad to this length.
    MaxLength(usize),
    /// No padding: every row must already have the same length.
    DoNotPad,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PadSpec {
    pub to: PadTo,
    /// Round the target length up to a multiple of this (never adds a block when aligned).
    pub multiple: Option<usize>,
    pub side: Side,
}

/// A padded batch, row-major `[rows, width]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Padded {
    pub values: Vec<i64>,
    pub rows: usize,
    pub width: usize,
}

fn round_up(length: usize, multiple: Option<usize>) -> DataResult<usize> {
    match multiple {
        None => Ok(length),
        Some(0) => Err(DataError::value(
            "pad_to_multiple_of must be a positive integer, got 0",
        )),
        Some(m) if length % m == 0 => Ok(length),
        Some(m) => (length / m + 1).checked_mul(m).ok_or_else(|| {
            DataError::value(format!(
                "padded length overflows: {length} rounded up to a multiple of {m}"
            ))
        }),
    }
}

/// The common width of the padded batch. `lengths` are the row lengths of the key that decides
/// (`input_ids`); `key` names it in errors.
pub fn common_width(lengths: &[usize], spec: &PadSpec, key: &str) -> DataResult<usize> {
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let target = match spec.to {
        PadTo::Longest => Some(round_up(longest, spec.multiple)?),
        PadTo::MaxLength(m) => Some(round_up(m, spec.multiple)?),
        PadTo::DoNotPad => None,
    };
    // Rows shorter than the target are padded; longer rows keep their length (no truncation).
    let final_len = |len: usize| match target {
        Some(t) if len < t => t,
        _ => len,
    };
    let Some(&first) = lengths.first() else {
        return Ok(target.unwrap_or(0));
    };
    let width = final_len(first);
    for (i, &len) in lengths.iter().enumerate() {
        if final_len(len) != width {
            return Err(match target {
                Some(t) => {
                    let (i, len) = lengths
                        .iter()
                        .enumerate()
                        .find(|(_, &l)| l > t)
                        .map_or((i, len), |(j, &l)| (j, l));
                    DataError::value(format!(
                        "example {i}: '{key}' has length {len}, longer than the padding length {t}; \
                         padding does not truncate (truncate when tokenizing or raise max_length)"
                    ))
                }
                None => DataError::value(format!(
                    "example {i}: '{key}' has length {len} but example 0 has length {first}; \
                     with padding disabled every example must have the same length"
                )),
            });
        }
    }
    Ok(width)
}

/// Pads every row of `rows` to `width` with `pad` on `side`. Each output value is written once.
pub fn pad_rows(
    rows: &Ragged,
    width: usize,
    pad: i64,
    side: Side,
    key: &str,
) -> DataResult<Padded> {
    let n = rows.rows();
    let mut values = Vec::with_capacity(n * width);
    for i in 0..n {
        let row = rows.row(i);
        let fill = width.checked_sub(row.len()).ok_or_else(|| {
            DataError::value(format!(
                "example {i}: '{key}' has length {}, longer than the batch width {width}",
                row.len()
            ))
        })?;
        if side == Side::Left {
            values.resize(values.len() + fill, pad);
        }
        values.extend_from_slice(row);
        if side == Side::Right {
            values.resize(values.len() + fill, pad);
        }
    }
    Ok(Padded {
        values,
        rows: n,
        width,
    })
}

/// The attention mask transformers builds when the examples carry none: 1 on tokens, 0 on padding.
pub fn attention_mask(lengths: &[usize], width: usize, side: Side) -> DataResult<Padded> {
    let mut values = Vec::with_capacity(lengths.len() * width);
    for (i, &len) in lengths.iter().enumerate() {
        let fill = width.checked_sub(len).ok_or_else(|| {
            DataError::value(format!(
                "example {i}: length {len} is longer than the batch width {width}"
            ))
        })?;
        let (first, second) = if side == Side::Left {
            ((fill, 0), (len, 1))
        } else {
            ((len, 1), (fill, 0))
        };
        values.resize(values.len() + first.0, first.1);
        values.resize(values.len() + second.0, second.1);
    }
    Ok(Padded {
        values,
        rows: lengths.len(),
        width,
    })
}

/// Checks that a key padded alongside the main key has the same length in every example.
pub fn check_same_lengths(
    main: &[usize],
    main_key: &str,
    other: &[usize],
    other_key: &str,
) -> DataResult<()> {
    for (i, (&a, &b)) in main.iter().zip(other).enumerate() {
        if a != b {
            return Err(DataError::value(format!(
                "example {i}: '{other_key}' has length {b} but '{main_key}' has length {a}"
            )));
        }
    }
    Ok(())
}

/// Causal-LM labels: a copy of `input_ids` with every value equal to the pad id set to
/// `ignore_index` (by value, as transformers does: a real token equal to the pad id is ignored too).
pub fn labels_from_ids(
    input_ids: &[i64],
    pad_token_id: Option<i64>,
    ignore_index: i64,
) -> Vec<i64> {
    match pad_token_id {
        Some(pad) => input_ids
            .iter()
            .map(|&v| if v == pad { ignore_index } else { v })
            .collect(),
        None => input_ids.to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(to: PadTo, multiple: Option<usize>, side: Side) -> PadSpec {
        PadSpec { to, multiple, side }
    }

    #[test]
    fn longest_right_and_left() {
        let r = Ragged::from_rows(&[vec![1, 2, 3], vec![4]]);
        let s = spec(PadTo::Longest, None, Side::Right);
        let w = common_width(&r.lengths(), &s, "input_ids").unwrap();
        assert_eq!(w, 3);
        let p = pad_rows(&r, w, 0, Side::Right, "input_ids").unwrap();
        assert_eq!(p.values, vec![1, 2, 3, 4, 0, 0]);
        let p = pad_rows(&r, w, -1, Side::Left, "input_ids").unwrap();
        assert_eq!(p.values, vec![1, 2, 3, -1, -1, 4]);
        assert_eq!((p.rows, p.width), (2, 3));
    }

    #[test]
    fn multiple_adds_no_block_when_aligned() {
        let s = spec(PadTo::Longest, Some(4), Side::Right);
        assert_eq!(common_width(&[4, 2], &s, "x").unwrap(), 4);
        assert_eq!(common_width(&[5, 2], &s, "x").unwrap(), 8);
        assert_eq!(common_width(&[0, 0], &s, "x").unwrap(), 0);
        let s = spec(PadTo::MaxLength(6), Some(4), Side::Right);
        assert_eq!(common_width(&[1, 2], &s, "x").unwrap(), 8);
    }

    #[test]
    fn zero_multiple_is_an_error() {
        let s = spec(PadTo::Longest, Some(0), Side::Right);
        assert!(matches!(
            common_width(&[1], &s, "x"),
            Err(DataError::Value(_))
        ));
    }

    #[test]
    fn max_length_does_not_truncate() {
        let s = spec(PadTo::MaxLength(3), None, Side::Right);
        assert_eq!(common_width(&[1, 3], &s, "ids").unwrap(), 3);
        // all rows equally too long: no padding, one tensor (as transformers)
        assert_eq!(common_width(&[5, 5], &s, "ids").unwrap(), 5);
        let err = common_width(&[1, 5], &s, "ids").unwrap_err();
        assert!(
            err.message().contains("example 1") && err.message().contains("'ids'"),
            "{err}"
        );
    }

    #[test]
    fn do_not_pad_needs_equal_lengths() {
        let s = spec(PadTo::DoNotPad, Some(8), Side::Right);
        assert_eq!(common_width(&[3, 3], &s, "ids").unwrap(), 3);
        let err = common_width(&[3, 3, 2], &s, "ids").unwrap_err();
        assert!(err.message().starts_with("example 2"), "{err}");
    }

    #[test]
    fn mask_and_lengths() {
        let m = attention_mask(&[2, 0, 3], 3, Side::Left).unwrap();
        assert_eq!(m.values, vec![0, 1, 1, 0, 0, 0, 1, 1, 1]);
        assert!(check_same_lengths(&[2, 3], "input_ids", &[2, 3], "attention_mask").is_ok());
        let err = check_same_lengths(&[2, 3], "input_ids", &[2, 4], "attention_mask").unwrap_err();
        assert!(err.message().contains("example 1") && err.message().contains("attention_mask"));
        assert!(pad_rows(&Ragged::from_rows(&[vec![1, 2]]), 1, 0, Side::Right, "x").is_err());
    }

    #[test]
    fn lm_labels_mask_by_value() {
        assert_eq!(
            labels_from_ids(&[5, 0, 7, 0], Some(0), -100),
            vec![5, -100, 7, -100]
        );
        assert_eq!(labels_from_ids(&[5, 0], None, -100), vec![5, 0]);
    }
}
