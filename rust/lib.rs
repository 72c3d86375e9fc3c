//! fasttrain's native data path, exposed to Python as `fasttrain._native`.
//!
//! The pure-Rust cores (`collate`, `sampler`) know nothing of Python so `cargo test` needs no
//! interpreter; each has a thin `python` submodule that extracts inputs once, releases the GIL for
//! the work and hands back numpy buffers. This file only wires the modules together.

pub mod collate;
pub mod errors;
pub mod sampler;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    collate::python::register(m)?;
    sampler::python::register(m)?;
    Ok(())
}
