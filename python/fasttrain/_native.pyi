"""Type stub for the native module ``fasttrain._native`` (Rust, PyO3)."""

__version__: str
