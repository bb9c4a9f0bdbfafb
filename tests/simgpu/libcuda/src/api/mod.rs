//! The exported driver API, one module per concept.
//!
//! Every export is `extern "C"`, goes through [`crate::result::guard`] (no panic crosses into C),
//! and follows the CUDA driver API's own contract for its pointer arguments; that contract is
//! the safety documentation of these `unsafe fn`s.
#![allow(clippy::missing_safety_doc, clippy::too_many_arguments)]

pub mod checkpoint;
pub mod cig;
pub mod context;
pub mod copy;
pub mod device;
pub mod entry;
pub mod event;
pub mod graph;
pub mod green;
pub mod launch;
pub mod memory;
pub mod module;
pub mod pool;
pub mod stream;
pub mod vmm;

/// A C `void*` handle (`CUcontext`, `CUstream`, ...). Passed exactly like a pointer on every
/// Linux ABI; the values are tagged indices, never dereferenced.
pub type Handle = usize;
/// `CUdeviceptr`: `unsigned long long` on 64-bit platforms.
pub type DevicePtr = u64;
/// `CUdevice`.
pub type CuDevice = libc::c_int;
