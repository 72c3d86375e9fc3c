//! The `#[pyfunction]`s of the collators. `read_rows` walks the Python sequences once (GIL held) into
//! one flat buffer; `pad_rows` pads such a buffer with the GIL released. Both hand back numpy arrays
//! that own the Rust buffers (no copy); the Python collators turn them into torch tensors with
//! `torch.from_numpy`.

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::errors::DataError;

use super::extract::read_row;
use super::pad::{pad_rows as pad, Side};
use super::ragged::Ragged;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(read_rows, m)?)?;
    m.add_function(wrap_pyfunction!(pad_rows, m)?)?;
    Ok(())
}

type ValuesAndLengths<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i64>>);

/// Reads `rows` (row `i` is example `i`'s value of `key`: a list, tuple, integer numpy array or torch
/// tensor of token ids) into (values, lengths), both int64. Errors name the example (`indices[i]`
/// when given: the caller's numbering) and the key.
#[pyfunction]
#[pyo3(signature = (rows, key, indices=None))]
fn read_rows<'py>(
    py: Python<'py>,
    rows: &Bound<'py, PyList>,
    key: &str,
    indices: Option<Vec<usize>>,
) -> PyResult<ValuesAndLengths<'py>> {
    let mut out = Ragged::with_rows(rows.len());
    for (i, row) in rows.iter().enumerate() {
        let index = indices
            .as_ref()
            .and_then(|v| v.get(i).copied())
            .unwrap_or(i);
        read_row(&row, &mut out, index, key)?;
    }
    Ok((
        PyArray1::from_vec(py, out.values),
        PyArray1::from_vec(py, out.lengths),
    ))
}

/// Pads rows given as (values, lengths) to `[len(lengths), width]` with `pad` on `side`.
/// A row longer than `width` is a ValueError naming the example; an output that cannot be
/// allocated is a MemoryError.
#[pyfunction]
#[pyo3(signature = (values, lengths, *, width, pad_value, side, key))]
fn pad_rows<'py>(
    py: Python<'py>,
    values: PyReadonlyArray1<'py, i64>,
    lengths: PyReadonlyArray1<'py, i64>,
    width: usize,
    pad_value: i64,
    side: &str,
    key: &str,
) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let side = Side::parse(side)?;
    let contiguous =
        |what: &str| DataError::value(format!("'{key}': {what} must be a contiguous int64 array"));
    let values = values.as_slice().map_err(|_| contiguous("values"))?;
    let lengths = lengths.as_slice().map_err(|_| contiguous("lengths"))?;
    let rows = lengths.len();
    let out = py.detach(|| pad(values, lengths, width, pad_value, side, key))?;
    PyArray1::from_vec(py, out).reshape([rows, width])
}
