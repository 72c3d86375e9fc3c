//! Packing a padded causal-LM batch into one padding-free row, when that changes no scored token.
//!
//! Input: the padded batch a collator made (`input_ids`, `labels`, optionally `attention_mask`, all
//! `[rows, width]`). Each row's tokens are the positions its mask marks (one contiguous block, right or
//! left padded; a row without a mask is all tokens). Output: every row's tokens one after another,
//! positions restarting at 0 at each row, and labels with each row's first token ignored, so no token
//! predicts across a boundary.
//!
//! Exact means: the causal loss pairs token `p - 1` with label `p` inside each padded row; a pair counts
//! when the label is not `IGNORE`. The packed row keeps exactly the pairs whose two positions are both the
//! row's tokens. So packing is refused (the batch stays padded) when a padded row scores a label whose
//! predecessor or own position is padding: left padding with the first token labelled, a label pad other
//! than `IGNORE`. That refusal is a reason, not an error: the caller keeps the padded batch.

use crate::errors::{DataError, DataResult};

/// The label the loss ignores (transformers' and TRL's `-100`).
pub const IGNORE: i64 = -100;

/// One packed row (flat) and the length of each packed example, in batch order (rows without tokens
/// are left out).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Packed {
    pub input_ids: Vec<i64>,
    pub labels: Vec<i64>,
    pub position_ids: Vec<i64>,
    pub lengths: Vec<i64>,
}

/// The packed row, or why this batch must stay padded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packing {
    Packed(Packed),
    Refused(String),
}

/// Where row `row`'s tokens lie: `Some((first, last))` inclusive, `None` for a row without tokens, or a
/// refusal when its mask is not one block of ones.
fn token_span(
    mask: Option<&[i64]>,
    row: usize,
    width: usize,
) -> Result<Option<(usize, usize)>, String> {
    let Some(mask) = mask else {
        return Ok(if width == 0 {
            None
        } else {
            Some((0, width - 1))
        });
    };
    let mut span: Option<(usize, usize)> = None;
    for (p, &m) in mask.iter().enumerate() {
        match m {
            0 => {}
            1 => match span {
                None => span = Some((p, p)),
                Some((first, last)) if last + 1 == p => span = Some((first, p)),
                Some(_) => {
                    return Err(format!(
                        "example {row}: 'attention_mask' has a gap (its tokens are not one block)"
                    ))
                }
            },
            other => {
                return Err(format!(
                    "example {row}: 'attention_mask' holds {other} (only 0 and 1 can be packed)"
                ))
            }
        }
    }
    Ok(span)
}

