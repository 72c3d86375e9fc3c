//! A batch of variable-length integer sequences for one key, stored flat.

/// Row `i` is the `lengths[i]` values after the rows before it; one allocation for the whole
/// batch instead of one `Vec` per example. Lengths are int64 because they go to numpy as they are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ragged {
    pub values: Vec<i64>,
    pub lengths: Vec<i64>,
    /// Where the row being built starts in `values`.
    row_start: usize,
}

impl Ragged {
    pub fn with_rows(rows: usize) -> Self {
        Ragged {
            lengths: Vec::with_capacity(rows),
            ..Self::default()
        }
    }

    /// Appends one value to the row being built; `finish_row` closes it.
    #[inline]
    pub fn push_value(&mut self, value: i64) {
        self.values.push(value);
    }

    /// Appends values to the row being built.
    pub fn extend_from_slice(&mut self, values: &[i64]) {
        self.values.extend_from_slice(values);
    }

    pub fn reserve(&mut self, additional: usize) {
        self.values.reserve(additional);
    }

    /// Closes the row being built (the values pushed since the last call).
    pub fn finish_row(&mut self) {
        self.lengths
            .push((self.values.len() - self.row_start) as i64);
        self.row_start = self.values.len();
    }

    /// Drops the values pushed since the last `finish_row` (a row that failed to read).
    pub fn abandon_row(&mut self) {
        self.values.truncate(self.row_start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_and_an_abandoned_row() {
        let mut r = Ragged::with_rows(3);
        r.extend_from_slice(&[1, 2, 3]);
        r.finish_row();
        r.push_value(9);
        r.abandon_row();
        r.finish_row();
        r.push_value(4);
        r.finish_row();
        assert_eq!(r.values, vec![1, 2, 3, 4]);
        assert_eq!(r.lengths, vec![3, 0, 1]);
    }
}
