//! The sampler's Python face: numpy int64 buffers in, a numpy int64 buffer out, GIL released for
//! the work. The permutation is drawn in Python (`torch.randperm`) and passed in; so is the order that
//! token-budget batches cut.

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use super::budget::{budget_batches, split_for_ranks};
use super::grouping::group_by_length;
use crate::errors::{DataError, DataResult};

fn contiguous<'a>(array: &'a PyReadonlyArray1<'_, i64>, name: &str) -> DataResult<&'a [i64]> {
    array
        .as_slice()
        .map_err(|_| DataError::value(format!("{name} must be a contiguous 1-D int64 array")))
}

/// `get_length_grouped_indices` given the permutation `torch.randperm(len(lengths))`.
#[pyfunction]
#[pyo3(signature = (permutation, lengths, batch_size, mega_batch_mult=None))]
fn length_grouped_indices<'py>(
    py: Python<'py>,
    permutation: PyReadonlyArray1<'py, i64>,
    lengths: PyReadonlyArray1<'py, i64>,
    batch_size: usize,
    mega_batch_mult: Option<usize>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let permutation = contiguous(&permutation, "permutation")?;
    let lengths = contiguous(&lengths, "lengths")?;
    let order = py.detach(|| -> DataResult<Vec<i64>> {
        let mut order = permutation.to_vec();
        group_by_length(&mut order, lengths, batch_size, mega_batch_mult)?;
        Ok(order)
    })?;
    Ok(PyArray1::from_vec(py, order))
}

/// Boundaries of the token-budget batches of `order` (batch `b` is `order[offsets[b]:offsets[b + 1]]`),
/// their count made a multiple of `num_replicas` (see `budget::split_for_ranks`).
#[pyfunction]
#[pyo3(signature = (order, lengths, max_tokens, num_replicas=1, drop_last=false))]
fn token_budget_offsets<'py>(
    py: Python<'py>,
    order: PyReadonlyArray1<'py, i64>,
    lengths: PyReadonlyArray1<'py, i64>,
    max_tokens: u64,
    num_replicas: usize,
    drop_last: bool,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let order = contiguous(&order, "order")?;
    let lengths = contiguous(&lengths, "lengths")?;
    let offsets = py.detach(|| -> DataResult<Vec<i64>> {
        let mut offsets = budget_batches(order, lengths, max_tokens)?;
        split_for_ranks(order, lengths, &mut offsets, num_replicas, drop_last)?;
        Ok(offsets.into_iter().map(|o| o as i64).collect())
    })?;
    Ok(PyArray1::from_vec(py, offsets))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(length_grouped_indices, m)?)?;
    m.add_function(wrap_pyfunction!(token_budget_offsets, m)?)?;
    Ok(())
}
