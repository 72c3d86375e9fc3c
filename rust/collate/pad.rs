//! Padding a flat batch of rows (values + row lengths) to one width, left or right.
//!
//! The width comes from the caller (it follows transformers' or TRL's arithmetic on the settings,
//! done in Python with Python integers). It is a user's number: the output's size is computed with
//! checked arithmetic and reserved fallibly, so an absurd `max_length` or `pad_to_multiple_of`
//! gives a catchable error, never an abort.

use crate::errors::{DataError, DataResult};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Left,
    Right,
}

impl Side {
    pub fn parse(side: &str) -> DataResult<Side> {
        match side {
            "right" => Ok(Side::Right),
            "left" => Ok(Side::Left),
            other => Err(DataError::value(format!(
                "padding_side must be 'left' or 'right', got {other:?}"
            ))),
        }
    }
}

/// Row-major `[lengths.len(), width]`: row `i` holds `values[offset_i .. offset_i + lengths[i]]`,
/// filled with `pad` on `side`. `key` names the rows in errors.
pub fn pad_rows(
    values: &[i64],
    lengths: &[i64],
    width: usize,
    pad: i64,
    side: Side,
    key: &str,
) -> DataResult<Vec<i64>> {
    let mut rows = Vec::with_capacity(lengths.len());
    let mut total = 0usize;
    for (i, &len) in lengths.iter().enumerate() {
        let len = usize::try_from(len).map_err(|_| {
            DataError::value(format!("example {i}: '{key}' has a negative length {len}"))
        })?;
        if len > width {
            return Err(DataError::value(format!(
                "example {i}: '{key}' has length {len}, longer than the padding length {width}; \
                 padding does not truncate (truncate when tokenizing or raise max_length)"
            )));
        }
        rows.push((total, len));
        total = total.saturating_add(len);
    }
    if total != values.len() {
        return Err(DataError::value(format!(
            "'{key}': the row lengths add up to {total} but there are {} values",
            values.len()
        )));
    }
    let size = lengths.len().checked_mul(width).ok_or_else(|| {
        DataError::value(format!(
            "'{key}': a batch of {} rows of width {width} overflows the address space",
            lengths.len()
        ))
    })?;
    let mut out: Vec<i64> = Vec::new();
    out.try_reserve_exact(size).map_err(|_| {
        DataError::memory(format!(
            "'{key}': cannot allocate a padded batch of {} x {width} int64 ({} bytes)",
            lengths.len(),
            (size as u128) * 8
        ))
    })?;
    for (start, len) in rows {
        let fill = width - len;
        if side == Side::Left {
            out.resize(out.len() + fill, pad);
        }
        out.extend_from_slice(&values[start..start + len]);
        if side == Side::Right {
            out.resize(out.len() + fill, pad);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn right_and_left() {
        let (values, lengths) = ([1, 2, 3, 4], [3, 1]);
        let p = pad_rows(&values, &lengths, 3, 0, Side::Right, "ids").unwrap();
        assert_eq!(p, vec![1, 2, 3, 4, 0, 0]);
        let p = pad_rows(&values, &lengths, 4, -1, Side::Left, "ids").unwrap();
        assert_eq!(p, vec![-1, 1, 2, 3, -1, -1, -1, 4]);
        assert_eq!(
            pad_rows(&[], &[0, 0], 2, 7, Side::Right, "x").unwrap(),
            vec![7; 4]
        );
        assert_eq!(
            pad_rows(&[], &[], 5, 7, Side::Right, "x").unwrap(),
            Vec::<i64>::new()
        );
    }

    #[test]
    fn errors_name_the_example_and_the_key() {
        let err = pad_rows(&[1, 2, 3], &[1, 2], 1, 0, Side::Right, "labels").unwrap_err();
        assert!(
            err.message()
                .starts_with("example 1: 'labels' has length 2"),
            "{err}"
        );
        let err = pad_rows(&[1], &[-1, 2], 3, 0, Side::Right, "ids").unwrap_err();
        assert!(err.message().contains("example 0") && err.message().contains("negative"));
        assert!(pad_rows(&[1], &[2], 3, 0, Side::Right, "ids").is_err());
        assert!(Side::parse("middle").is_err());
    }

    #[test]
    fn absurd_widths_are_errors_not_aborts() {
        let err = pad_rows(&[1, 2], &[1, 1], usize::MAX, 0, Side::Right, "ids").unwrap_err();
        assert!(matches!(err, DataError::Value(_)), "{err}");
        let err = pad_rows(&[1, 2], &[1, 1], 1 << 60, 0, Side::Right, "ids").unwrap_err();
        assert!(matches!(err, DataError::Memory(_)), "{err}");
        assert!(err.message().contains("2 x 1152921504606846976"), "{err}");
    }
}
