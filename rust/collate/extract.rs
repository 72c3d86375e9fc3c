//! Reading one example's token sequence from Python into a `Ragged` batch.
//!
//! One call per sequence: Python lists and tuples are walked here (never element by element
//! from Python), numpy integer arrays are copied from their buffer, torch tensors are viewed as
//! numpy arrays first (`Tensor.numpy(force=True)`, zero-copy for CPU tensors). Every failure
//! names the example index and the key.

use numpy::{PyArray1, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyOverflowError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyFloat, PyList, PyString, PyTuple, PyType};

use crate::errors::DataError;

use super::ragged::Ragged;

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}

/// Appends `value` (a flat sequence of token ids) as one row of `out`.
pub(crate) fn read_row(
    value: &Bound<'_, PyAny>,
    out: &mut Ragged,
    index: usize,
    key: &str,
) -> PyResult<()> {
    let read = if let Ok(list) = value.cast::<PyList>() {
        read_list(list, out, index, key)
    } else if let Ok(tuple) = value.cast::<PyTuple>() {
        read_tuple(tuple, out, index, key)
    } else if let Ok(array) = value.cast::<PyUntypedArray>() {
        read_array(array, out, index, key)
    } else if is_torch_tensor(value)? {
        read_tensor(value, out, index, key)
    } else {
        Err(DataError::type_(format!(
            "example {index}: '{key}' is a {}, expected a list, tuple, numpy array or torch tensor of token ids",
            type_name(value)
        ))
        .into())
    };
    match read {
        Ok(()) => {
            out.finish_row();
            Ok(())
        }
        Err(e) => {
            out.abandon_row();
            Err(e)
        }
    }
}

fn read_list(list: &Bound<'_, PyList>, out: &mut Ragged, index: usize, key: &str) -> PyResult<()> {
    let n = list.len();
    out.reserve(n);
    for pos in 0..n {
        // SAFETY: we hold the GIL (the `Bound`) and `pos < len`.
        match unsafe { exact_int_at(list, pos) } {
            Some(v) => out.push_value(v),
            None => out.push_value(read_item(&list.get_item(pos)?, index, key, pos)?),
        }
    }
    Ok(())
}

/// The fast path: item `pos` when it is an exact Python int within int64, read through a
/// borrowed reference (no refcount traffic). Converting an exact int runs no Python code, so the
/// borrowed item cannot be freed under us. Anything else returns None for the careful path.
///
/// # Safety
/// The GIL must be held (guaranteed by the `Bound`).
#[inline]
unsafe fn exact_int_at(list: &Bound<'_, PyList>, pos: usize) -> Option<i64> {
    let item = ffi::PyList_GetItem(list.as_ptr(), pos as ffi::Py_ssize_t);
    if item.is_null() {
        ffi::PyErr_Clear();
        return None;
    }
    if ffi::PyLong_CheckExact(item) == 0 {
        return None;
    }
    let v = ffi::PyLong_AsLongLong(item);
    if v == -1 && !ffi::PyErr_Occurred().is_null() {
        ffi::PyErr_Clear();
        return None;
    }
    Some(v)
}

fn read_tuple(
    tuple: &Bound<'_, PyTuple>,
    out: &mut Ragged,
    index: usize,
    key: &str,
) -> PyResult<()> {
    out.reserve(tuple.len());
    for (pos, item) in tuple.iter().enumerate() {
        out.push_value(read_item(&item, index, key, pos)?);
    }
    Ok(())
}

/// One element that is not a plain int in range: numpy integer scalars and bools are accepted
/// (as transformers accepts them), anything else is an error naming where it is.
fn read_item(item: &Bound<'_, PyAny>, index: usize, key: &str, pos: usize) -> PyResult<i64> {
    let here = || format!("example {index}: '{key}'[{pos}]");
    if item.is_instance_of::<PyFloat>() {
        return Err(DataError::type_(format!(
            "{} is a float ({}); token ids must be integers",
            here(),
            repr(item)
        ))
        .into());
    }
    if item.is_instance_of::<PyString>() {
        return Err(DataError::type_(format!(
            "{} is a str ({}); token ids must be integers",
            here(),
            repr(item)
        ))
        .into());
    }
    if item.is_instance_of::<PyList>()
        || item.is_instance_of::<PyTuple>()
        || item.cast::<PyUntypedArray>().is_ok()
    {
        return Err(DataError::type_(format!(
            "{} is a nested sequence; '{key}' must be a flat sequence of token ids",
            here()
        ))
        .into());
    }
    if item.is_instance_of::<PyBool>() {
        return Ok(item.is_truthy()? as i64);
    }
    match item.extract::<i64>() {
        Ok(v) => Ok(v),
        Err(e) if e.is_instance_of::<PyOverflowError>(item.py()) => Err(DataError::value(format!(
            "{} = {} is outside the int64 range",
            here(),
            repr(item)
        ))
        .into()),
        Err(_) => Err(DataError::type_(format!(
            "{} is a {} ({}); token ids must be integers",
            here(),
            type_name(item),
            repr(item)
        ))
        .into()),
    }
}

