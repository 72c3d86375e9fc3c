//! The native steps of fasttrain's collators: reading token sequences out of Python objects
//! into one flat buffer (`extract`, GIL held: it walks Python lists), and padding that buffer into
//! a `[rows, width]` batch (`pad`, pure Rust, GIL released); and packing a padded causal-LM batch into one
//! padding-free row where that is exact (`pack`, pure Rust, GIL released). Everything else a collator does
//! (widths, labels, masks, positions) is a few numpy operations on the results, in Python.

pub mod pack;
pub mod pad;
pub mod ragged;

mod extract;
pub mod python;
