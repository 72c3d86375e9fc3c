//! Errors of the native data path, and their mapping to precise Python exceptions.
//!
//! The pure-Rust cores return `DataError`; only the thin `python` layers convert it (through the
//! `From` impl below), so `cargo test` exercises the cores without an interpreter. Messages name
//! what is wrong: the example index, the key, the offending value or type.

use std::fmt;

use pyo3::exceptions::{PyKeyError, PyMemoryError, PyTypeError, PyValueError};
use pyo3::PyErr;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataError {
    /// A value of the right type but unusable (lengths differ, out of range, empty batch) -> ValueError.
    Value(String),
    /// A value of the wrong type (a string or float among token ids, nested lists) -> TypeError.
    Type(String),
    /// A key missing from an example -> KeyError.
    Key(String),
    /// An allocation sized by a setting or the data that cannot be made -> MemoryError (catchable,
    /// as transformers' own MemoryError is; never Rust's abort on a failed allocation).
    Memory(String),
}

impl DataError {
    pub fn value(msg: impl Into<String>) -> Self {
        DataError::Value(msg.into())
    }
    pub fn type_(msg: impl Into<String>) -> Self {
        DataError::Type(msg.into())
    }
    pub fn key(msg: impl Into<String>) -> Self {
        DataError::Key(msg.into())
    }
    pub fn memory(msg: impl Into<String>) -> Self {
        DataError::Memory(msg.into())
    }
    pub fn message(&self) -> &str {
        match self {
            DataError::Value(m) | DataError::Type(m) | DataError::Key(m) | DataError::Memory(m) => {
                m
            }
        }
    }
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for DataError {}

impl From<DataError> for PyErr {
    fn from(err: DataError) -> PyErr {
        match err {
            DataError::Value(m) => PyValueError::new_err(m),
            DataError::Type(m) => PyTypeError::new_err(m),
            DataError::Key(m) => PyKeyError::new_err(m),
            DataError::Memory(m) => PyMemoryError::new_err(m),
        }
    }
}

pub type DataResult<T> = Result<T, DataError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_is_kept() {
        let e = DataError::key("example 3 has no key 'input_ids'");
        assert_eq!(e.to_string(), "example 3 has no key 'input_ids'");
        assert_eq!(DataError::value("x"), DataError::Value("x".into()));
    }
}