fn repr(obj: &Bound<'_, PyAny>) -> String {
    let mut s = obj
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into());
    if s.len() > 40 {
        s.truncate(s.char_indices().nth(40).map_or(s.len(), |(i, _)| i));
        s.push_str("...");
    }
    s
}

/// Copies an integer (or bool) numpy array. Floats are refused: a float among token ids is a bug
/// upstream, and transformers would silently return a float tensor.
fn read_array(
    array: &Bound<'_, PyUntypedArray>,
    out: &mut Ragged,
    index: usize,
    key: &str,
) -> PyResult<()> {
    if array.ndim() != 1 {
        return Err(DataError::type_(format!(
            "example {index}: '{key}' is a {}-d array; expected a flat (1-d) sequence of token ids",
            array.ndim()
        ))
        .into());
    }
    macro_rules! copy_as {
        ($($t:ty),*) => {$(
            if let Ok(typed) = array.cast::<PyArray1<$t>>() {
                let ro = typed.try_readonly().map_err(|e| DataError::value(format!("example {index}: '{key}': {e}")))?;
                out.reserve(ro.len());
                match ro.as_slice() {
                    Ok(slice) => extend_from(out, slice, index, key)?,
                    Err(_) => for &v in ro.as_array().iter() { out.push_value(to_i64(v, index, key)?) },
                }
                return Ok(());
            }
        )*};
    }
    copy_as!(i64, i32, i16, i8, u8, u16, u32, u64, bool);
    Err(DataError::type_(format!(
        "example {index}: '{key}' has dtype {}; token ids must be integers",
        array.dtype()
    ))
    .into())
}

/// Lossless conversion to i64 (only u64 can fail).
trait ToI64: Copy {
    fn to_i64(self) -> Option<i64>;
    /// Appends the whole slice when no conversion is needed (int64: a memcpy); false otherwise.
    fn extend_exact(_out: &mut Ragged, _slice: &[Self]) -> bool {
        false
    }
}
macro_rules! to_i64_from {
    ($($t:ty),*) => {$( impl ToI64 for $t { #[inline] fn to_i64(self) -> Option<i64> { i64::try_from(self).ok() } } )*};
}
to_i64_from!(i32, i16, i8, u8, u16, u32, u64);
impl ToI64 for i64 {
    #[inline]
    fn to_i64(self) -> Option<i64> {
        Some(self)
    }
    fn extend_exact(out: &mut Ragged, slice: &[i64]) -> bool {
        out.extend_from_slice(slice);
        true
    }
}
impl ToI64 for bool {
    #[inline]
    fn to_i64(self) -> Option<i64> {
        Some(self as i64)
    }
}

#[inline]
fn to_i64<T: ToI64 + std::fmt::Display>(v: T, index: usize, key: &str) -> Result<i64, DataError> {
    v.to_i64().ok_or_else(|| {
        DataError::value(format!(
            "example {index}: '{key}' holds {v}, outside the int64 range"
        ))
    })
}

/// Appends a contiguous buffer of any integer dtype.
fn extend_from<T: ToI64 + std::fmt::Display>(
    out: &mut Ragged,
    slice: &[T],
    index: usize,
    key: &str,
) -> Result<(), DataError> {
    if T::extend_exact(out, slice) {
        return Ok(());
    }
    for &v in slice {
        out.push_value(to_i64(v, index, key)?);
    }
    Ok(())
}

static TORCH_TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn is_torch_tensor(value: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = value.py();
    // Only look torch up when it is already imported: a tensor cannot exist otherwise.
    if TORCH_TENSOR.get(py).is_none() {
        let loaded = py.import("sys")?.getattr("modules")?.contains("torch")?;
        if !loaded {
            return Ok(false);
        }
    }
    let tensor = TORCH_TENSOR.import(py, "torch", "Tensor")?;
    value.is_instance(tensor)
}

fn read_tensor(
    value: &Bound<'_, PyAny>,
    out: &mut Ragged,
    index: usize,
    key: &str,
) -> PyResult<()> {
    let py = value.py();
    let kwargs = PyDict::new(py);
    kwargs.set_item("force", true)?;
    let array = value.call_method("numpy", (), Some(&kwargs)).map_err(|e| {
        DataError::type_(format!(
            "example {index}: '{key}' is a tensor that cannot be read as token ids: {e}"
        ))
    })?;
    let array = array.cast::<PyUntypedArray>().map_err(|_| {
        DataError::type_(format!(
            "example {index}: '{key}': Tensor.numpy() did not return an array"
        ))
    })?;
    read_array(array, out, index, key)
}
