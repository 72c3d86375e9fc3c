//! A batch of variable-length integer sequences for one key, stored flat.

/// Row `i` is `values[offsets[i]..offsets[i + 1]]`; one allocation for the whole batch instead
/// of one `Vec` per example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ragged {
    values: Vec<i64>,
    offsets: Vec<usize>,
}

impl Default for Ragged {
    fn default() -> Self {
        Self::new()
    }
}

impl Ragged {
    pub fn new() -> Self {
        Self::with_capacity(0, 0)
    }

    pub fn with_capacity(rows: usize, values: usize) -> Self {
        let mut offsets = Vec::with_capacity(rows + 1);
        offsets.push(0);
        Ragged {
            values: Vec::with_capacity(values),
            offsets,
        }
    }

    /// Builds a batch from rows (tests and small inputs).
    pub fn from_rows<R: AsRef<[i64]>>(rows: &[R]) -> Self {
        let total = rows.iter().map(|r| r.as_ref().len()).sum();
        let mut out = Self::with_capacity(rows.len(), total);
        for row in rows {
            out.push_row(row.as_ref());
        }
        out
    }

    pub fn push_row(&mut self, row: &[i64]) {
        self.values.extend_from_slice(row);
        self.finish_row();
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
        self.offsets.push(self.values.len());
    }

    /// Drops the values pushed since the last `finish_row` (a row that failed to read).
    pub fn abandon_row(&mut self) {
        let start = *self.offsets.last().unwrap_or(&0);
        self.values.truncate(start);
    }

    /// Removes the last finished row.
    pub fn pop_row(&mut self) {
        if self.offsets.len() > 1 {
            self.offsets.pop();
            let end = *self.offsets.last().unwrap_or(&0);
            self.values.truncate(end);
        }
    }

    pub fn rows(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.rows() == 0
    }

    pub fn row(&self, i: usize) -> &[i64] {
        &self.values[self.offsets[i]..self.offsets[i + 1]]
    }

    pub fn row_len(&self, i: usize) -> usize {
        self.offsets[i + 1] - self.offsets[i]
    }

    pub fn lengths(&self) -> Vec<usize> {
        self.offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }

    pub fn total_len(&self) -> usize {
        self.values.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip() {
        let r = Ragged::from_rows(&[vec![1, 2, 3], vec![], vec![4]]);
        assert_eq!(r.rows(), 3);
        assert_eq!(r.row(0), &[1, 2, 3]);
        assert_eq!(r.row(1), &[] as &[i64]);
        assert_eq!(r.row(2), &[4]);
        assert_eq!(r.lengths(), vec![3, 0, 1]);
        assert_eq!(r.total_len(), 4);
    }

    #[test]
    fn abandoned_row_leaves_no_values() {
        let mut r = Ragged::new();
        r.push_row(&[7]);
        r.push_value(1);
        r.push_value(2);
        r.abandon_row();
        r.push_row(&[9]);
        r.push_row(&[3, 4]);
        r.pop_row();
        assert_eq!(r, Ragged::from_rows(&[vec![7], vec![9]]));
    }
}
