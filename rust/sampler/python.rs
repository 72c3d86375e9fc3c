//! The sampler's Python face: numpy int64 buffers in, a numpy int64 buffer out, GIL released for
//! the work. The permutation itself is drawn in Python (`torch.randperm`) and passed in.

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use super::distributed::rank_indices;
use super::grouping::group_by_length;
use super::torch_rng::{randperm, Mt19937};
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

/// The indices of `rank` out of one epoch's order (`DistributedLengthGroupedSampler`).
#[pyfunction]
#[pyo3(signature = (indices, num_replicas, rank, drop_last))]
fn distributed_rank_indices<'py>(
    py: Python<'py>,
    indices: PyReadonlyArray1<'py, i64>,
    num_replicas: usize,
    rank: usize,
    drop_last: bool,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let indices = contiguous(&indices, "indices")?;
    let mine = py.detach(|| rank_indices(indices, num_replicas, rank, drop_last))?;
    Ok(PyArray1::from_vec(py, mine))
}

type PermutationAndState<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<u8>>);

/// `torch.randperm(n, generator=g)` from `g.get_state()`: returns the permutation and the state to
/// give back with `g.set_state()`.
#[pyfunction]
fn torch_randperm<'py>(
    py: Python<'py>,
    n: usize,
    state: PyReadonlyArray1<'py, u8>,
) -> PyResult<PermutationAndState<'py>> {
    let state = state
        .as_slice()
        .map_err(|_| DataError::value("state must be a contiguous 1-D uint8 array"))?;
    let (perm, new_state) = py.detach(|| -> DataResult<(Vec<i64>, Vec<u8>)> {
        let mut rng = Mt19937::from_state_bytes(state)?;
        let perm = randperm(n, &mut rng)?;
        let mut new_state = state.to_vec();
        rng.write_state_bytes(&mut new_state);
        Ok((perm, new_state))
    })?;
    Ok((
        PyArray1::from_vec(py, perm),
        PyArray1::from_vec(py, new_state),
    ))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(torch_randperm, m)?)?;
    m.add_function(wrap_pyfunction!(length_grouped_indices, m)?)?;
    m.add_function(wrap_pyfunction!(distributed_rank_indices, m)?)?;
    Ok(())
}
