//! The `#[pyfunction]`s of the collators: extract each sequence once (GIL held), pad or flatten
//! with the GIL released, return numpy arrays that own the Rust buffers (no copy). The Python
//! classes in `fasttrain.data.collators` turn them into torch tensors with `torch.from_numpy`.

use numpy::{PyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

use crate::errors::{DataError, DataResult};

use super::extract::{has_key, lookup, read_row};
use super::flatten::{flatten, FlattenSpec};
use super::pad::{
    check_same_lengths, common_width, labels_from_ids, pad_rows, PadSpec, PadTo, Padded, Side,
};
use super::ragged::Ragged;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(pad_features, m)?)?;
    m.add_function(wrap_pyfunction!(causal_lm_labels, m)?)?;
    m.add_function(wrap_pyfunction!(flatten_features, m)?)?;
    Ok(())
}

fn to_2d<'py, T: numpy::Element>(
    py: Python<'py>,
    values: Vec<T>,
    rows: usize,
    width: usize,
) -> PyResult<Bound<'py, PyArray2<T>>> {
    PyArray1::from_vec(py, values).reshape([rows, width])
}

fn padded_to_numpy<'py>(py: Python<'py>, p: Padded) -> PyResult<Bound<'py, PyArray2<i64>>> {
    to_2d(py, p.values, p.rows, p.width)
}

fn pad_spec(
    padding: &str,
    max_length: Option<i64>,
    pad_to_multiple_of: Option<i64>,
    padding_side: &str,
) -> DataResult<PadSpec> {
    let to = match padding {
        "longest" => PadTo::Longest,
        "do_not_pad" => PadTo::DoNotPad,
        "max_length" => match max_length {
            Some(m) if m >= 0 => PadTo::MaxLength(m as usize),
            Some(m) => {
                return Err(DataError::value(format!(
                    "max_length must be >= 0, got {m}"
                )))
            }
            None => return Err(DataError::value("padding='max_length' needs a max_length")),
        },
        other => {
            return Err(DataError::value(format!(
                "unknown padding strategy {other:?}"
            )))
        }
    };
    let multiple = match pad_to_multiple_of {
        Some(m) if m > 0 => Some(m as usize),
        Some(m) => {
            return Err(DataError::value(format!(
                "pad_to_multiple_of must be a positive integer, got {m}"
            )))
        }
        None => None,
    };
    let side = match padding_side {
        "right" => Side::Right,
        "left" => Side::Left,
        other => {
            return Err(DataError::value(format!(
                "padding_side must be 'left' or 'right', got {other:?}"
            )))
        }
    };
    Ok(PadSpec { to, multiple, side })
}

/// Pads `keys` (name, pad value) of a list of feature mappings to one width, with the rules of
/// `tokenizer.pad`: the first key decides the width and the other keys must match its lengths.
/// With `attention_mask`, a mask of ones/zeros built from the first key's lengths is appended.
/// Returns one int64 `[batch, width]` array per key (then the mask).
#[pyfunction]
#[pyo3(signature = (features, keys, *, padding, max_length, pad_to_multiple_of, padding_side, attention_mask))]
#[allow(clippy::too_many_arguments)]
fn pad_features<'py>(
    py: Python<'py>,
    features: &Bound<'py, PyList>,
    keys: Vec<(String, i64)>,
    padding: &str,
    max_length: Option<i64>,
    pad_to_multiple_of: Option<i64>,
    padding_side: &str,
    attention_mask: bool,
) -> PyResult<Vec<Bound<'py, PyArray2<i64>>>> {
    let spec = pad_spec(padding, max_length, pad_to_multiple_of, padding_side)?;
    if features.is_empty() {
        return Err(DataError::value("cannot collate an empty batch (no examples)").into());
    }
    if keys.is_empty() {
        return Err(DataError::value("pad_features needs at least one key").into());
    }
    let n = features.len();
    let names: Vec<Bound<'py, PyString>> = keys.iter().map(|(k, _)| PyString::new(py, k)).collect();
    let mut columns: Vec<Ragged> = keys.iter().map(|_| Ragged::with_capacity(n, 0)).collect();
    for (index, example) in features.iter().enumerate() {
        for ((name, (key, _)), column) in names.iter().zip(&keys).zip(columns.iter_mut()) {
            let value = lookup(&example, name, index)?;
            read_row(&value, column, index, key)?;
        }
    }

    let (padded, mask) = py.detach(|| -> DataResult<(Vec<Padded>, Option<Padded>)> {
        let main_lengths = columns[0].lengths();
        for (column, (key, _)) in columns.iter().zip(&keys).skip(1) {
            check_same_lengths(&main_lengths, &keys[0].0, &column.lengths(), key)?;
        }
        let width = common_width(&main_lengths, &spec, &keys[0].0)?;
        let padded = columns
            .iter()
            .zip(&keys)
            .map(|(column, (key, pad))| pad_rows(column, width, *pad, spec.side, key))
            .collect::<DataResult<Vec<_>>>()?;
        let mask = if attention_mask {
            Some(super::pad::attention_mask(&main_lengths, width, spec.side)?)
        } else {
            None
        };
        Ok((padded, mask))
    })?;
    padded
        .into_iter()
        .chain(mask)
        .map(|p| padded_to_numpy(py, p))
        .collect()
}

