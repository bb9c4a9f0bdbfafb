//! Every export catches panics: a panic unwinding into the driver's caller (C or C++)
//! aborts the process (Rust ≥ 1.81), and the library must never take a CUDA program
//! down.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::cuda::{CUresult, CUDA_ERROR_UNKNOWN};

/// Runs an export's body; a panic becomes `CUDA_ERROR_UNKNOWN`.
#[inline(always)]
pub fn cuda(body: impl FnOnce() -> CUresult) -> CUresult {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(CUDA_ERROR_UNKNOWN)
}

/// Runs a body whose failure has no error channel (a constructor, a fork handler,
/// `dlsym`); a panic yields `fallback`.
#[inline(always)]
pub fn or<T>(fallback: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(fallback)
}

pub fn quietly(body: impl FnOnce()) {
    or((), body)
}
