//! The `#[pyfunction]`s of the collators. `read_rows` walks the Python sequences once (GIL held) into
//! one flat buffer; `pad_rows` pads such a buffer with the GIL released. Both hand back numpy arrays
//! that own the Rust buffers (no copy); the Python collators turn them into torch tensors with
//! `torch.from_numpy`.

use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::errors::DataError;

use super::extract::read_row;
use super::pack::{pack_padded as pack, Packing};
use super::pad::{pad_rows as pad, Side};
use super::ragged::Ragged;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(read_rows, m)?)?;
    m.add_function(wrap_pyfunction!(pad_rows, m)?)?;
    m.add_function(wrap_pyfunction!(pack_padded, m)?)?;
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

type PackedArrays<'py> = (
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Option<String>,
);

/// Packs a padded causal-LM batch (`[rows, width]` int64 `input_ids`, `labels`, optional `attention_mask`)
/// into one padding-free row: (input_ids, labels, position_ids, lengths, None), flat int64; or four empty
/// arrays and the reason the batch must stay padded (a label that padding predicts or holds, a mask that is
/// not one block of ones). The work runs with the GIL released.
#[pyfunction]
#[pyo3(signature = (input_ids, labels, attention_mask=None))]
fn pack_padded<'py>(
    py: Python<'py>,
    input_ids: PyReadonlyArray2<'py, i64>,
    labels: PyReadonlyArray2<'py, i64>,
    attention_mask: Option<PyReadonlyArray2<'py, i64>>,
) -> PyResult<PackedArrays<'py>> {
    let [rows, width] = [input_ids.shape()[0], input_ids.shape()[1]];
    for (key, shape) in [
        ("labels", Some(labels.shape())),
        ("attention_mask", attention_mask.as_ref().map(|m| m.shape())),
    ] {
        if let Some(shape) = shape {
            if shape != [rows, width] {
                return Err(DataError::value(format!(
                    "'{key}' has shape {shape:?} but 'input_ids' has shape [{rows}, {width}]"
                ))
                .into());
            }
        }
    }
    let contiguous =
        |key: &str| DataError::value(format!("'{key}' must be a contiguous int64 array"));
    let ids = input_ids.as_slice().map_err(|_| contiguous("input_ids"))?;
    let labels = labels.as_slice().map_err(|_| contiguous("labels"))?;
    let mask = match attention_mask.as_ref() {
        Some(m) => Some(m.as_slice().map_err(|_| contiguous("attention_mask"))?),
        None => None,
    };
    let packing = py.detach(|| pack(ids, labels, mask, rows, width))?;
    let (packed, reason) = match packing {
        Packing::Packed(p) => (p, None),
        Packing::Refused(reason) => (Default::default(), Some(reason)),
    };
    Ok((
        PyArray1::from_vec(py, packed.input_ids),
        PyArray1::from_vec(py, packed.labels),
        PyArray1::from_vec(py, packed.position_ids),
        PyArray1::from_vec(py, packed.lengths),
        reason,
    ))
}
