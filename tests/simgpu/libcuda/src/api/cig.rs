//! CUDA 13.2's capture into a graphics command list (CUDA-in-Graphics, "CIG"):
//! `cuStreamBeginCaptureToCig` / `cuStreamEndCaptureToCig`, each also `_ptsz`.
//!
//! The simulated device has no graphics API, so the capture's target is not modelled: the
//! capture behaves as a global-mode stream capture (work is recorded, not run, and a call
//! that would synchronise with the capturing stream invalidates it), and ending it discards
//! what was recorded, as the command list the real driver appends to is the caller's. The
//! arguments are checked as the driver checks them: a stream and the parameters are required.

use super::graph::cuGraphDestroy;
use super::stream::{begin_capture, end_capture};
use super::Handle;
use crate::result::{guard, CUresult, CudaError};
use libc::c_void;

/// `CU_STREAM_CAPTURE_MODE_GLOBAL`.
const GLOBAL: libc::c_int = 0;

fn begin(stream: Handle, params: *const c_void, per_thread: bool) -> Result<(), CudaError> {
    if stream == 0 || params.is_null() {
        return Err(CudaError::InvalidValue);
    }
    begin_capture(stream, GLOBAL, per_thread)
}

fn end(stream: Handle, per_thread: bool) -> Result<(), CudaError> {
    let mut graph = 0;
    end_capture(stream, &mut graph, per_thread)?;
    match cuGraphDestroy(graph) {
        0 => Ok(()),
        _ => Err(CudaError::Unknown),
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCaptureToCig(stream: Handle, params: *const c_void) -> CUresult {
    guard(|| begin(stream, params, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamBeginCaptureToCig_ptsz(
    stream: Handle,
    params: *const c_void,
) -> CUresult {
    guard(|| begin(stream, params, true))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamEndCaptureToCig(stream: Handle) -> CUresult {
    guard(|| end(stream, false))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamEndCaptureToCig_ptsz(stream: Handle) -> CUresult {
    guard(|| end(stream, true))
}
