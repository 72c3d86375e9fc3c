//! Collation of token sequences: the Rust side of fasttrain's drop-in data collators.
//!
//! `ragged`, `pad` and `flatten` are pure Rust (no Python types) so `cargo test` covers the
//! logic without an interpreter. `extract` reads Python values (lists, tuples, numpy arrays,
//! torch tensors) into `Ragged` buffers, and `python` holds the `#[pyfunction]`s, which extract
//! once with the GIL held, do the work with it released and hand back numpy arrays.

pub mod flatten;
pub mod pad;
pub mod ragged;

mod extract;
pub mod python;
