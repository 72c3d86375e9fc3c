//! Errors of the native data path and their mapping to precise Python exceptions.