/// Packs `[rows, width]` row-major `input_ids` / `labels` (and `attention_mask`, when given).
/// Errors (shape mismatches) name the key; a batch that cannot be packed exactly is `Packing::Refused`.
pub fn pack_padded(
    input_ids: &[i64],
    labels: &[i64],
    attention_mask: Option<&[i64]>,
    rows: usize,
    width: usize,
) -> DataResult<Packing> {
    let size = rows
        .checked_mul(width)
        .ok_or_else(|| DataError::value(format!("a batch of {rows} x {width} overflows")))?;
    for (key, len) in [
        ("input_ids", Some(input_ids.len())),
        ("labels", Some(labels.len())),
    ]
    .into_iter()
    .chain([("attention_mask", attention_mask.map(<[i64]>::len))])
    {
        if let Some(len) = len {
            if len != size {
                return Err(DataError::value(format!(
                    "'{key}' has {len} values, expected {rows} x {width}"
                )));
            }
        }
    }
    let mut spans = Vec::with_capacity(rows);
    let mut total = 0usize;
    for row in 0..rows {
        let at = row * width..(row + 1) * width;
        let span = match token_span(attention_mask.map(|m| &m[at.clone()]), row, width) {
            Ok(span) => span,
            Err(reason) => return Ok(Packing::Refused(reason)),
        };
        // every scored pair (p - 1 -> p) must have both positions among the row's tokens
        let scored_ok = |p: usize| matches!(span, Some((first, last)) if first < p && p <= last);
        if let Some(p) = (1..width).find(|&p| labels[at.start + p] != IGNORE && !scored_ok(p)) {
            return Ok(Packing::Refused(format!(
                "example {row}: the padded batch scores the label at position {p}, which padding predicts or \
                 holds (left padding with a labelled first token, or a label pad other than {IGNORE})"
            )));
        }
        if let Some((first, last)) = span {
            total += last - first + 1;
        }
        spans.push(span);
    }
    let mut out = Packed {
        input_ids: Vec::with_capacity(total),
        labels: Vec::with_capacity(total),
        position_ids: Vec::with_capacity(total),
        lengths: Vec::with_capacity(rows),
    };
    for (row, span) in spans.into_iter().enumerate() {
        let Some((first, last)) = span else { continue };
        let at = row * width;
        out.input_ids
            .extend_from_slice(&input_ids[at + first..=at + last]);
        out.labels.push(IGNORE); // the first token is predicted by nothing of its own example
        out.labels
            .extend_from_slice(&labels[at + first + 1..=at + last]);
        out.position_ids.extend(0..(last - first + 1) as i64);
        out.lengths.push((last - first + 1) as i64);
    }
    Ok(Packing::Packed(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(p: Packing) -> Packed {
        match p {
            Packing::Packed(p) => p,
            Packing::Refused(r) => panic!("refused: {r}"),
        }
    }

    #[test]
    fn right_padding_packs_with_restarting_positions() {
        let ids = [5, 6, 7, 0, 8, 9, 0, 0];
        let labels = [5, 6, 7, IGNORE, 8, 9, IGNORE, IGNORE];
        let mask = [1, 1, 1, 0, 1, 1, 0, 0];
        let p = packed(pack_padded(&ids, &labels, Some(&mask), 2, 4).unwrap());
        assert_eq!(p.input_ids, vec![5, 6, 7, 8, 9]);
        assert_eq!(p.labels, vec![IGNORE, 6, 7, IGNORE, 9]);
        assert_eq!(p.position_ids, vec![0, 1, 2, 0, 1]);
        assert_eq!(p.lengths, vec![3, 2]);
    }

    #[test]
    fn left_padding_packs_when_the_first_token_is_not_scored() {
        let ids = [0, 5, 6, 7, 8, 9];
        let labels = [IGNORE, IGNORE, 6, 7, 8, 9];
        let mask = [0, 1, 1, 1, 1, 1];
        let p = packed(pack_padded(&ids, &labels, Some(&mask), 2, 3).unwrap());
        assert_eq!(p.input_ids, vec![5, 6, 7, 8, 9]);
        assert_eq!(p.labels, vec![IGNORE, 6, IGNORE, 8, 9]);
        let scored_first = [IGNORE, 5, 6, 7, 8, 9];
        match pack_padded(&ids, &scored_first, Some(&mask), 2, 3).unwrap() {
            Packing::Refused(r) => assert!(
                r.starts_with("example 0:") && r.contains("position 1"),
                "{r}"
            ),
            Packing::Packed(_) => panic!("a label predicted by padding must refuse"),
        }
    }

    #[test]
    fn scored_padding_and_gaps_refuse() {
        let mask = [1, 1, 0, 1, 1, 1];
        let scored_pad = [1, 2, 0, 4, 5, 6];
        assert!(matches!(
            pack_padded(&[1, 2, 0, 4, 5, 6], &scored_pad, Some(&mask), 2, 3).unwrap(),
            Packing::Refused(_)
        ));
        let gap = [1, 0, 1];
        match pack_padded(&[1, 2, 3], &[IGNORE; 3], Some(&gap), 1, 3).unwrap() {
            Packing::Refused(r) => assert!(r.contains("gap"), "{r}"),
            Packing::Packed(_) => panic!(),
        }
        match pack_padded(&[1, 2], &[IGNORE; 2], Some(&[1, 2]), 1, 2).unwrap() {
            Packing::Refused(r) => assert!(r.contains("holds 2"), "{r}"),
            Packing::Packed(_) => panic!(),
        }
    }

    #[test]
    fn no_mask_is_all_tokens_and_empty_rows_are_dropped() {
        let p = packed(pack_padded(&[1, 2, 3, 4], &[1, 2, 3, 4], None, 2, 2).unwrap());
        assert_eq!(p.labels, vec![IGNORE, 2, IGNORE, 4]);
        let p = packed(
            pack_padded(
                &[0, 0, 3, 4],
                &[IGNORE, IGNORE, 3, 4],
                Some(&[0, 0, 1, 1]),
                2,
                2,
            )
            .unwrap(),
        );
        assert_eq!((p.input_ids, p.lengths), (vec![3, 4], vec![2]));
    }

    #[test]
    fn shape_mismatches_are_errors() {
        let err = pack_padded(&[1, 2, 3], &[1, 2], None, 1, 3).unwrap_err();
        assert!(err.message().contains("'labels'"), "{err}");
        assert!(pack_padded(&[], &[], None, usize::MAX, 2).is_err());
    }
}
