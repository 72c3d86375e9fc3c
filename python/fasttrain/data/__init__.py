"""Native (Rust) batching and sampling: drop-in collators and the length-grouped sampler."""