/// Causal-LM labels from padded `input_ids`: a copy with pad-id values set to -100.
#[pyfunction]
#[pyo3(signature = (input_ids, pad_token_id))]
fn causal_lm_labels<'py>(
    py: Python<'py>,
    input_ids: PyReadonlyArray2<'py, i64>,
    pad_token_id: Option<i64>,
) -> PyResult<Bound<'py, PyArray2<i64>>> {
    let shape = input_ids.shape().to_vec();
    let values: Vec<i64> = match input_ids.as_slice() {
        // The readonly guard keeps the array alive and unborrowed mutably while we read it.
        Ok(slice) => py.detach(|| labels_from_ids(slice, pad_token_id, -100)),
        Err(_) => {
            let flat: Vec<i64> = input_ids.as_array().iter().copied().collect();
            labels_from_ids(&flat, pad_token_id, -100)
        }
    };
    to_2d(py, values, shape[0], shape[1])
}

/// `DataCollatorWithFlattening`'s batch. Returns (input_ids, labels, position_ids | None,
/// seq_idx | None, cu_seq_lens | None, max_length); the first four are `[1, total]`.
#[pyfunction]
#[pyo3(signature = (features, *, separator_id, position_ids_start, position_ids, seq_idx, flash_attn_kwargs))]
#[allow(clippy::type_complexity)]
fn flatten_features<'py>(
    py: Python<'py>,
    features: &Bound<'py, PyList>,
    separator_id: i64,
    position_ids_start: i64,
    position_ids: bool,
    seq_idx: bool,
    flash_attn_kwargs: bool,
) -> PyResult<(
    Bound<'py, PyArray2<i64>>,
    Bound<'py, PyArray2<i64>>,
    Option<Bound<'py, PyArray2<i64>>>,
    Option<Bound<'py, PyArray2<i32>>>,
    Option<Bound<'py, PyArray<i32, numpy::Ix1>>>,
    usize,
)> {
    let ids_key = PyString::new(py, "input_ids");
    let labels_key = PyString::new(py, "labels");
    let n = features.len();
    let mut ids = Ragged::with_capacity(n, 0);
    let mut labels = Ragged::with_capacity(n, 0);
    let mut kept = Vec::with_capacity(n);
    // transformers drops empty examples first, then asks the first kept one whether labels exist.
    let mut has_labels: Option<bool> = None;
    for (index, example) in features.iter().enumerate() {
        let value = lookup(&example, &ids_key, index)?;
        read_row(&value, &mut ids, index, "input_ids")?;
        if ids.row_len(ids.rows() - 1) == 0 {
            ids.pop_row();
            continue;
        }
        kept.push(index);
        let with_labels = match has_labels {
            Some(h) => h,
            None => *has_labels.insert(has_key(&example, &labels_key, index)?),
        };
        if with_labels {
            let value = lookup(&example, &labels_key, index)?;
            read_row(&value, &mut labels, index, "labels")?;
        }
    }
    let spec = FlattenSpec {
        separator_id,
        position_ids_start,
        position_ids,
        seq_idx,
        flash_attn_kwargs,
    };
    let labels = has_labels.unwrap_or(false).then_some(&labels);
    let flat = py.detach(|| flatten(&ids, labels, &kept, &spec))?;
    let total = flat.input_ids.len();
    let row = |v: Vec<i64>| to_2d(py, v, 1, total);
    Ok((
        row(flat.input_ids)?,
        row(flat.labels)?,
        flat.position_ids.map(row).transpose()?,
        flat.seq_idx.map(|v| to_2d(py, v, 1, total)).transpose()?,
        flat.cu_seq_lens.map(|v| PyArray1::from_vec(py, v)),
        flat.max_length,
    ))
}
